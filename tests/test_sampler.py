"""Sampler stages against hand-computed numbers, seeds, a pure-Python llama.cpp reference, stop strings."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from moerun.config import SamplingParams
from moerun.engine.sampler import Sampler, StopChecker

# exp(2.0)=7.3891  exp(1.0)=2.7183  exp(0.5)=1.6487  exp(-1.0)=0.3679  exp(-3.0)=0.0498   sum=12.1738
# p = [0.6070, 0.2233, 0.1354, 0.0302, 0.0041]; mass ranked above each: [0, 0.6070, 0.8303, 0.9657, 0.9959]
LOGITS = [2.0, 1.0, 0.5, -1.0, -3.0]
NO_HISTORY = torch.zeros(0, dtype=torch.long)


def plain(**kw) -> Sampler:
    """Every stage off (temperature 1) except those given."""
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}
    return Sampler(SamplingParams(**{**base, **kw}), vocab_size=len(LOGITS))


def probs(sampler: Sampler, history=()) -> list[float]:
    return sampler.probs(torch.tensor(LOGITS), torch.tensor(history, dtype=torch.long)).tolist()


def close(got, want, tol=1e-4) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= tol for g, w in zip(got, want))


def test_no_stage_is_plain_softmax():
    assert close(probs(plain()), [0.6070, 0.2233, 0.1354, 0.0302, 0.0041])


def test_top_k_keeps_exactly_k():
    # top-2: 7.3891 / (7.3891 + 2.7183) = 0.7311, 2.7183 / 10.1074 = 0.2689
    assert close(probs(plain(top_k=2)), [0.7311, 0.2689, 0, 0, 0])
    for k in range(1, 5):
        kept = [i for i, p in enumerate(probs(plain(top_k=k))) if p > 0]
        assert kept == list(range(k))
    assert close(probs(plain(top_k=5)), probs(plain()))  # k >= V keeps all


@pytest.mark.parametrize("top_p, kept", [
    (0.0, [0]),           # at least one token
    (0.5, [0]),           # 0.6070 >= 0.5 already
    (0.8, [0, 1]),        # 0.6070 < 0.8, 0.8303 >= 0.8
    (0.95, [0, 1, 2]),    # 0.8303 < 0.95, 0.9657 >= 0.95
    (0.97, [0, 1, 2, 3]),  # 0.9657 < 0.97, 0.9959 >= 0.97
])
def test_top_p_keeps_smallest_prefix(top_p, kept):
    got = probs(plain(top_p=top_p))
    assert [i for i, p in enumerate(got) if p > 0] == kept
    if top_p == 0.95:  # renormalised over 7.3891 + 2.7183 + 1.6487 = 11.7561
        assert close(got, [0.6285, 0.2312, 0.1402, 0, 0])


def test_top_p_sees_the_top_k_set():
    # after top-2 the probabilities are [0.7311, 0.2689]: 0.7311 >= 0.7 keeps one token
    assert close(probs(plain(top_k=2, top_p=0.7)), [1, 0, 0, 0, 0])
    assert close(probs(plain(top_p=0.7)), [0.7311, 0.2689, 0, 0, 0])  # 0.6070 < 0.7 keeps two


@pytest.mark.parametrize("min_p, kept", [
    (0.25, [0, 1]),        # p/p_max = [1, 0.3679, 0.2231, 0.0498, 0.0067]
    (0.1, [0, 1, 2]),
    (0.01, [0, 1, 2, 3]),
    (1.0, [0]),
])
def test_min_p_threshold(min_p, kept):
    assert [i for i, p in enumerate(probs(plain(min_p=min_p))) if p > 0] == kept


def test_temperature_scales_logits():
    # T=2: exp([1, 0.5, 0.25, -0.5, -1.5]) = [2.7183, 1.6487, 1.2840, 0.6065, 0.2231], sum 6.4806
    assert close(probs(plain(temperature=2.0)), [0.4195, 0.2544, 0.1981, 0.0936, 0.0344])
    # T=0.5: exp([4, 2, 1, -2, -6]) = [54.598, 7.3891, 2.7183, 0.1353, 0.0025], sum 64.843
    assert close(probs(plain(temperature=0.5)), [0.8420, 0.1140, 0.0419, 0.0021, 0.0000])


def test_temperature_comes_after_truncation():
    # top-2 then T=2: exp([1, 0.5]) = [2.7183, 1.6487] -> [0.6225, 0.3775]
    assert close(probs(plain(top_k=2, temperature=2.0)), [0.6225, 0.3775, 0, 0, 0])
    # min-p 0.25 keeps {0, 1} whatever the temperature; T=100: 1 / (1 + exp(-0.01)) = 0.5025
    assert close(probs(plain(min_p=0.25, temperature=100.0)), [0.5025, 0.4975, 0, 0, 0])


def test_sample_frequencies_match_temperature():
    sampler, logits = plain(temperature=2.0, seed=1234), torch.tensor(LOGITS)
    n = 20_000
    counts = Counter(int(sampler.sample(logits, NO_HISTORY)) for _ in range(n))
    expected = [0.4195, 0.2544, 0.1981, 0.0936, 0.0344]
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))
    assert chi2 < 18.47, (chi2, counts)  # chi-square, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("kw, history, want", [
    # positive logit divided, negative multiplied; each token once however often it repeats
    ({"repeat_penalty": 2.0}, [0, 3, 3], [1.0, 1.0, 0.5, -2.0, -3.0]),
    # window = last 2 tokens = [1, 1]: only token 1 is penalised
    ({"repeat_penalty": 2.0, "repeat_last_n": 2}, [0, 3, 1, 1], [2.0, 0.5, 0.5, -1.0, -3.0]),
    ({"repeat_penalty": 2.0, "repeat_last_n": 0}, [0, 3], LOGITS),  # 0 disables
    ({"repeat_penalty": 2.0, "repeat_last_n": -1}, [0, 3], [1.0, 1.0, 0.5, -2.0, -3.0]),  # -1: all
    # token 1 three times: 1 - 3*0.5 - 0.25 = -0.75; token 4 once: -3 - 0.5 - 0.25 = -3.75
    ({"frequency_penalty": 0.5, "presence_penalty": 0.25}, [1, 1, 1, 4], [2.0, -0.75, 0.5, -1.0, -3.75]),
    # repeat first, then OpenAI's: token 0: 2/2 - 2*0.5 - 0.25 = -0.25; token 3: -1*2 - 0.5 - 0.25 = -2.75
    ({"repeat_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25}, [0, 0, 3],
     [-0.25, 1.0, 0.5, -2.75, -3.0]),
    ({"repeat_penalty": 2.0, "presence_penalty": 1.0}, [], LOGITS),
])
def test_penalties(kw, history, want):
    logits = torch.tensor(LOGITS)
    got = plain(**kw).penalize(logits, torch.tensor(history, dtype=torch.long))
    assert close(got.tolist(), want, 1e-6)
    assert logits.tolist() == LOGITS  # the caller's logits are untouched


def test_greedy_is_argmax_after_penalties():
    sampler = Sampler(SamplingParams.greedy(repeat_penalty=2.0), vocab_size=5)
    logits = torch.tensor([2.0, 1.9, 0.5, -1.0, -3.0])
    assert int(sampler.sample(logits, NO_HISTORY)) == 0
    assert int(sampler.sample(logits, torch.tensor([0]))) == 1  # 2.0 / 2 = 1.0 < 1.9
    assert sampler.probs(logits, torch.tensor([0])).tolist() == [0, 1, 0, 0, 0]
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        x = torch.randn(100, generator=g)
        assert int(Sampler(SamplingParams.greedy(), 100).sample(x, NO_HISTORY)) == int(x.argmax())


def test_sample_returns_0d_long_on_device():
    token = plain().sample(torch.tensor(LOGITS), NO_HISTORY)
    assert token.dim() == 0 and token.dtype == torch.long and token.device.type == "cpu"


def draws(sampler: Sampler, n: int = 64) -> list[int]:
    flat = torch.zeros(1000)
    return [int(sampler.sample(flat, NO_HISTORY)) for _ in range(n)]


def test_seeds():
    params = SamplingParams(seed=42, top_k=0)
    assert draws(Sampler(params, 1000)) == draws(Sampler(params, 1000))
    assert draws(Sampler(params, 1000)) != draws(Sampler(params.replace(seed=43), 1000))
    unseeded = Sampler(SamplingParams(top_k=0), 1000)
    assert isinstance(unseeded.seed, int)  # drawn once, reported, replayable
    assert draws(unseeded) == draws(Sampler(params.replace(seed=unseeded.seed), 1000))


def reference_probs(logits: list[float], history: list[int], p: SamplingParams) -> list[float]:
    """llama.cpp's default chain written plainly, one token at a time."""
    v, logits = len(logits), list(logits)
    window = [] if p.repeat_last_n == 0 else history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]
    for t, c in Counter(window).items():
        if p.repeat_penalty != 1.0:
            logits[t] = logits[t] / p.repeat_penalty if logits[t] > 0 else logits[t] * p.repeat_penalty
        logits[t] -= c * p.frequency_penalty + p.presence_penalty
    cand = sorted(range(v), key=lambda i: -logits[i])
    if 0 < p.top_k < v:
        cand = cand[: p.top_k]
    if p.top_p < 1.0:
        z = sum(math.exp(logits[i] - logits[cand[0]]) for i in cand)
        kept, mass = [], 0.0
        for i in cand:
            if kept and mass >= p.top_p:
                break
            kept.append(i)
            mass += math.exp(logits[i] - logits[cand[0]]) / z
        cand = kept
    if p.min_p > 0.0:
        cand = [i for i in cand if logits[i] >= logits[cand[0]] + math.log(p.min_p)]
    w = {i: math.exp((logits[i] - logits[cand[0]]) / p.temperature) for i in cand}
    return [w.get(i, 0.0) / sum(w.values()) for i in range(v)]


