"""Train moerun's built-in default model: a tiny qwen3moe on the Python standard library's own source.

The corpus is the stdlib's .py files (code, comments and docstrings), in sorted path order, without test
folders, site-packages and generated tables; every VAL_EVERY-th file is held out for validation. The
tokenizer is moerun.tools.tokenizer's deterministic byte-level BPE. Everything is seeded, and on one
thread (the default) a rerun on the same Python and torch versions gives the same weights.

    python -m moerun.tools.train_default [--steps N] [--threads 1] [--seed 0] [--out DIR] [--quick]
    python -m moerun.tools.train_default --shape routing --steps 800 --threads 2 --out DIR --gguf FILE

writes a Hugging Face folder (config, safetensors, tokenizer.json, tokenizer_config.json with ChatML,
train_summary.json); `--gguf moerun/data/default-qwen3moe.gguf` also converts it with moerun.tools.convert.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from moerun.tools.tokenizer import build_tokenizer, write_hf_tokenizer

VOCAB = 2048
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
             "encodings", "pydoc_data"}  # encodings: charmap tables; pydoc_data: one huge string literal
VAL_EVERY = 40  # every 40th file (sorted order) is validation
EOT = "<|endoftext|>"
GGUF_NAME = "moerun-default-qwen3moe"

MODEL = {
    "hidden_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "intermediate_size": 192,
    "norm_topk_prob": True, "tie_word_embeddings": False, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "router_aux_loss_coef": 0.01,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False, "attention_bias": False,
}


# The routing bench model (issue 19): the expert ratio of the real small-active models (64 experts, top-8, 8
# layers), the built-in model's vocabulary and corpus; its routing traces are the expert cache's test material.
ROUTING = {**MODEL, "hidden_size": 128, "num_hidden_layers": 8, "head_dim": 32, "num_experts": 64,
           "num_experts_per_tok": 8, "moe_intermediate_size": 64, "intermediate_size": 128}
SHAPES = {"default": (MODEL, GGUF_NAME), "routing": (ROUTING, "moerun-routing-qwen3moe")}


def corpus_files() -> list[Path]:
    """The stdlib's .py files, sorted by relative path, without test folders and generated tables."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(stdlib).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def token_streams(tok, files: list[Path]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, val ids, corpus bytes): documents joined by <|endoftext|>, as one flat int64 stream each."""
    eot = tok.token_to_id(EOT)
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    streams: dict[bool, list[int]] = {False: [], True: []}
    for i, enc in enumerate(tok.encode_batch(texts)):
        streams[i % VAL_EVERY == VAL_EVERY - 1] += enc.ids + [eot]
    n_bytes = sum(len(t.encode()) for t in texts)
    return torch.tensor(streams[False]), torch.tensor(streams[True]), n_bytes


def make_model(tok, seed: int, shape: str = "default", aux_coef: float | None = None):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    eot = tok.token_to_id(EOT)
    fields = SHAPES[shape][0] | ({} if aux_coef is None else {"router_aux_loss_coef": aux_coef})
    cfg = Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                         **fields)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq: int, max_windows: int = 48, batch: int = 16) -> float:
    """Mean next-token cross-entropy over the first `max_windows` non-overlapping windows of `val`."""
    model.eval()
    n = min(max_windows, (len(val) - 1) // seq)
    windows = val[: n * seq + 1]
    total = 0.0
    for s in range(0, n, batch):
        ids = torch.stack([windows[i * seq: i * seq + seq] for i in range(s, min(s + batch, n))])
        total += model(input_ids=ids, labels=ids).loss.item() * len(ids)
    model.train()
    return total / n


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = build_tokenizer(VOCAB)
    files = corpus_files()
    train_ids, val_ids, n_bytes = token_streams(tok, files)
    print(f"corpus: {len(files)} files, {n_bytes / 1e6:.2f} MB, {len(train_ids):,} train / {len(val_ids):,} val "
          f"tokens ({n_bytes / (len(train_ids) + len(val_ids)):.2f} bytes/token), {time.time() - t0:.1f} s",
          flush=True)

    model = make_model(tok, args.seed, args.shape, args.aux_coef)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active = n_params - cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    print(f"model: {n_params:,} parameters, {active:,} active per token", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(100, args.steps // 20))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    seq, bs = args.seq, args.batch
    coef = cfg.router_aux_loss_coef
    log: list[dict] = []
    model.train()
    t_start, ce_acc, aux_acc, n_acc = time.time(), 0.0, 0.0, 0
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - seq - 1, (bs,), generator=gen)
        ids = torch.stack([train_ids[s: s + seq] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = out.aux_loss.item()
        ce_acc += out.loss.item() - coef * aux
        aux_acc += aux
        n_acc += 1
        last = step == args.steps - 1
        if (step + 1) % args.log_every == 0 or last:
            elapsed = time.time() - t_start
            tps = (step + 1) * bs * seq / elapsed
            entry = {"step": step + 1, "train_loss": round(ce_acc / n_acc, 4), "aux_loss": round(aux_acc / n_acc, 4),
                     "lr": round(lr_at(step), 6), "tok_per_s": round(tps), "elapsed_s": round(elapsed, 1)}
            if (step + 1) % args.eval_every == 0 or last:
                entry["val_loss"] = round(evaluate(model, val_ids, seq), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)
            ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
    wall = time.time() - t_start

    out_dir = Path(args.out).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.save_pretrained(out_dir)
    write_hf_tokenizer(tok, out_dir, "qwen3moe")  # Qwen3's published chat template
    # A base model: documents end with <|endoftext|>, so generation stops there rather than at <|im_end|>.
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["eos_token"] = EOT
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    summary = {"params": n_params, "active_params": active, "files": len(files), "corpus_bytes": n_bytes,
               "train_tokens": len(train_ids), "val_tokens": len(val_ids), "steps": args.steps, "batch": bs,
               "seq": seq, "lr": args.lr, "aux_coef": coef, "seed": args.seed, "threads": args.threads,
               "tokens_seen": args.steps * bs * seq, "train_wall_s": round(wall, 1),
               "tok_per_s": round(args.steps * bs * seq / wall), "final_train_loss": log[-1]["train_loss"],
               "final_val_loss": log[-1]["val_loss"], "torch": torch.__version__,
               "python": sysconfig.get_python_version(), "log": log}
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {out_dir}; {args.steps} steps in {wall:.0f} s ({summary['tok_per_s']} tok/s); "
          f"final train loss {summary['final_train_loss']}, val loss {summary['final_val_loss']}", flush=True)
    if args.gguf:
        from moerun.tools.convert import convert_hf_to_gguf

        path = convert_hf_to_gguf(out_dir, args.gguf, ftype="F16", overwrite=True, progress=False,
                                  name=SHAPES[args.shape][1])
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)", flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default",
                    help="default: the built-in model; routing: the routing bench model (64 experts, top-8, 8 layers)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--aux-coef", type=float, help="the router's load-balancing loss weight (default: the shape's, "
                    "0.01; Qwen3-30B-A3B was trained with 0.001)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--out", default="~/.cache/moerun/train_default")
    ap.add_argument("--gguf", help="also convert the result to this GGUF file (F16), e.g. "
                    "moerun/data/default-qwen3moe.gguf")
    ap.add_argument("--quick", action="store_true", help="a few steps, for smoke tests")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.log_every, args.eval_every = 6, 3, 6
    train(args)


if __name__ == "__main__":
    main()
