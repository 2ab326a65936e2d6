"""Per-request timings with llama.cpp's keys and log lines."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Timings:
    """prompt_n counts prompt tokens evaluated; cache_n those reused from the KV cache (llama-server's keys)."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int | None = None  # speculative decoding: tokens drafted and verified, and those accepted
    draft_n_accepted: int | None = None

    @staticmethod
    def _rate(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)

    def to_dict(self) -> dict[str, float]:
        p_tok, p_sec = self._rate(self.prompt_n, self.prompt_ms)
        g_tok, g_sec = self._rate(self.predicted_n, self.predicted_ms)
        return {"cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms, "prompt_per_token_ms": p_tok,
                "prompt_per_second": p_sec, "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
                "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec,
                **({} if self.draft_n is None else {"draft_n": self.draft_n,
                                                    "draft_n_accepted": self.draft_n_accepted})}

    def log_lines(self) -> list[str]:
        """llama-server's per-request lines."""
        d = self.to_dict()
        prompt = (f"prompt eval time = {self.prompt_ms:10.2f} ms / {self.prompt_n:5d} tokens "
                  f"({d['prompt_per_token_ms']:8.2f} ms per token, {d['prompt_per_second']:8.2f} tokens per second)")
        gen = (f"       eval time = {self.predicted_ms:10.2f} ms / {self.predicted_n:5d} tokens "
               f"({d['predicted_per_token_ms']:8.2f} ms per token, {d['predicted_per_second']:8.2f} tokens per second)")
        total = (f"      total time = {self.prompt_ms + self.predicted_ms:10.2f} ms / "
                 f"{self.prompt_n + self.predicted_n:5d} tokens")
        lines = [prompt, gen, total]
        if self.draft_n is not None:
            rate = self.draft_n_accepted / self.draft_n if self.draft_n else 0.0
            lines.append(f"draft acceptance rate = {rate:7.5f} ({self.draft_n_accepted:5d} accepted / "
                         f"{self.draft_n:5d} generated)")
        return lines
