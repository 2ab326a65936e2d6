"""From a RuntimeConfig to a running engine: plan the placement, load per the plan, attach the expert cache.

formats -> arch (metadata only) -> placement (pure plan) -> weights (loaded per plan) -> experts (cache)
-> engine. The plan is returned too, so the CLI can print it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psutil
import torch

from moerun.arch import resolve
from moerun.config import RuntimeConfig
from moerun.engine.engine import Engine
from moerun.errors import MoerunError
from moerun.experts.cache import ExpertCache
from moerun.formats import open_model
from moerun.loading import load_model
from moerun.model.moe import CachedExperts
from moerun.placement.devices import detect
from moerun.placement.planner import Budgets, Plan, plan
from moerun.text import Tokenizer

DEFAULT_MODEL = "default-qwen3moe.gguf"
MiB = 2**20


def default_model_path() -> Path:
    path = Path(str(resources.files("moerun") / "data" / DEFAULT_MODEL))
    if not path.is_file():
        raise MoerunError(f"the built-in default model is missing ({path}); pass a model with -m")
    return path


@dataclass
class Runtime:
    engine: Engine
    plan: Plan
    cache: ExpertCache | None
    warnings: list[str]


def _cache_slots(cfg: RuntimeConfig, the_plan: Plan, store, warnings: list[str]) -> int | dict[int, int] | None:
    """Slots per layer: as asked for, else the plan's when the experts live on disk, else no cache."""
    if cfg.expert_cache_slots is not None:
        return cfg.expert_cache_slots
    if cfg.expert_cache_mib is not None:
        per_layer = max((store.expert_bytes(layer) for layer in store.layers), default=1)
        slots = int(cfg.expert_cache_mib * MiB // (per_layer * max(len(store.layers), 1)))
        if slots == 0:
            warnings.append(f"{cfg.expert_cache_mib} MiB holds no expert per layer ({per_layer / MiB:.2f} MiB "
                            "each); every expert is read from its home tier")
        return slots
    if the_plan.home == "disk":
        dp = the_plan.devices[0]
        return {layer: dp.expert_slots[layer - dp.layers[0]] for layer in range(*dp.layers)}
    return None


def build(cfg: RuntimeConfig) -> Runtime:
    torch.set_num_threads(cfg.threads or psutil.cpu_count(logical=False) or 1)
    path = Path(cfg.model) if cfg.model else default_model_path()
    with open_model(path) as mf:  # metadata and tensor sizes only
        arch = resolve(mf)
    ctx = cfg.ctx_size or min(4096, arch.spec.context_length)
    budgets = Budgets(devices=(cfg.device,), ram=cfg.ram_budget, ctx_size=ctx, n_cpu_moe=cfg.n_cpu_moe,
                      override_tensor=cfg.override_tensor, kv_dtype_bytes=torch.finfo(getattr(torch, cfg.dtype)).bits // 8,
                      cache_slots=cfg.expert_cache_slots,
                      cache_mib=None if cfg.expert_cache_mib is None else int(cfg.expert_cache_mib))
    the_plan = plan(arch, detect(gpus=False), budgets)
    if cfg.mmap is not None:
        home = "mmap" if cfg.mmap else "ram"
    else:
        home = "mmap" if cfg.cache_requested or the_plan.home == "disk" else "ram"
    loaded = load_model(path, dtype=getattr(torch, cfg.dtype), home=home)
    warnings: list[str] = []
    if loaded.model.ops.name == "reference" and any(
            src.records[0].qtype.name not in ("F32", "F16", "BF16") for src in arch.sources.values()):
        from moerun.kernels import cpu

        warnings.append(f"quantized weights run on the slow torch reference: {cpu.features()['reason']}")
    slots = _cache_slots(cfg, the_plan, loaded.model.store, warnings)
    cache = None
    if slots is not None:
        cache = ExpertCache(loaded.model.store, slots=slots, policy=cfg.cache_policy, prefill=cfg.cache_prefill,
                            prefetch=cfg.prefetch)
        loaded.model.experts = CachedExperts(cache)
    elif cfg.prefetch:
        warnings.append("prefetch needs an expert cache (--expert-cache-slots or --expert-cache-mib); ignored")
    tok = Tokenizer.from_model_file(loaded.file)
    engine = Engine(loaded.model, tok, ctx_size=ctx, ubatch=cfg.ubatch, expert_cache=cache)
    return Runtime(engine, the_plan, cache, warnings)
