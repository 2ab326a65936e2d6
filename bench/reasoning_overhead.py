"""What telling a chat model's reasoning apart costs per request and per token (issue 18 item 4).

    python bench/reasoning_overhead.py [-n 2000] [-r 7]

Per request: rendering OpenAI's gpt-oss template with moerun's sandboxed Jinja (the prompt), the second render
`generation_prompt` adds (the parser's prime), and transformers' apply_chat_template for scale. Per token: a
harmony output of n tokens (analysis, then final), from a tools-made o200k-style vocabulary, through the
incremental decoder alone, and through the decoder and the ReasoningParser; and the same text's tokens
decoded without the harmony markers (the decoder's fast path). Medians of r runs, one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2000, help="output tokens")
    p.add_argument("-r", type=int, default=7, help="runs (median)")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MOERUN_CACHE", tempfile.mkdtemp())

    import transformers
    from tokenizers import Tokenizer as HFTokenizer

    from moerun.text import ChatTemplate, Tokenizer
    from moerun.text.reasoning import HARMONY as SYNTAX
    from moerun.text.reasoning import ReasoningParser
    from moerun.tools.tokenizer import HARMONY, build_tokenizer, gguf_tokenizer_metadata

    hf = build_tokenizer(2048, "gptoss")
    tok = Tokenizer.from_gguf(gguf_tokenizer_metadata(hf))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4.", "thinking": "Easy."}, {"role": "user", "content": "And 3+3?"}]
    template = ChatTemplate(HARMONY.chat_template)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(hf.to_str()))
    render = _median_ms(lambda: template.render(chat, add_generation_prompt=True), args.r * 3)
    prime = _median_ms(lambda: template.generation_prompt(chat), args.r * 3)
    theirs = _median_ms(lambda: ref.apply_chat_template(chat, chat_template=HARMONY.chat_template, tokenize=False,
                                                        add_generation_prompt=True), args.r * 3)
    print(f"gpt-oss template, 4 messages: render {render:.2f} ms, generation_prompt (two renders) {prime:.2f} ms, "
          f"transformers' apply_chat_template {theirs:.2f} ms")

    words = ("The user asks a question about arithmetic, so I add the numbers and check the result twice. "
             * 200)
    analysis = tok.encode(words, add_special=False)[: args.n // 2]
    final = tok.encode("The answer is 6, since 3 + 3 = 6. " * 200, add_special=False)[: args.n // 2]
    ids = [*tok.encode("<|channel|>analysis<|message|>", add_special=False), *analysis,
           *tok.encode("<|end|><|start|>assistant<|channel|>final<|message|>", add_special=False), *final]
    plain = [*analysis, *final]

    def decode(seq):
        stream = tok.incremental_decoder()
        return [stream.step(i) for i in seq] + [stream.flush()]

    def parse():
        parser = ReasoningParser(SYNTAX, "<|start|>assistant")
        for piece in decode(ids):
            parser.feed(piece)
        parser.flush()

    t_dec = _median_ms(lambda: decode(ids), args.r)
    t_plain = _median_ms(lambda: decode(plain), args.r)
    t_parse = _median_ms(parse, args.r)
    n = len(ids)
    print(f"{n} harmony tokens: decode {t_dec / n * 1e3:.1f} us/token, decode + parse {t_parse / n * 1e3:.1f} "
          f"us/token (parser {(t_parse - t_dec) / n * 1e3:.1f} us/token); the same text without markers "
          f"({len(plain)} tokens): decode {t_plain / len(plain) * 1e3:.1f} us/token")


if __name__ == "__main__":
    main()
