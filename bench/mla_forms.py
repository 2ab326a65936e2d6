"""MLA's two forms (moerun.model.layers): T queries over S cached latents, absorbed (queries into the latent
space) against expanded (every head's keys and values made from the latents), at DeepSeek-V2-Lite's attention
shape (16 heads, rank 512, rope 64, nope 128, v 128; V3: --heads 128), float32 on the CPU. Prints the median
milliseconds of each form, which is faster, and what layers.mla_form picks.

    python bench/mla_forms.py -t 2
"""

from __future__ import annotations

import torch
from toolkit import add, median_time, parser

from moerun.model.layers import mla_absorbed, mla_expanded, mla_form


def median_ms(f, reps: int) -> float:
    return median_time(lambda _: f(), reps) * 1e3  # after one warm-up call


def main() -> None:
    p = add(parser(__doc__), "threads")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("-r", "--reps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    nh, rank, rope, nope, dv = a.heads, 512, 64, 128, 128
    g = torch.Generator().manual_seed(0)
    wk_b, wv_b = torch.randn(nh, rank, nope, generator=g), torch.randn(nh, dv, rank, generator=g)
    print(f"{'T':>5} {'S':>6} {'absorbed ms':>12} {'expanded ms':>12}  faster    picked")
    for T, S in ((1, 64), (1, 512), (1, 4096), (4, 512), (16, 16), (16, 512), (16, 4096), (64, 64), (64, 512),
                 (64, 4096), (256, 256), (256, 1024), (256, 4096), (512, 512), (512, 2048)):
        q_nope, q_pe = torch.randn(T, nh, nope, generator=g), torch.randn(T, nh, rope, generator=g)
        latent = torch.randn(S, rank + rope, generator=g)
        q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
        args = (q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, 0.07)
        with torch.inference_mode():
            ab = median_ms(lambda args=args: mla_absorbed(*args), a.reps)
            ex = median_ms(lambda args=args: mla_expanded(*args), a.reps)
        pick = mla_form(T).__name__.removeprefix("mla_")
        print(f"{T:>5} {S:>6} {ab:>12.2f} {ex:>12.2f}  {'absorbed' if ab < ex else 'expanded':9} {pick}",
              flush=True)


if __name__ == "__main__":
    main()
