"""Grammar-constrained sampling with llguidance: structured output (JSON, JSON schema) as a logit mask in the
sampler chain.

    grammars = Grammars(tokenizer, vocab)              # one per engine: the vocabulary's token trie, built once
    g = grammars.json_schema(schema)                   # compiled and checked -> a grammar; GrammarError: why not
    c = grammars.constraint(g)                         # one per request
    c.mask(logits)                                     # before sampling: tokens the grammar forbids -> -inf
    c.accept(token)                                    # after

A schema feature llguidance does not implement, or an invalid schema, is a GrammarError naming it. The mask is
computed on the engine thread just before the sampler runs (measured in bench/RESULTS.md against a decode step).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from moerun.errors import MoerunError

# compact JSON: no optional whitespace, so a sampled answer cannot wander into spaces and newlines
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(MoerunError):
    """A schema or grammar that cannot be enforced (invalid, or using what llguidance does not implement)."""


class Constraint:
    """One request's matcher: the grammar's state after the tokens accepted so far."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self._bits = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next (EOS once it is complete)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {self.matcher.get_error()}")
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[:self.vocab]
        return torch.from_numpy(bits.astype(bool))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar forbids at -inf (a new tensor)."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not continue the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more than the end."""
        return self.matcher.is_stopped()


class Grammars:
    """The engine's llguidance tokenizer (built once from the model's tokenizer.json) and its compiler."""

    def __init__(self, tokenizer: Any, vocab: int):
        import llguidance

        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise GrammarError("structured output needs a tokenizers (tokenizer.json) vocabulary")
        self.llg, self.vocab = llguidance, vocab
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=sorted(tokenizer.eos_ids))

    def _checked(self, grammar: str) -> str:
        failed, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError("; ".join(messages))
        return grammar

    def json_schema(self, schema: dict | None) -> str:
        """A grammar for JSON that validates against `schema` (None: any JSON object)."""
        if schema is not None and not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}")
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema if schema is not None else {"type": "object"}), overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        return self._checked(grammar)

    def lark(self, source: str) -> str:
        """A grammar from llguidance's Lark (with %json {schema} rules), checked."""
        return self._checked(self.llg.LLMatcher.grammar_from_lark(source))

    def constraint(self, grammar: str) -> Constraint:
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.vocab)
