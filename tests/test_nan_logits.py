"""A broken model's NaN logits: every sampler path returns NAN_TOKEN instead of some token, and the engine and the
server's scheduler report it as one clear error (errors.NAN_LOGITS) rather than generating garbage."""

from __future__ import annotations

import pytest
import torch

from moerun.config import SamplingParams
from moerun.engine.sampler import NAN_TOKEN, Sampler
from moerun.errors import NAN_LOGITS, ModelOutputError

V = 40000  # past the sampler's fast-path threshold, so top-p without top-k takes the C cut

PATHS = {
    "greedy": SamplingParams.greedy(max_tokens=4),
    "top-k": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=0),
    "top-p, C cut": SamplingParams(temperature=0.8, top_k=0, top_p=0.95, seed=0),
    "no truncation": SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=0),
    "min-p": SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.05, seed=0),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_sampler_path_flags_nan_logits(path):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    s = Sampler(PATHS[path], V)
    assert 0 <= int(s.sample(logits, torch.tensor([1, 2]))) < V
    for where in (0, 17, V - 1):
        bad = logits.clone()
        bad[where] = float("nan")
        assert int(s.sample(bad, torch.tensor([1, 2]))) == NAN_TOKEN
    masked = logits.clone()
    masked[100:] = float("-inf")  # a grammar's mask is not a NaN
    assert 0 <= int(s.sample(masked, torch.tensor([1, 2]))) < 100


def test_engine_reports_nan_logits_as_one_error(tmp_path):
    from moerun.engine.engine import Engine
    from moerun.loading import load_model
    from moerun.text.tokenizer import Tokenizer
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    loaded = load_model(make_model(preset("tiny-qwen3moe"), tmp_path / "m.gguf", ftype="Q8_0", progress=False,
                                   threads=1))
    model = loaded.model
    real = model.forward

    def broken(tokens, kv=None, last_only=False, phase=None):
        out = real(tokens, kv, last_only, phase)
        return out.fill_(float("nan"))

    model.forward = broken
    eng = Engine(model, Tokenizer.from_model_file(loaded.file), ctx_size=64)
    with pytest.raises(ModelOutputError, match="NaN"):
        eng.generate([1, 2, 3], SamplingParams.greedy(max_tokens=4)).run()
    assert "corrupt" in NAN_LOGITS


def test_scheduler_fails_the_request_and_goes_on(monkeypatch):
    """The server's path: the request ends with finish_reason "error" and the reason; the next request with sane
    logits is served."""
    from moerun.config import RuntimeConfig
    from moerun.engine.scheduler import Request, Scheduler
    from moerun.runtime import build

    engine = build(RuntimeConfig(ctx_size=128, threads=1)).engine
    model, real = engine.model, engine.model.decode
    events = []
    sched = Scheduler(engine, parallel=1)
    monkeypatch.setattr(model, "decode", lambda *a, **kw: real(*a, **kw).fill_(float("nan")))
    bad = Request([1, 2, 3, 4], SamplingParams.greedy(max_tokens=8), emit=events.append)
    sched.submit(bad)
    for _ in range(50):
        if bad.finish_reason is not None:
            break
        sched.step()
    assert bad.finish_reason == "error" and events[-1].error == NAN_LOGITS
    monkeypatch.setattr(model, "decode", real)
    good = Request([1, 2, 3, 4], SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    sched.submit(good)
    for _ in range(50):
        if good.finish_reason is not None:
            break
        sched.step()
    assert good.finish_reason == "length" and len(good.tokens) == 4 and NAN_TOKEN not in good.tokens
