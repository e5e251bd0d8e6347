"""The library's own greedy generation with the cache semantics the vLLM backend implements: a
prompt (or its first chunk) attends over its exact keys and values (Step(prefill=True)), every
later chunk and decode token attends through the KIVI cache after appending (Step())."""

from __future__ import annotations

from typing import Optional

import torch

from kivi_models.attention import patch_model
from kivi_models.generate import decode_step, forward, lm_logits, make_cache, prefill
from kivi_ops import KIVIConfig, Step


def load_patched(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return patch_model(model)


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int, method: str, config: Optional[KIVIConfig] = None,
           chunk: Optional[int] = None) -> list[int]:
    """Greedy tokens of one prompt (batch 1); chunk: prefill in chunks of that many tokens."""
    S = max(len(prompt) + max_new_tokens, config.residual_length if config else 1)
    cache = make_cache(model, method=method, batch_size=1, max_seq_len=S, kivi_config=config)
    chunk = chunk or len(prompt)
    ids = torch.tensor([prompt[:chunk]])
    logits = prefill(model, cache, ids, torch.tensor([ids.shape[1]]))
    for begin in range(chunk, len(prompt), chunk):
        ids = torch.tensor([prompt[begin:begin + chunk]])
        hidden = forward(model, cache, ids, begin + torch.arange(ids.shape[1])[None], Step())
        logits = lm_logits(model, hidden[:, -1])
    out = []
    for i in range(max_new_tokens):
        token = int(logits[0].argmax())
        out.append(token)
        if i + 1 < max_new_tokens:
            logits = decode_step(model, cache, torch.tensor([token]), torch.tensor([len(prompt) + i]))
    return out
