"""Checks every family's acceptance test runs the same way (issue 16): llama.cpp's names and keys in our GGUF
(gguf-py's own tables), GGUF files rewritten as other converters write them, the quantized path through the C
kernels against transformers on gguf.quants' weights, inspect's counts against transformers' tensors, greedy
runs through the runtime (caches, stages, the stand-in, a GPU), a real server answering the `openai` client,
and the estimator's bytes per token."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_models import reference_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from toolkit import ServerProcess, free_port  # noqa: F401 (test_server_reasoning imports free_port)

from moerun.cli import main
from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.loading import load_model
from moerun.model.fused import FusedAttention
from moerun.runtime import build as build_runtime

TEXT = "the quick brown fox jumps over the lazy dog, and then the quick brown fox"


def add_mtp_layer(folder, config) -> None:
    """Append a next-token-prediction (NextN / MTP) layer as GLM-4.5's and DeepSeek-V3's checkpoints store it:
    a whole decoder layer at index num_hidden_layers plus eh_proj, enorm, hnorm, shared_head and its own
    embeddings (random: running it would change every logit). transformers builds num_hidden_layers layers and
    ignores it."""
    from safetensors.torch import load_file, save_file

    n, H, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    mtp = {}
    for name, t in state.items():
        if name.startswith(f"model.layers.{n - 1}."):
            mtp[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = torch.randn(t.shape, generator=g)
    p = f"model.layers.{n}."
    mtp |= {p + "eh_proj.weight": torch.randn(H, 2 * H, generator=g), p + "enorm.weight": torch.ones(H),
            p + "hnorm.weight": torch.ones(H), p + "shared_head.norm.weight": torch.ones(H),
            p + "shared_head.head.weight": torch.randn(V, H, generator=g),
            p + "embed_tokens.weight": torch.randn(V, H, generator=g)}
    save_file(state | mtp, str(folder / "model.safetensors"), metadata={"format": "pt"})


def gguf_fields(path, arch: str) -> dict:
    """The GGUF's `{arch}.*` scalar keys, without the prefix, read by gguf-py."""
    import gguf

    out = {}
    for k, f in gguf.GGUFReader(str(path)).fields.items():
        if k.startswith(arch + ".") and f.types[0] != gguf.GGUFValueType.ARRAY:
            v = f.parts[f.data[0]]
            out[k.removeprefix(arch + ".")] = (bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING
                                               else v.tolist()[0])
    return out


def names_outside_llama_cpp(path, model_arch) -> list[str]:
    """The GGUF's tensor names that llama.cpp's architecture `model_arch` (a gguf.MODEL_ARCH) does not have."""
    import gguf

    allowed = [re.compile(re.escape(gguf.TENSOR_NAMES[t]).replace(r"\{bid\}", r"\d+") + r"(\.(weight|bias))?$")
               for t in gguf.MODEL_TENSORS[model_arch]]
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    return [n for n in names if not any(rx.match(n) for rx in allowed)]


def count_kernel_calls(ops, names: tuple[str, ...] = ("matmul", "moe_ffn_experts", "moe_ffn"),
                       fused=None) -> dict[str, int]:
    """Count the C kernels' calls of `names` (moerun.kernels.cpu functions) made through `ops` (KernelOps) from
    now on, and with `fused` (a model's FusedAttention) its calls of moerun.kernels.layer functions; "experts"
    counts routed-expert calls of either form (experts one by one, or their stacks); "matmul" counts the matrices
    multiplied, one call each or several in one `matmuls` call."""
    calls = dict.fromkeys(names, 0)
    calls["experts"] = 0
    ops.cpu = _spy(ops.cpu, calls)
    if fused is not None:
        fused.kl = _spy(fused.kl, calls)
    return calls


def _spy(real, calls: dict[str, int]):

    class Spy:
        def __getattr__(self, name):
            f = getattr(real, name)
            if name == "matmuls" and "matmul" in calls and name not in calls:

                def several(x, ws, *a, **kw):
                    calls["matmul"] += len(ws)
                    return f(x, ws, *a, **kw)

                return several
            if name not in calls:
                return f

            def counted(*a, **kw):
                calls[name] += 1
                calls["experts"] += name in ("moe_ffn_experts", "moe_ffn")
                return f(*a, **kw)

            return counted

    return Spy()


