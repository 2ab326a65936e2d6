"""What a router in front of several replicas reads from each one (README, "Several replicas"): its load, what it
serves and its version, in the shapes the routers parse (checked against vllm-router 0.1.17, sglang-router 0.3.2
and the Shepherd Model Gateway, smg 1.13, where sglang-router's code went on, and their sources).

    /get_load                        {"load": tokens in flight, "num_reqs", "num_waiting_reqs", "num_tokens",
                                     "dp_rank": 0}: vllm-router's power_of_two reads "load"
    /get_load?form=array             SGLang's form (the default with serve --load-form array), one entry per data-parallel rank: [{"dp_rank": 0, "num_reqs",
                                     "num_waiting_reqs", "num_tokens"}] (sglang-router's power_of_two sums
                                     "num_tokens")
    /server_info, /get_server_info   SGLang's field names: model_path, served_model_name, context_length,
                                     max_total_tokens, max_running_requests, tp_size / dp_size / pp_size, version
    /model_info, /get_model_info     model_path, is_generation, model_type (the architecture's family)
    /version                         {"version": moerun's}, vLLM's endpoint: the gateway takes a worker answering
                                     it for vLLM and reads vLLM's load gauges from /metrics (moerun.server.metrics)

Tokens in flight: the running requests' prompt and generated tokens and the waiting requests' prompts
(Snapshot.tokens_in_flight); num_reqs counts the running and the waiting requests, as SGLang's does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI

from moerun import __version__

if TYPE_CHECKING:
    from moerun.server.state import Server


def load(server: Server) -> dict:
    """The running and waiting requests and the tokens in flight, SGLang's names."""
    server.require()
    snap = server.snapshot()
    return {"dp_rank": 0, "num_reqs": snap.running + snap.waiting, "num_waiting_reqs": snap.waiting,
            "num_tokens": snap.tokens_in_flight}


def server_info(server: Server) -> dict:
    ready, cfg = server.require(), server.cfg
    eng = ready.runtime.engine
    return {"model_path": cfg.model_path or cfg.model_names[0], "served_model_name": cfg.model_names[0],
            "context_length": eng.ctx_size, "max_total_tokens": eng.pool.allocator.n_blocks * eng.pool.block_size,
            "max_running_requests": cfg.parallel, "max_queued_requests": cfg.max_queue, "tp_size": 1, "dp_size": 1,
            "pp_size": 1, "is_embedding": False, "version": __version__}


def model_info(server: Server) -> dict:
    ready, cfg = server.require(), server.cfg
    spec = ready.runtime.engine.model.spec
    return {"model_path": cfg.model_path or cfg.model_names[0], "is_generation": True, "model_type": spec.family,
            "has_image_understanding": False, "has_audio_understanding": False}


def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/get_load")
    async def get_load(form: Literal["object", "array"] | None = None):
        """The load in the form asked for, else serve's --load-form."""
        entry = load(server)
        return [entry] if (form or server.cfg.load_form) == "array" else {"load": entry["num_tokens"], **entry}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(server)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info(server)

    @app.get("/version")
    async def version():
        return {"version": __version__}
