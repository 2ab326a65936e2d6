"""A chat's history as `moerun chat` keeps it: the system prompt, then user and assistant turns, oldest first.

When the prompt outgrows its room, the oldest turns go and the system prompt stays (llama.cpp's chat drops the
oldest part of its context, after the kept prompt, when the context fills).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # {"role": "user" | "assistant", "content": ...}

    @property
    def messages(self) -> list[dict]:
        """What the chat template renders: the system prompt, if any, then the turns."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def clear(self) -> None:
        """Forget every turn; the system prompt stays."""
        self.turns.clear()

    def fit(self, encode: Callable[[list[dict]], list[int]], limit: int) -> tuple[list[int], int]:
        """The prompt, encode(messages), after dropping the oldest turns (a user message with its reply) while
        it has more than `limit` tokens; the system prompt and the last message always stay.
        -> (prompt ids, number of messages dropped)."""
        ids, dropped = encode(self.messages), 0
        while len(ids) > limit and len(self.turns) > 1:
            n = 2 if len(self.turns) > 2 and self.turns[1]["role"] == "assistant" else 1
            del self.turns[:n]
            dropped += n
            ids = encode(self.messages)
        return ids, dropped
