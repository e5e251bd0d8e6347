"""Passkey retrieval (KIVI's needle-in-a-haystack test, KVQuant Table 2).

A 5-digit key is hidden at a random depth in repeated filler text; the model must repeat it.
Prompts are built deterministically from a seed. The prompt is a prefill (exact attention);
the answer is decoded through the cache, so its attention reads the quantized prompt.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from kivi_models import generate, make_cache
from kivi_ops import KIVIConfig

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class PasskeyPrompt:
    text: str
    key: str
    depth: float


def build_prompt(tokenizer, length: int, rng: random.Random) -> PasskeyPrompt:
    """A prompt of about `length` tokens (never more) with the key at a random depth."""
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    depth = rng.random()
    intro = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    fixed = len(tokenizer(intro + needle + QUESTION)["input_ids"])
    per_filler = len(tokenizer(FILLER * 10)["input_ids"]) / 10
    repeats = max(1, int((length - fixed) / per_filler))
    while True:
        before = int(repeats * depth)
        text = intro + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
        if len(tokenizer(text)["input_ids"]) <= length or repeats == 1:
            return PasskeyPrompt(text, key, before / repeats)
        repeats -= 1


def build_prompts(tokenizer, length: int, trials: int, seed: int) -> list[PasskeyPrompt]:
    rng = random.Random(f"{seed}-{length}")
    return [build_prompt(tokenizer, length, rng) for _ in range(trials)]


@torch.inference_mode()
def passkey_accuracy(patched_model, tokenizer, *, lengths: list[int], trials: int, method: str,
                     kivi_config: Optional[KIVIConfig] = None, seed: int = 0, batch_size: int = 1,
                     desc: str = "passkey") -> dict:
    """{"accuracy": {length: fraction}, "details": [...], "seconds": s}."""
    start = time.perf_counter()
    accuracy, details = {}, []
    with tqdm(total=len(lengths) * trials, desc=desc, unit="prompt", leave=False) as bar:
        for length in lengths:
            prompts = build_prompts(tokenizer, length, trials, seed)
            correct = 0
            for i in range(0, trials, batch_size):
                group = prompts[i : i + batch_size]
                ids = [tokenizer(p.text)["input_ids"] for p in group]
                cache = make_cache(patched_model, method=method, batch_size=len(ids),
                                   max_seq_len=max(map(len, ids)) + ANSWER_TOKENS, kivi_config=kivi_config)
                result = generate(patched_model, ids, max_new_tokens=ANSWER_TOKENS, cache=cache,
                                  pad_token_id=tokenizer.eos_token_id)
                for p, tokens, n in zip(group, result.tokens, map(len, ids)):
                    answer = tokenizer.decode(tokens, skip_special_tokens=True)
                    ok = p.key in answer
                    correct += ok
                    details.append(dict(length=length, prompt_tokens=n, depth=round(p.depth, 3), key=p.key,
                                        answer=answer.strip(), correct=ok))
                bar.update(len(group))
            accuracy[length] = correct / trials
    return dict(accuracy=accuracy, details=details, seconds=time.perf_counter() - start)
