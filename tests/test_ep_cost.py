"""The cost model over N hosts (issue 40, item 4): expert parallelism against a pipeline split, `moerun estimate
--expert-parallel N --link-gbps G --link-latency-us L`."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from click.testing import CliRunner

from moerun.cli import main
from moerun.placement import ep_cost


@pytest.mark.parametrize("E, k, N", [(8, 2, 2), (8, 4, 3), (12, 3, 4), (6, 6, 2)])
def test_imbalance_is_the_expected_largest_share(E, k, N):
    draws = list(itertools.combinations(range(E), k))
    mean_max = sum(max(sum(1 for e in d if e * N // E == r) for r in range(N)) for d in draws) / len(draws)
    assert math.isclose(ep_cost.imbalance(E, k, N), mean_max / (k / N))
    assert ep_cost.imbalance(E, k, 1) == 1.0


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    """An a3b-L12 file of its shape only (no weights: estimate reads metadata)."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    return str(make_model(preset("a3b-L12"), tmp_path_factory.mktemp("ep") / "a3b.gguf", ftype="Q4_K_M",
                          shape_only=True, progress=False))


def hosts(path: str, *args: str) -> dict:
    res = CliRunner().invoke(main, ["estimate", path, "--no-measure", "--device", "cpu", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output[res.output.index("{"):])["hosts"]


def test_a_fast_link_favours_experts_and_a_slow_one_a_pipeline(shape):
    fast = hosts(shape, "--expert-parallel", "2", "--link-gbps", "100", "--link-latency-us", "5")
    slow = hosts(shape, "--expert-parallel", "4", "--link-gbps", "1", "--link-latency-us", "500")
    assert fast["better"] == "expert parallel" and slow["better"] == "pipeline"
    ep, pp = fast["expert_parallel"], fast["pipeline"]
    assert ep["compute_s"] < pp["compute_s"] and ep["comm_s"] > pp["comm_s"]
    assert ep["prefill_tok_s"] > pp["prefill_tok_s"]  # the experts' FLOPs shared out
    # 12 MoE layers x 3 all-gather steps of a 2048-float row at 1 Gbit/s, 500 us each, and the control message
    link = ep_cost.Link(1, 500e-6)
    want = link.seconds(ep_cost.CONTROL_BYTES + 8) + 12 * 3 * link.seconds(2048 * 4)
    assert math.isclose(slow["expert_parallel"]["comm_s"], want)
    assert hosts(shape) is None


def test_estimate_prints_both_splits(shape):
    res = CliRunner().invoke(main, ["estimate", shape, "--no-measure", "--device", "cpu", "--expert-parallel", "2"])
    assert res.exit_code == 0, res.output
    assert "over 2 hosts, link 10 Gbit/s and 50 us:" in res.output
    assert "expert parallel (imbalance x1.26)" in res.output and "pipeline of 2 stages" in res.output
    assert "better for decode: " in res.output
    res = CliRunner().invoke(main, ["estimate", shape, "--no-measure", "--expert-parallel", "200"])
    assert res.exit_code == 1 and "needs 1..128 ranks" in res.output