def rel_err(got, ref) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def run(path: str, **kw) -> tuple[list[int], torch.Tensor, int, int]:
    """Greedy tokens, the prompt's logits in two prefill chunks, the expert cache's misses (0 without one)
    and the number of stages."""
    rt = build_runtime(RuntimeConfig(model=path, threads=1, **kw))
    eng = rt.engine
    ids = eng.tokenizer.encode(TEXT)
    gen = eng.generate(ids, SamplingParams.greedy(max_tokens=24, ignore_eos=True)).run()
    gen.seq.free()  # the engine's pool serves one sequence at a time (sliding-window rings)
    seq = eng.new_sequence()
    logits = torch.cat([eng.model.forward(torch.tensor(ids[:9]), seq.kv),
                        eng.model.forward(torch.tensor(ids[9:]), seq.kv)]).cpu()
    misses = eng.expert_cache.stats.get().misses if eng.expert_cache is not None else 0
    rt.close()
    return gen.tokens, logits, misses, len(rt.stages)


def check_greedy_generate(model, path, prompt: list[int], ubatch: int, n: int = 32) -> None:
    """Greedy tokens from the model file at `path` (the prompt prefilled in chunks of `ubatch`) equal transformers'
    generate(do_sample=False) on `model`."""
    from moerun.engine.engine import Engine
    from moerun.loading import load_model
    from moerun.text import Tokenizer

    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0)[0, len(prompt):].tolist()
    loaded = load_model(path)
    eng = Engine(loaded.model, Tokenizer.from_model_file(loaded.file), ctx_size=256, ubatch=ubatch)
    gen = eng.generate(prompt, SamplingParams.greedy(max_tokens=n, ignore_eos=True)).run()
    assert gen.tokens == ref


def check_expert_cache(path: str) -> None:
    """Greedy tokens and every logit equal with caches of 1 and 3 slots, prefill through the cache, and a
    MiB-sized one, each of which missed."""
    ref_tokens, ref_logits, _, _ = run(path)
    for kw in ({"expert_cache_slots": 1}, {"expert_cache_slots": 3}, {"expert_cache_slots": 3, "cache_prefill": "cache"},
               {"expert_cache_mib": 0.05}):
        tokens, logits, misses, _ = run(path, **kw)
        assert misses > 0, kw
        assert tokens == ref_tokens, kw
        assert torch.equal(logits, ref_logits), kw


def check_two_cpu_stages(path: str, split: tuple[float, float]) -> None:
    ref = run(path)
    got = run(path, devices=("cpu", "cpu"), tensor_split=split, expert_cache_slots=3)
    assert got[3] == 2 and got[2] > 0
    assert got[0] == ref[0] and (got[1] - ref[1]).abs().max().item() < 1e-4


def check_standin_miss_paths(path: str) -> None:
    """Forced page-in, forced home and the cost model's choice on the stand-in device: the CPU's greedy tokens."""
    ref = run(path, repack=False)
    for mode in ("fetch", "home", "auto"):
        got = run(path, devices=("standin:0",), expert_cache_slots=2, miss_path=mode)
        assert got[0] == ref[0] and got[2] > 0, mode


def check_standin_hf_logits(folder, model, tokens, logits=None) -> None:
    """fp32 weights of an HF folder on the stand-in device with 2 expert slots: transformers' logits (`model`)
    within 1e-4. logits(model, tokens, kv): how the tokens run (default: one forward)."""
    from hf_models import reference_logits

    rt = build_runtime(RuntimeConfig(model=str(folder), devices=("standin:0",), expert_cache_slots=2, threads=1))
    assert rt.stages[0].model.dev.kind == "standin"
    kv = rt.engine.new_sequence().kv
    got = (logits(rt.engine.model, tokens, kv) if logits else rt.engine.model.forward(tokens, kv)).cpu()
    assert (got - reference_logits(model, tokens)).abs().max().item() < 1e-4
    rt.close()


def check_triton_standin(path: str, tokens, monkeypatch=None) -> None:
    """The stand-in device's Triton kernels (MOERUN_STANDIN_KERNELS=triton, TRITON_INTERPRET=1: set here through
    `monkeypatch`, else by the caller) give the torch reference's logits on the CPU within 1e-3
    (prompt_and_steps)."""
    pytest.importorskip("triton")
    if monkeypatch is not None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("MOERUN_STANDIN_KERNELS", "triton")
    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.loading import load_model

    model = load_model(path, kernels=False).model
    ref = prompt_and_steps(model, SeqKV(KVPool(model.spec, 64), 64), tokens)
    rt = build_runtime(RuntimeConfig(model=path, devices=("standin:0",), expert_cache_slots=2, miss_path="fetch",
                                     threads=1))
    assert type(rt.stages[0].model.ops).__name__ == "TritonOps"
    got = prompt_and_steps(rt.engine.model, rt.engine.new_sequence().kv, tokens)
    assert (got - ref).abs().max().item() < 1e-3
    rt.close()