CHAINS = [
    {},  # llama.cpp's defaults
    {"top_k": 0, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1, "repeat_last_n": -1},
    {"top_k": 0, "top_p": 1.0, "min_p": 0.02, "temperature": 0.7, "frequency_penalty": 0.3},
    {"top_k": 200, "top_p": 0.5, "min_p": 0.1, "temperature": 1.5, "presence_penalty": 0.5},
]


def check_against_reference(device: str, n_draws: int) -> None:
    g = torch.Generator().manual_seed(0)
    for i, kw in enumerate(CHAINS):
        params = SamplingParams(seed=i, **kw)
        logits = torch.randn(2000, generator=g) * (0.3 + i)  # flat ones make the CPU grow its head
        history = torch.randint(0, 2000, (100,), generator=g)
        want = reference_probs(logits.tolist(), history.tolist(), params)
        sampler = Sampler(params, 2000, device=device)
        logits, history = logits.to(device), history.to(device)
        got = sampler.probs(logits, history).cpu().tolist()
        assert [p > 0 for p in got] == [p > 0 for p in want], kw
        assert close(got, want, 1e-5), kw
        for _ in range(n_draws):
            token = sampler.sample(logits, history)
            assert token.device == logits.device and want[int(token)] > 0, kw


def test_matches_reference_and_draws_stay_in_kept_set():
    check_against_reference("cpu", n_draws=300)


