"""Request lengths like a public chat trace's, for the serving benchmarks.

ShareGPT (conversations shared from ChatGPT), as the vLLM paper reports it (Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023, Figure 11):
mean prompt 161.31 tokens, mean output 337.99 tokens, about 500 per sequence. Both lengths are drawn
log-normal with those means (sigma 1: long-tailed, as the trace is) from a fixed seed, then clipped
to [1, max_tokens]; the means actually drawn are reported beside the results.
"""

from __future__ import annotations

import math
import random

SHAREGPT = dict(name="ShareGPT (vLLM paper, Kwon et al. SOSP 2023, Fig. 11)", prompt_mean=161.31, output_mean=337.99)
SIGMA = 1.0


def lognormal(rng: random.Random, mean: float, sigma: float = SIGMA) -> float:
    """A log-normal draw with the given mean (mu = ln(mean) - sigma^2 / 2)."""
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)


def chat_lengths(n: int, *, seed: int = 0, scale: float = 1.0, max_prompt: int = 4096, max_output: int = 4096,
                 trace: dict = SHAREGPT) -> list[tuple[int, int]]:
    """n (prompt tokens, output tokens) pairs: log-normal with the trace's means times `scale`, clipped."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = lognormal(rng, trace["prompt_mean"] * scale)
        output = lognormal(rng, trace["output_mean"] * scale)
        out.append((min(max(1, round(prompt)), max_prompt), min(max(1, round(output)), max_output)))
    return out
