"""Generation: greedy decode equals transformers' generate(); seeds; stop strings; context limits."""

import pytest
import torch
from hf_models import FAMILIES

from moerun.config import SamplingParams
from moerun.engine.engine import Engine
from moerun.engine.kv_cache import ContextOverflowError
from moerun.loading import load_model
from moerun.text import Tokenizer

PROMPT = [5, 17, 300, 42, 99, 7, 256, 11]


def engine_for(folder, ctx=256, ubatch=512):
    loaded = load_model(folder)
    return Engine(loaded.model, Tokenizer.from_model_file(loaded.file), ctx_size=ctx, ubatch=ubatch)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(hf_model, family):
    model, folder = hf_model(family)
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                             pad_token_id=0)[0, len(PROMPT):].tolist()
    eng = engine_for(folder, ubatch=3)  # several prefill chunks
    gen = eng.generate(PROMPT, SamplingParams.greedy(max_tokens=32, ignore_eos=True)).run()
    assert gen.tokens == ref
    assert gen.finish_reason == "length"
    t = gen.timings.to_dict()
    assert t["prompt_n"] == len(PROMPT) and t["predicted_n"] == 32 and t["predicted_per_second"] > 0


def test_same_seed_same_output_different_seed_differs(hf_model):
    _, folder = hf_model("qwen3moe")
    eng = engine_for(folder)

    def run(seed):
        p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=24,
                           ignore_eos=True)
        return eng.generate(PROMPT, p).run().tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_streamed_pieces_join_to_text_and_stop_strings(hf_model):
    _, folder = hf_model("mixtral")
    eng = engine_for(folder)
    gen = eng.generate(PROMPT, SamplingParams.greedy(max_tokens=20, ignore_eos=True))
    pieces = list(gen)
    assert "".join(pieces) == gen.text == eng.tokenizer.decode(gen.tokens)
    stop = gen.text[5:8]
    assert stop
    stopped = eng.generate(PROMPT, SamplingParams.greedy(max_tokens=20, ignore_eos=True, stop=(stop,))).run()
    assert stopped.finish_reason == "stop"
    assert stopped.text == gen.text[: gen.text.index(stop)]


def test_chat_turns_reuse_the_cache(hf_model):
    _, folder = hf_model("qwen3moe")
    eng = engine_for(folder)
    seq = eng.new_sequence()
    first = eng.generate(PROMPT, SamplingParams.greedy(max_tokens=5, ignore_eos=True), seq).run()
    longer = PROMPT + first.tokens + [3, 4]
    second = eng.generate(longer, SamplingParams.greedy(max_tokens=5, ignore_eos=True), seq)
    second.run()
    # only the tokens after the cached prefix were prefilled: the last sampled token plus the two new ones
    assert second.timings.prompt_n == 3
    assert second.timings.cache_n == len(longer) - 3
    fresh = eng.generate(longer, SamplingParams.greedy(max_tokens=5, ignore_eos=True)).run()
    assert fresh.tokens == second.tokens


def test_prompt_longer_than_context_is_a_clear_error(hf_model):
    _, folder = hf_model("olmoe")
    eng = engine_for(folder, ctx=16)
    with pytest.raises(ContextOverflowError, match="the prompt has 20 tokens but the context size is 16"):
        eng.generate(list(range(20)), SamplingParams.greedy()).run()
    gen = eng.generate(PROMPT, SamplingParams.greedy(max_tokens=100, ignore_eos=True)).run()
    assert gen.finish_reason == "length" and len(PROMPT) + len(gen.tokens) <= 16 + 1


def test_penalties_see_the_prompt_and_every_generated_token(hf_model):
    """With a repeat penalty the sampler's history grows by each token picked; without one it is not kept (the
    sampler does not read it)."""
    from moerun.engine import sampler as sampler_mod

    _, folder = hf_model("qwen3moe")
    eng = engine_for(folder)
    seen = []
    real = sampler_mod.Sampler.sample

    def sample(self, logits, history):
        seen.append(history.tolist())
        return real(self, logits, history)

    for penalty in (1.3, 1.0):
        seen.clear()
        p = SamplingParams.greedy(max_tokens=6, ignore_eos=True, repeat_penalty=penalty)
        sampler_mod.Sampler.sample = sample
        try:
            gen = eng.generate(PROMPT, p).run()
        finally:
            sampler_mod.Sampler.sample = real
        if penalty != 1.0:
            assert seen == [PROMPT + gen.tokens[:i] for i in range(6)]
        else:
            assert all(h == PROMPT for h in seen)