def prompt_and_steps(model, kv, tokens) -> torch.Tensor:
    """Logits of a prefill in two chunks, then four single-token steps."""
    out = [model.forward(tokens[:20], kv), model.forward(tokens[20:], kv)]
    return torch.cat(out + [model.forward(t.view(1), kv) for t in tokens[:4]]).float().cpu()


def check_server_completion(path: str, tmp_path) -> None:
    """One /v1/completions request through the openai client on a real `moerun serve`: the engine's greedy
    text."""
    import openai

    ref_rt = build_runtime(RuntimeConfig(model=path, threads=1))
    eng = ref_rt.engine
    want = eng.generate(eng.tokenizer.encode("Hello there"), SamplingParams.greedy(max_tokens=12,
                                                                                    ignore_eos=True)).run().text
    ref_rt.close()
    server = ServerProcess(["-m", path, "-t", "1", "-c", "256", "-np", "1"], tmp_path / "serve.log", wait=120)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        r = client.completions.create(model=name, prompt="Hello there", max_tokens=12, temperature=0)
        assert r.choices[0].text == want and r.usage.completion_tokens == 12
    finally:
        server.stop()


def independent_counts(model, n_experts: int) -> tuple[int, int]:
    """Total and active parameters from a transformers model's own tensors (its state dict: parameters and saved
    buffers): active = everything but the routed experts (`.mlp.experts.`, weights and biases), plus k/E of them."""
    state = model.state_dict()
    total = sum(t.numel() for t in state.values())
    routed = sum(t.numel() for n, t in state.items() if ".mlp.experts." in n)
    return total, total - routed + routed * model.config.num_experts_per_tok // n_experts


def check_inspect_counts(path, model, n_experts: int | None = None) -> dict:
    """`moerun inspect --json` on `path` reports independent_counts(model) (n_experts: the model's routed
    experts, by default from its config) -> its JSON."""
    n_experts = n_experts or getattr(model.config, "n_routed_experts", None) or model.config.num_local_experts
    from click.testing import CliRunner

    from moerun.cli import main

    r = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["total_params"], d["active_params"]) == independent_counts(model, n_experts)
    return d


