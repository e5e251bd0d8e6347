"""The library's own greedy generation with the cache semantics the vLLM backend implements: a
prompt (or its first chunk) attends over its exact keys and values (Step(prefill=True)), every
later chunk and decode token attends through the KIVI cache after appending (Step())."""

from __future__ import annotations

from typing import Optional

import torch

from kivi_models.attention import patch_model
from kivi_models.generate import decode_step, forward, lm_logits, make_cache, prefill
from kivi_ops import KIVIConfig, Step, dispatch


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


MARGINS: dict = {}  # position -> the library's top-1 minus top-2 logit at the last replay (failure messages)


@torch.no_grad()
def replay(model, tokens: list[int], prompt_len: int, schedule: list[tuple], config: KIVIConfig,
           prefix_chunk: Optional[int] = None) -> dict:
    """Run the library over the chunks vLLM scheduled for one request ((tokens before, tokens now)
    per step; tokens before = 0 starts the sequence again, as vLLM's recompute does) on its final
    tokens (prompt + output), teacher-forced. Returns {position: the token the library predicts
    there} for every chunk that ends at or past the prompt: greedy vLLM equals the library iff each
    equals tokens[position].

    prefix_chunk (vLLM's prefix caching on): schedule is prefix_schedules()'s, and every chunk
    attends through the cache (prefill_chunked)."""
    with dispatch.cpu_kernels("reference"):  # the kernels the backend runs (no compile per cache shape)
        return _replay(model, tokens, prompt_len, schedule, config, prefix_chunk)


def _cut(ctx, n, chunk, whole=True):
    """A chunk [ctx, ctx + n) cut at the multiples of chunk, as the backend cuts it."""
    pieces, end = [], ctx + n
    while ctx < end:
        piece_end = min((ctx // chunk + 1) * chunk, end)
        pieces.append((ctx, piece_end - ctx, whole and piece_end == end))
        ctx = piece_end
    return pieces


def prefix_schedules(trace: list, chunk: int) -> dict:
    """{prompt tuple: [(tokens before, tokens now, ends a vLLM step), ...]} with prefix caching: the
    chunks cut at the multiples of chunk, and every (re)start past token 0 preceded by the chunks that
    wrote the window copy it starts from (the first request to reach that prompt boundary with the
    same tokens: the copy kept is the first saved, prefix_tails.py), since that copy depends on how
    those chunks fell."""
    runs, out, writers = {}, {}, {}
    for step in trace:
        started = []
        for prompt, ctx, n in step:  # the restores run before the step's saves
            run = runs.get(prompt, [])
            if not run or ctx != run[-1][0] + run[-1][1]:
                run = [(c, k, False) for c, k, _ in writers[prompt[:ctx]]] if ctx else []
                out.setdefault(prompt, []).extend(run)
            started.append((prompt, ctx, n, run))
        # The backend runs one-token decodes first, then the rest in batch order; the first copy stays.
        started.sort(key=lambda r: not (r[2] == 1 and r[1] > 0))
        for prompt, ctx, n, run in started:
            for piece in _cut(ctx, n, chunk):
                run.append(piece)
                out[prompt].append(piece)
                end = piece[0] + piece[1]
                if end % chunk == 0 and end <= len(prompt):
                    writers.setdefault(prompt[:end], list(run))
            runs[prompt] = run
    return out


def _replay(model, tokens, prompt_len, schedule, config, prefix_chunk):
    S = max(len(tokens) + 1, config.residual_length)
    cache = None
    predicted = {}
    steps = schedule if prefix_chunk else [(c, n, True) for c, n in schedule]
    for ctx, n, whole in steps:
        ids = torch.tensor([tokens[ctx:ctx + n]])
        if ctx == 0:
            cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=S, kivi_config=config)
        if ctx == 0 and not prefix_chunk:
            logits = prefill(model, cache, ids, torch.tensor([n]))
        else:
            if int(cache.lengths()[0]) != ctx:
                raise AssertionError(f"schedule skips tokens: the cache holds {int(cache.lengths()[0])}, step at {ctx}")
            hidden = forward(model, cache, ids, ctx + torch.arange(n)[None], Step())
            logits = lm_logits(model, hidden[:, -1])
        if whole and ctx + n >= prompt_len and ctx + n < len(tokens):
            top = logits[0].float().topk(2)
            predicted[ctx + n] = int(top.indices[0])
            MARGINS[ctx + n] = float(top.values[0] - top.values[1])
    return predicted


def schedules(trace: list) -> dict:
    """{prompt tuple: [(tokens before, tokens now), ...]} from windows.SLOTS.trace."""
    out: dict = {}
    for step in trace:
        for prompt, ctx, n in step:
            out.setdefault(prompt, []).append((ctx, n))
    return out
