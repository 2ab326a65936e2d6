"""The cost model for one model over N hosts (DESIGN decision 16): expert parallelism against a pipeline split,
from the one-host figures (costmodel.py) and a link's bandwidth and latency. Pure: no I/O, no torch.

Expert parallelism, per step of T tokens (every rank at once; the step is the slowest rank's):

    t_ep     = dense (every rank runs all of it) + head (rank 0) + overhead
             + experts / N x imbalance          the busiest rank's share of the step's experts
             + control                          rank 0 tells the others the step: latency + bytes / link
             + moe_layers x (N - 1) x (latency + T x hidden x 4 / link)   one all-gather (a ring) per MoE layer

imbalance: the expected largest share of a token's k experts any rank holds, over k / N (routing uniform,
experts in N equal ranges: the multivariate hypergeometric's expected maximum, exact); for T > 1 tokens the
ranks' distinct experts even out and it is taken as 1. Prefill: each rank runs the dense part for the whole
prompt and 1/N of the experts' FLOPs and bytes, plus the all-gathers of every chunk.

A pipeline of N stages (contiguous layers, one host each): a token passes every stage in turn, so a step costs
what one host holding everything costs, plus N - 1 hops of the hidden state, the logits back to rank 0 and
the control messages. Both read every expert from RAM (the hosts' memory together holds the model); the
one-host figure is the workload as given (its own hit rates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from moerun.placement.costmodel import DEFAULT_UBATCH, Rates, Workload, decode_time, prefill_time

GB = 1e9
CONTROL_BYTES = 256  # a step's control message: header and payload words


@dataclass(frozen=True)
class Link:
    """The network between hosts: gbits per second and one message's latency in seconds."""

    gbits: float
    latency_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * 8 / (self.gbits * GB)


def imbalance(n_experts: int, k: int, ranks: int) -> float:
    """E[max over ranks of a token's experts on that rank] / (k / ranks): k of n_experts drawn without
    replacement, the experts in `ranks` contiguous balanced ranges."""
    if ranks <= 1 or k == 0:
        return 1.0
    sizes = [sum(1 for e in range(n_experts) if e * ranks // n_experts == r) for r in range(ranks)]
    ways: dict[tuple[int, int], int] = {(0, 0): 1}  # (drawn so far, max count so far) -> ways
    for s in sizes:
        nxt: dict[tuple[int, int], int] = {}
        for (j, m), n in ways.items():
            for c in range(min(s, k - j) + 1):
                key = (j + c, max(m, c))
                nxt[key] = nxt.get(key, 0) + n * math.comb(s, c)
        ways = nxt
    total = math.comb(n_experts, k)
    mean_max = sum(m * n for (j, m), n in ways.items() if j == k) / total
    return mean_max / (k / ranks)


def _resident(w: Workload, ranks: int = 1) -> Workload:
    """w with every expert read from RAM, and each routed-expert tensor's bytes and parameters over `ranks`."""
    parts = tuple(replace(p, nbytes=p.nbytes // ranks, params=p.params // ranks, tier="ram")
                  if p.cls == "routed_experts" else p for p in w.parts)
    return replace(w, parts=parts, hit_rate=(1.0,) * len(w.hit_rate))


@dataclass(frozen=True)
class Split:
    """One way to run the model over N hosts: decode seconds per step by term, prefill seconds."""

    name: str
    compute_s: float  # what the hosts compute (EP: the busiest rank's; pipeline: the stages in turn)
    comm_s: float  # messages on the link
    prefill_s: float
    batch: int
    n_prompt: int

    @property
    def decode_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def tok_s(self) -> float:
        return self.batch / self.decode_s if self.decode_s > 0 else math.inf

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else math.inf

    def to_dict(self) -> dict:
        return {"decode_s": self.decode_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "tok_s": self.tok_s, "prefill_s": self.prefill_s, "prefill_tok_s": self.prefill_tok_s}


def expert_parallel(w: Workload, rates: Rates, ranks: int, link: Link, moe_layers: int, batch: int = 1,
                    n_prompt: int = 512, ubatch: int = DEFAULT_UBATCH) -> Split:
    shard = _resident(w, ranks)
    t = decode_time(shard, rates, batch=batch)
    skew = imbalance(w.n_experts, w.n_experts_used, ranks) if batch == 1 else 1.0
    compute = t.dense + t.experts_hit * skew + t.overhead + t.head
    gather = moe_layers * (ranks - 1)
    comm = link.seconds(CONTROL_BYTES + 8 * batch) + gather * link.seconds(batch * w.hidden * 4)
    pre = prefill_time(shard, rates, n_prompt, ubatch).seconds
    chunks = -(-n_prompt // ubatch)
    pre_comm = chunks * link.seconds(CONTROL_BYTES + 8 * ubatch) + sum(
        gather * link.seconds(min(ubatch, n_prompt - c * ubatch) * w.hidden * 4) for c in range(chunks))
    return Split("expert parallel", compute, comm, pre + pre_comm, batch, n_prompt)


def pipeline(w: Workload, rates: Rates, ranks: int, link: Link, vocab: int, batch: int = 1, n_prompt: int = 512,
             ubatch: int = DEFAULT_UBATCH) -> Split:
    whole = _resident(w)
    t = decode_time(whole, rates, batch=batch)
    comm = (ranks - 1) * (link.seconds(CONTROL_BYTES) + link.seconds(batch * w.hidden * 4)) + \
        link.seconds(batch * vocab * 4)
    chunks = -(-n_prompt // ubatch)
    pre_comm = sum((ranks - 1) * (link.seconds(CONTROL_BYTES) + link.seconds(min(ubatch, n_prompt - c * ubatch)
                                                                             * w.hidden * 4))
                   + link.seconds(vocab * 4) for c in range(chunks))
    pre = prefill_time(whole, rates, n_prompt, ubatch).seconds + pre_comm
    return Split(f"pipeline of {ranks} stages", t.total, comm, pre, batch, n_prompt)


def compare(w: Workload, rates: Rates, ranks: int, link: Link, moe_layers: int, vocab: int, batch: int = 1,
            n_prompt: int = 512, ubatch: int = DEFAULT_UBATCH) -> dict:
    """Both splits over `ranks` hosts, and which decodes faster."""
    ep = expert_parallel(w, rates, ranks, link, moe_layers, batch, n_prompt, ubatch)
    pp = pipeline(w, rates, ranks, link, vocab, batch, n_prompt, ubatch)
    return {"ranks": ranks, "link_gbits": link.gbits, "link_latency_s": link.latency_s,
            "imbalance": imbalance(w.n_experts, w.n_experts_used, ranks), "expert_parallel": ep.to_dict(),
            "pipeline": pp.to_dict(), "better": "expert parallel" if ep.decode_s <= pp.decode_s else "pipeline"}


def lines(c: dict) -> list[str]:
    """compare()'s figures as estimate prints them."""
    out = [f"over {c['ranks']} hosts, link {c['link_gbits']:g} Gbit/s and {c['link_latency_s'] * 1e6:g} us:"]
    for key, name in (("expert_parallel", f"expert parallel (imbalance x{c['imbalance']:.2f})"),
                      ("pipeline", f"pipeline of {c['ranks']} stages")):
        s = c[key]
        out.append(f"  {name:<34} decode {s['tok_s']:8.1f} tok/s ({s['decode_s'] * 1e3:.2f} ms = compute "
                   f"{s['compute_s'] * 1e3:.2f} + link {s['comm_s'] * 1e3:.2f}), prefill {s['prefill_tok_s']:.1f} "
                   "tok/s")
    out.append(f"  better for decode: {c['better']}")
    return out