def dequantized_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file as gguf.quants dequantizes it (float32), by GGUF name: what the tests' oracles
    (transformers models holding those weights) are built from."""
    import gguf

    return {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
            for t in gguf.GGUFReader(str(path)).tensors}


def gguf_bytes_per_token(path: str, arch: str) -> int:
    """Bytes one decode token reads, from gguf-py's reader: every tensor but the routed experts whole, k/E of
    the routed experts, one embedding row."""
    import gguf

    kv = gguf_fields(path, arch)
    E, k = kv["expert_count"], kv["expert_used_count"]
    dense = experts = row = 0
    for t in gguf.GGUFReader(path).tensors:
        if "_exps" in t.name:
            experts += int(t.n_bytes)
        elif t.name == "token_embd.weight":
            row = int(t.n_bytes) // int(t.shape[-1])
        else:
            dense += int(t.n_bytes)
    return dense + experts * k // E + row


def rewrite_gguf(src, out, key: Callable | None = None, tensor: Callable | None = None,
                 finish: Callable | None = None) -> None:
    """Copy the GGUF `src` to `out` through gguf-py's reader and writer, as another converter would have
    written it: key(name, value) -> the value (None drops the key) for each scalar key; tensor(name, data)
    -> the [(name, data)] to write for each tensor (torch-order numpy arrays); finish(writer) adds the new."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            vals = [bytes(f.parts[i]).decode() if sub == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0]
                    for i in f.data]
            w.add_key_value(k, vals, vtype, sub_type=sub)
            continue
        v = f.parts[f.data[0]]
        v = bytes(v).decode() if vtype == gguf.GGUFValueType.STRING else v.tolist()[0]
        v = v if key is None else key(k, v)
        if v is not None:
            w.add_key_value(k, v, vtype)
    for t in r.tensors:
        data = np.array(t.data).reshape([int(d) for d in reversed(t.shape)])
        for name, d in [(t.name, data)] if tensor is None else tensor(t.name, data):
            w.add_tensor(name, d)
    if finish is not None:
        finish(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def dequantized_reference(path, config, names: dict[str, str], join: Callable | None = None):
    """transformers' model holding the GGUF's weights as gguf.quants dequantizes them (the independent
    oracle). names: the family's GGUF kinds -> names within transformers' layer (written from the two
    projects' conventions, not from moerun's table); the experts' gate and up go into gate_up_proj;
    join(prefix, parts) -> {name: tensor} from the layer's other kinds (parts: kind -> tensor)."""
    from transformers import AutoModelForCausalLM

    state, parts = {}, {}
    for name, w in dequantized_tensors(path).items():
        if name in _TOP:
            state[_TOP[name]] = w
            continue
        _, layer, kind = name.split(".", 2)
        if kind in names:
            state[f"model.layers.{layer}.{names[kind]}"] = w
        else:
            parts.setdefault(layer, {})[kind] = w
    for layer, p in parts.items():
        prefix = f"model.layers.{layer}."
        if "ffn_gate_exps.weight" in p:
            state[prefix + "mlp.experts.gate_up_proj"] = torch.cat((p.pop("ffn_gate_exps.weight"),
                                                                    p.pop("ffn_up_exps.weight")), dim=1)
        if p:
            state |= join(prefix, p)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    return model


def kernel_path_errors(path: str, oracle, model, tokens) -> tuple[dict[str, int], float, float]:
    """A quantized GGUF through the torch reference (within 1e-4 of `oracle`, transformers on gguf.quants'
    weights) and through the C kernels (a whole prompt at once: the layer loop, not the fused small-step path)
    -> the kernels' call counts and the relative logit error against the oracle and against `model` (fp32)."""
    pytest.importorskip("moerun.kernels._cpu")
    want = reference_logits(oracle, tokens)
    assert (load_model(path, kernels=False).model.forward(tokens) - want).abs().max().item() < 1e-4
    fast = load_model(path)
    assert fast.model.ops.name == "cpu-kernels" and len(tokens) > FusedAttention.MAX_ROWS
    calls = count_kernel_calls(fast.model.ops, ("matmul", "moe_ffn_experts", "moe_ffn", "glu_down"))
    got = fast.model.forward(tokens)
    calls["matmul"] += calls.pop("glu_down")  # an FFN's down projection, behind its activation
    return calls, rel_err(got, want), rel_err(got, reference_logits(model, tokens))


def check_gpu_logits(folder, model, path: str, tokens, slots: int | None) -> None:
    """On cuda:0: fp32 HF weights within 1e-4 of transformers; the GGUF's blocks through the Triton kernels
    within 2e-3 of the torch reference on the CPU."""
    rt = build_runtime(RuntimeConfig(model=str(folder), devices=("cuda:0",), expert_cache_slots=slots))
    assert rt.stages[0].model.dev.is_cuda
    got = prompt_and_steps(rt.engine.model, rt.engine.new_sequence().kv, tokens)[:len(tokens)]
    assert (got - reference_logits(model, tokens)).abs().max().item() < 1e-4
    ref_model = load_model(path, kernels=False).model
    ref = prompt_and_steps(ref_model, SeqKV(KVPool(ref_model.spec, 64), 64), tokens)
    rt = build_runtime(RuntimeConfig(model=path, devices=("cuda:0",), expert_cache_slots=slots))
    assert type(rt.stages[0].model.ops).__name__ == "TritonOps"
    got = prompt_and_steps(rt.engine.model, rt.engine.new_sequence().kv, tokens)
    assert (got - ref).abs().max().item() < 2e-3


def check_estimate(path: str, arch: str, tmp_path, monkeypatch) -> dict:
    """`moerun estimate --json` on the CPU: bytes per token as gguf's reader counts them
    (gguf_bytes_per_token), the shared experts and dense layers among them -> the JSON."""
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["estimate", path, "-t", "1", "--ram-bw", "10", "--device", "cpu",
                                    "--json", "--no-measure"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["bytes_per_token"] == pytest.approx(gguf_bytes_per_token(path, arch), abs=8)
    by_class = d["bytes_per_token_by_class"]
    assert by_class["shared_experts"] > 0 and by_class["dense_ffn"] > 0
    assert d["decode"]["expected"]["tok_s"] > 0
    return d


class NoisyOracle:
    """A drafter that knows the greedy continuation (`ref`, after `prompt`) and gets every `every`-th drafted
    token wrong: steps keep some drafts and reject the rest, at every depth (moerun.engine.speculative)."""

    name = "oracle"

    def __init__(self, prompt: list[int], ref: list[int], vocab: int, every: int = 3):
        self.text, self.start, self.vocab, self.every = prompt + ref, len(prompt), vocab, every
        self.calls = 0

    def session(self):
        return self

    def prime(self, context):
        pass

    def propose(self, context, n, p_min):
        at = len(context)
        if self.text[:at] != list(context):
            return []
        out = self.text[at:at + n]
        self.calls += 1
        return [(t + 1) % self.vocab if (self.calls + i) % self.every == 0 else t for i, t in enumerate(out)]

    def free(self):
        pass


def check_speculative(path: str, n: int = 24) -> None:
    """Greedy tokens with prompt lookup, with the model as its own draft (every draft accepted), and with drafts
    that are partly wrong (steps rolled back at every depth) equal those without drafts; a seeded sampled run
    gives its tokens with drafts too."""
    from moerun.config import DraftParams

    def tokens(params=None, drafter=None, **kw):
        rt = build_runtime(RuntimeConfig(model=path, threads=1, **kw))
        eng = rt.engine
        if drafter is not None:
            eng.drafter = drafter
        ids = eng.tokenizer.encode(TEXT)
        gen = eng.generate(ids, params or SamplingParams.greedy(max_tokens=n, ignore_eos=True)).run()
        rt.close()
        return ids, gen.tokens, gen.timings

    ids, ref, t = tokens()
    assert t.draft_n is None
    _, got, t = tokens(draft=DraftParams(lookup_ngram=3, adaptive=False))
    assert got == ref and t.draft_n > 0
    _, got, t = tokens(draft=DraftParams(lookup_ngram=2))  # lengths chosen as it goes
    assert got == ref
    _, got, t = tokens(model_draft=path, draft=DraftParams(draft_p_min=0.0, adaptive=False))
    assert got == ref and t.draft_n == t.draft_n_accepted > n // 2
    rt = build_runtime(RuntimeConfig(model=path, threads=1))
    oracle = NoisyOracle(ids, ref, rt.engine.model.spec.vocab)
    rt.close()
    _, got, t = tokens(drafter=oracle, draft=DraftParams(draft_max=5, adaptive=False))
    assert got == ref and 0 < t.draft_n_accepted < t.draft_n
    sampled = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, max_tokens=n, ignore_eos=True)
    _, plain, _ = tokens(sampled)
    _, got, t = tokens(sampled, model_draft=path, draft=DraftParams(draft_p_min=0.0))
    assert got == plain and t.draft_n > 0


def check_kv_types(path: str) -> None:
    """f16 and q8_0 keys and values (moerun.engine.kv_types) through every layer kind: the logits of a prompt (two
    chunks) and of decode steps equal those of a float32 cache whose values are rounded through the type as they
    are written (the torch path for both). The rounding itself is gguf.quants' (tests/test_kv_types.py), so this
    checks where the cache stores, rings and reads them. Logits against an unrounded cache are not compared
    here: these presets' routers have near ties, and a 1e-5 relative change of the cache already moves the tiny
    gpt-oss's logits by 6% (measured). A model whose rows are not whole blocks of 32 gets one clear error."""
    from moerun.engine.kv_types import KV_TYPES, KVType

    def logits(kv: str | None, rounding: KVType | None = None) -> torch.Tensor:
        rt = build_runtime(RuntimeConfig(model=path, threads=1, cache_type_k=kv, cache_type_v=kv))
        eng = rt.engine
        eng.model.fused = None  # the float32 reference goes through SeqKV.write, like the other types
        ids = eng.tokenizer.encode(TEXT)
        seq = eng.new_sequence()
        encode = KVType.encode
        if rounding is not None:
            KVType.encode = lambda self, x, stored: rounding.decode(encode(rounding, x, torch.uint8 if rounding.qtype
                                                                            else rounding.dtype),
                                                                     tuple(x.shape[1:]), torch.float32).to(stored)
        try:
            out = [eng.model.forward(torch.tensor(ids[:9]), seq.kv), eng.model.forward(torch.tensor(ids[9:]), seq.kv)]
            out += [eng.model.forward(torch.tensor([t]), seq.kv) for t in ids[:6]]
        finally:
            KVType.encode = encode
        rt.close()
        return torch.cat(out)

    for t in ("f16", "q8_0"):
        try:
            got = logits(t)
        except ValueError as e:
            assert t == "q8_0" and "blocks of 32" in str(e)
            continue
        ref = logits(None, KV_TYPES[t])
        assert (got - ref).abs().max().item() < 1e-4, t