@pytest.mark.gpu
def test_cuda_matches_reference_without_host_sync():
    check_against_reference("cuda", n_draws=50)
    for kw in CHAINS + [{"temperature": 0.0, "repeat_penalty": 1.3}]:
        sampler = Sampler(SamplingParams(seed=1, **kw), 2000, device="cuda")
        logits, history = torch.randn(2000, device="cuda"), torch.randint(0, 2000, (80,), device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = [sampler.sample(logits, history) for _ in range(5)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(t.is_cuda and t.dim() == 0 for t in tokens)


def test_sampling_params_defaults_and_validation():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n) == (
        0.8, 40, 0.95, 0.05, 1.0, 64)
    assert SamplingParams.greedy().is_greedy and SamplingParams(temperature=-1.0).is_greedy
    assert SamplingParams.greedy(max_tokens=5).max_tokens == 5
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    bad = [
        ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"), ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"), ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"), ({"stop": ("",)}, "stop"),
        ({"stop": 3}, "stop"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="top_p.*min_p"):  # every problem in one message
        SamplingParams(top_p=2.0, min_p=2.0)


def feed_all(checker: StopChecker, chunks: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for chunk in chunks:
        text, stopped = checker.feed(chunk)
        out.append(text)
    return out, stopped


def test_stop_string_split_across_chunks():
    assert feed_all(StopChecker(["</s>"]), ["Hello <", "/", "s> more"]) == (["Hello ", "", ""], True)


def test_partial_match_that_does_not_complete_is_released():
    checker = StopChecker(["</s>"])
    assert feed_all(checker, ["a <", "/b", " c </"]) == (["a ", "</b", " c "], False)
    assert checker.flush() == "</"  # end of generation: the held-back text belongs to the output


def test_multiple_stop_strings_earliest_wins():
    assert feed_all(StopChecker(["STOP", "END"]), ["xx EN", "D STOP"]) == (["xx ", ""], True)
    assert feed_all(StopChecker(["STOP", "END"]), ["aSTOPbEND"]) == (["a"], True)
    # overlapping prefixes: "aa" is held, "aaab" stops after one "a"
    assert feed_all(StopChecker(["aab"]), ["aa", "ab"]) == (["", "a"], True)


def test_the_stop_string_found_is_named():
    """`word`: the stop string that ended the text (llama-server's stopping_word, Anthropic's stop_sequence)."""
    for stops, chunks, word in ((["STOP", "END"], ["xx EN", "D STOP"], "END"), (["STOP", "END"], ["aSTOPbEND"], "STOP"),
                                (["b", "ab"], ["xab"], "ab"), (["zz"], ["no stop"], None)):
        checker = StopChecker(stops)
        feed_all(checker, chunks)
        assert checker.word == word, (stops, chunks)


def test_stop_at_start_and_after_stop():
    checker = StopChecker(["###"])
    assert feed_all(checker, ["###abc", "more"]) == (["", ""], True)
    assert checker.flush() == ""
    assert feed_all(StopChecker([]), ["no", " stops"]) == (["no", " stops"], False)
    with pytest.raises(ValueError):
        StopChecker([""])


def test_draw_across_blocks_matches_truncated_softmax():
    """The draw sums weights per block of 256 tokens: over 700 tokens (three blocks, the last part-full), with
    top-p and min-p dropping some, the frequencies follow softmax of the kept scaled logits (chi-square)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(700, generator=g) * 1.5
    params = SamplingParams(seed=99, temperature=0.8, top_k=0, top_p=0.9, min_p=0.01)
    sampler = Sampler(params, 700)
    want = sampler.probs(logits, NO_HISTORY).double()
    assert close(want.tolist(), reference_probs(logits.tolist(), [], params), 1e-5)
    n = 40_000
    got = torch.bincount(torch.stack([sampler.sample(logits, NO_HISTORY) for _ in range(n)]), minlength=700)
    assert int(got[want == 0].sum()) == 0  # nothing dropped is drawn
    # pool the kept tokens into classes of expected count >= 20 (in token order) for the chi-square
    kept = torch.nonzero(want > 0).squeeze(1).tolist()
    classes, obs, exp = [], 0, 0.0
    for i in kept:
        obs, exp = obs + int(got[i]), exp + n * float(want[i])
        if exp >= 20:
            classes.append((obs, exp))
            obs, exp = 0, 0.0
    if exp > 0:
        o, e = classes.pop()
        classes.append((o + obs, e + exp))
    chi2 = sum((o - e) ** 2 / e for o, e in classes)
    df = len(classes) - 1
    bound = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, p = 0.001
    assert df >= 20 and chi2 < bound, (chi2, df, bound)
