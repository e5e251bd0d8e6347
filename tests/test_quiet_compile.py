"""Issue 43 item 2: a compiled generation prints no warning from our code paths. Dynamo warns about
every functools.lru_cache-wrapped function it traces into ("Silent incorrectness is only a
*potential* risk"), which a user cannot act on: traced code must not call one (dispatch.py keeps
its implementation table in a plain dict, filled outside tracing)."""

import warnings

import torch

from kivi_models import compile_decode_step, generate, make_cache, patch_model
from kivi_ops import KIVIConfig
from tiny_models import tiny_llama

OUR_CODE = ("kivi_ops", "kivi_models", "models/", "kivi_cli")


def test_compiled_generation_warns_nothing_from_our_code(monkeypatch):
    # The warnings come from tracing our code (Dynamo, then AOTAutograd over the ops' fake kernels);
    # Inductor's C++ build of the traced graph runs none of it, and is a minute cold on 2 cores:
    # "aot_eager" traces exactly as the default backend does up to that build.
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, **{**options, "backend": "aot_eager"}))
    model = patch_model(tiny_llama())
    torch.compiler.reset()  # trace afresh: Dynamo warns while it traces, not when a graph is reused
    cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=64,
                       kivi_config=KIVIConfig(2, 2, group_size=8, residual_length=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=4, cache=cache,
                 step_fn=compile_decode_step(torch.device("cpu")), warmup_steps=1)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "lru_cache" in str(w.message) or any(part in w.filename or part in str(w.message) for part in OUR_CODE)]
    assert not ours, "warnings from our code paths:\n" + "\n".join(ours)
