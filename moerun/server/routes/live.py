"""moerun's live state: GET /v1/moerun/state, what the web page's live view draws (JSON; with ?stream=true the
same object as a server-sent event every `interval` seconds, 0.2 to 60, default 1).

    model      name, family, layers, experts (routed, used per token), context, device
    tokens     prompt and generated tokens since the start (a reader's differences give tok/s)
    slots      per slot: idle, prefill or decode; KV positions held; the running request's prompt, reused
               prefix (cached), generated tokens
    cache      per MoE layer and phase (prefill, decode): expert-cache hits and queries, the figures /metrics
               reports as moerun:expert_cache_hits and _queries, summed over its ranks under expert parallelism
               (across processes too) (null without an expert cache)
    experts    per layer with a cache: each expert's recent use (steps, decaying by half every `half_life`
               steps of the layer: moerun.experts.usage), its use since the start, and the experts resident
               in the cache's slots now (null without an expert cache: resident experts run in C, uncounted);
               this process's caches only (across processes, rank 0's)
    placement  the plan: devices (layers, dense, KV, cache bytes, expert slots), the home tier of the
               routed experts, and the tensors by kind (`blk.N.` dropped) with the device that computes
               them, the tier that holds them and their bytes
    build_ms   the time this answer took to build

Everything is read from counters the server keeps anyway: the scheduler's snapshot (its expert-cache
statistics are copied every 0.25 s), the slots, the caches' slot tables and use counts, and the plan.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Query
from fastapi.responses import Response, StreamingResponse

from moerun.server.errors import APIError

if TYPE_CHECKING:
    from moerun.placement.planner import Plan
    from moerun.server.ready import Ready
    from moerun.server.state import Server

_LAYER = re.compile(r"^blk\.\d+\.")


def slot_state(slot) -> dict:
    """One slot: its state, the KV positions it holds, and its request's prompt, reused prefix and output."""
    req = slot.req
    if req is None:
        return {"id": slot.index, "state": "idle", "n_tokens": slot.kv.length, "request": None}
    return {"id": slot.index, "state": "prefill" if slot.todo else "decode", "n_tokens": slot.kv.length,
            "request": {"id": req.id, "n_prompt": len(req.prompt), "n_cached": req.timings.cache_n,
                        "n_generated": len(req.tokens)}}


def cache_layers(stats) -> list[dict] | None:
    """Per layer: hits and queries by phase, from a CacheStats."""
    if stats is None:
        return None
    out = []
    for layer in stats.layers():
        row = {"layer": layer}
        for phase in ("prefill", "decode"):
            c = stats.get(layer, phase)
            row[phase] = {"hits": c.hits, "queries": c.queries}
        out.append(row)
    return out


def expert_layers(ready: Ready) -> dict | None:
    """Per layer with a cache: recent and total use of each expert, and the experts resident in its slots."""
    layers, half_life = [], None
    for st in ready.runtime.stages:
        cache = st.cache
        if cache is None or not hasattr(cache, "usage"):
            continue
        half_life = cache.usage.half_life
        for layer in cache.usage.layers():
            table = cache.tables.get(layer)
            resident = sorted(table.resident) if table is not None else []
            layers.append({"layer": layer, "recent": [round(x, 3) for x in cache.usage.recent(layer)],
                           "total": cache.usage.total(layer), "steps": cache.usage.steps(layer),
                           "slots": cache.slots(layer), "resident": resident})
    if half_life is None:
        return None
    return {"half_life_steps": half_life, "layers": sorted(layers, key=lambda r: r["layer"])}


def placement(plan: Plan) -> dict:
    """The plan's devices, home tier, and tensors grouped by kind, device, tier and whether a cache serves
    them."""
    groups: dict[tuple, dict] = {}
    for name, t in plan.tensors.items():
        kind = _LAYER.sub("blk.*.", name)
        key = (kind, t.device, t.tier, t.cached)
        g = groups.setdefault(key, {"tensor": kind, "device": t.device, "tier": t.tier, "cached": t.cached,
                                    "count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += t.nbytes
    devices = [{"device": d.device, "layers": list(d.layers), "dense_bytes": d.dense_bytes,
                "kv_bytes": d.kv_bytes, "cache_bytes": d.cache_bytes, "workspace_bytes": d.workspace_bytes,
                "expert_slots": list(d.expert_slots), "budget": d.budget} for d in plan.devices]
    return {"devices": devices, "home": plan.home, "ram_bytes": plan.ram_bytes, "totals": plan.totals(),
            "tensors": sorted(groups.values(), key=lambda g: (-g["bytes"], g["tensor"]))}


class LiveState:
    """Builds the state object for one server (the placement once: the plan does not change)."""

    def __init__(self, server: Server):
        self.server = server
        self._placement: dict | None = None

    def build(self) -> dict:
        t0 = time.perf_counter()
        server = self.server
        ready = server.require()
        rt, sched = ready.runtime, ready.scheduler
        eng, spec = rt.engine, rt.engine.model.spec
        if self._placement is None:
            self._placement = placement(rt.plan)
        snap = sched.snapshot()
        cache = cache_layers(snap.cache) if snap.cache is not None else [] if eng.expert_cache else None
        out = {"object": "moerun.state", "time": time.time(),
               "model": {"name": server.cfg.model_names[0], "family": spec.family, "n_layers": spec.n_layers,
                         "n_experts": spec.n_experts, "n_experts_used": spec.n_experts_used,
                         "n_ctx": eng.ctx_size, "device": eng.device_label},
               "tokens": {"prompt": snap.prompt_tokens, "generated": snap.generated_tokens},
               "running": snap.running, "waiting": snap.waiting, "kv_usage": snap.kv_usage,
               "slots": [slot_state(s) for s in sched.slots],
               "cache": cache, "experts": expert_layers(ready), "placement": self._placement}
        out["build_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return out


def add_routes(app: FastAPI, server: Server) -> None:
    live = LiveState(server)

    @app.get("/v1/moerun/state")
    async def state(stream: bool = False, interval: float = Query(1.0, ge=0.2, le=60.0)):
        if not stream:  # its JSON written at once (FastAPI's encoder walks every number: ms for a big model)
            return Response(json.dumps(live.build()), media_type="application/json")
        server.require()

        async def events():
            while not server.stopping:
                try:
                    body = live.build()
                except APIError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    return
                yield f"data: {json.dumps(body)}\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
