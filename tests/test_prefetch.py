"""Prefetch (DESIGN decision 6) changes when experts are paged in, never the result."""

import json
import re
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from hf_models import FAMILIES
from test_expert_cache import mapped_model, run_steps

from moerun.cli import main
from moerun.experts.cache import ExpertCache
from moerun.experts.prefetch import Prefetcher, guess_ids
from moerun.loading import load_model
from moerun.model.moe import CachedExperts

SLOTS = (1, 2, 4)
POLICIES = ("lru", "lfu", "lfru")


def with_cache(model, slots, policy, prefetch, prefill="bypass"):
    cache = ExpertCache(model.store, slots=slots, policy=policy, prefill=prefill, prefetch=prefetch)
    model.experts = CachedExperts(cache)
    return cache


def check_counters(cache):
    d = cache.stats.get(phase="decode")
    assert d.prefetch_issued > 0 and d.prefetch_needed > 0
    assert 0.0 <= d.prefetch_precision <= 1.0 and 0.0 <= d.prefetch_recall <= 1.0
    assert d.hits + d.misses == d.queries
    assert cache.stats.get(phase="prefill").prefetch_issued == 0  # only decode steps guess
    assert "prefetch precision" in cache.stats.summary_line()


def check_prefetch_matches(model, slots, policy):
    """Logits with prefetch equal those without, bit for bit; the prefetch counters moved. -> the cache."""
    with_cache(model, slots, policy, prefetch=False)
    ref = run_steps(model)
    cache = with_cache(model, slots, policy, prefetch=True)
    try:
        assert torch.equal(run_steps(model), ref)
    finally:
        cache.close()
    check_counters(cache)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("slots", SLOTS)
def test_prefetch_logits_equal_no_prefetch(hf_model, family, policy, slots):
    _, folder = hf_model(family)
    check_prefetch_matches(load_model(folder).model, slots, policy)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("slots", SLOTS)
def test_prefetch_file_reads_equal_no_prefetch(policy, slots):
    """The GGUF over its memory map: misses and prefetches are positioned reads from the file."""
    cache = check_prefetch_matches(mapped_model(), slots, policy)
    assert cache.stats.get(phase="decode").bytes_paged_in > 0


def test_prefetch_cache_prefill_and_guess_scored_per_layer():
    model = mapped_model()
    cache = with_cache(model, 2, "lru", prefetch=True, prefill="cache")
    run_steps(model)
    cache.close()
    layers = model.store.layers
    assert cache.stats.get(layers[0]).prefetch_issued == 0  # nothing guesses the first MoE layer
    for layer in layers[1:]:
        d = cache.stats.get(layer, "decode")
        assert d.prefetch_issued == 8 * model.spec.n_experts_used  # 8 decode steps, a top-k guess each
        assert d.prefetch_needed == d.queries


def test_fetch_waits_for_the_layer_prefetch():
    """fetch(layer) never returns while that layer's prefetch is still writing a slot."""
    model = mapped_model()
    cache = ExpertCache(model.store, slots=2, prefetch=True)
    layer = model.store.layers[1]
    gate = threading.Event()
    log = []
    work = cache._prefetch_layer

    def slow(layer, guessed):
        gate.wait(5)
        time.sleep(0.05)
        out = work(layer, guessed)
        log.append("prefetched")
        return out

    cache.prefetcher._work = slow
    cache.prefetch(layer, [3, 5])
    gate.set()
    got = cache.fetch(layer, [3, 5], "decode")
    log.append("fetched")
    cache.close()
    assert log == ["prefetched", "fetched"]
    d = cache.stats.get(layer, "decode")
    assert d.hits == 2 and d.misses == 0 and d.prefetch_used == 2 and d.prefetch_precision == 1.0
    ref = model.store
    for e in (3, 5):
        assert torch.equal(got[e].gate.data, ref.get(layer, e).gate.data)


def test_prefetch_never_evicts_the_guess_and_leaves_other_layers_alone():
    model = mapped_model()
    cache = ExpertCache(model.store, slots=2, prefetch=True)
    a, b = model.store.layers[:2]
    cache.fetch(a, [0, 1], "decode")
    before = cache.tables[a].resident
    cache.prefetch(b, [4, 5, 6])  # three guesses, two slots: the third finds no slot free of the guess
    cache.prefetcher.wait(b)
    assert cache.tables[a].resident == before
    assert set(cache.tables[b].resident) == {4, 5}
    cache.close()


def test_failed_prefetch_forgets_the_layer_and_reports():
    model = mapped_model()
    cache = ExpertCache(model.store, slots=2, prefetch=True)
    layer = model.store.layers[1]

    def broken(layer, e, slot, staging=None):
        raise OSError("disk gone")

    cache._load = broken
    cache.prefetch(layer, [1, 2])
    with pytest.raises(OSError, match="disk gone"):
        cache.fetch(layer, [1], "decode")
    assert cache.tables[layer].resident == {}
    cache.close()


def test_guess_ids_most_probable_first():
    p = torch.tensor([[0.5, 0.2], [0.6, 0.1]])
    ids = torch.tensor([[3, 1], [2, 3]])
    assert guess_ids(p, ids) == [2, 3, 1]


def test_prefetcher_resubmit_folds_in():
    pf = Prefetcher(lambda layer, guessed: (len(guessed), 0))
    pf.submit(1, [1, 2])
    pf.submit(1, [2, 3])
    r = pf.wait(1)
    assert r.guessed == (1, 2, 3) and r.bytes_paged_in == 4
    assert pf.wait(1) is None
    pf.close()


def test_cli_prefetch_flag(hf_model):
    _, folder = hf_model("qwen3moe")
    base = ("run", "-m", str(folder), "-p", "Hello", "-n", "12", "--temp", "0", "--ignore-eos")
    runner = CliRunner()
    plain = json.loads(runner.invoke(main, [*base, "--json", "--expert-cache-slots", "2"],
                                     catch_exceptions=False).stdout)
    r = runner.invoke(main, [*base, "--json", "--expert-cache-slots", "2", "--prefetch"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["tokens"] == plain["tokens"]
    total = got["expert_cache"]["total"]["decode"]
    assert total["prefetch_issued"] > 0 and 0 <= total["prefetch_precision"] <= 1
    assert plain["expert_cache"]["total"]["decode"]["prefetch_issued"] == 0
    r = runner.invoke(main, [*base, "--expert-cache-slots", "2", "--prefetch", "-v"], catch_exceptions=False)
    assert re.search(r"^expert cache: .*prefetch precision [\d.]+% recall [\d.]+%", r.stderr, re.MULTILINE)
    r = runner.invoke(main, [*base, "--prefetch"], catch_exceptions=False)
    assert r.exit_code == 0 and "prefetch needs an expert cache" in r.stderr
