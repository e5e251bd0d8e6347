"""CPU decode outside torch.compile (kernels/cpu_compiled.py): the compiled-mode forms, compiled per
op, write the reference's bits and attend like the reference; one compile serves every step; the
reference stays selectable; a process never compiles past the budget.

The rest of the suite runs with KIVI_CPU_KERNELS=reference (conftest.py); these tests select the
compiled kernels, the default users get, explicitly."""

import functools
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from kivi_models import generate, load_model, make_cache, patch_model
from kivi_ops import KIVICache, KIVIConfig, Step, dispatch
from kivi_ops.dispatch import implementations
from kivi_ops.dispatch import cpu_compiled
from kivi_ops.kernels.reference import attend_reference

FUSED = implementations.form("attend", "decomposed_fused")  # cpu_compiled keys its budget by form

# Attention tolerance: as tests/test_decomposed.py's ATOL (the same two forms compared: the
# fused form sums in another order than the reference, in fp32; observed < 2e-6).
ATOL = RTOL = 1e-5

CONFIGS = {
    "plain": KIVIConfig(2, 2, 8, 16),
    "pool": KIVIConfig(2, 4, 8, 16, sink_tokens=2, outlier_tokens=2, outlier_skip_layers=0),  # fused form + pool
    "pre_rope": KIVIConfig(4, 2, 8, 16, pre_rope=True),  # KVQuant: the materialized form
    "ott_policy": KIVIConfig(2, 2, 8, 5, flush_policy="ott"),  # OTT's schedule: a group of 8 every 8 steps
    "ott_policy_pool": KIVIConfig(2, 4, 8, 5, sink_tokens=1, outlier_tokens=2, outlier_skip_layers=0,
                                  flush_policy="ott"),
}
# The graphs take 15-30 s each to compile on 2 busy cores (four graphs a case): `make test-slow`.
# `make test` runs the compiled kernels end to end in the library loop below.
CONFIG_PARAMS = [pytest.param(name, marks=pytest.mark.slow) for name in CONFIGS]


def twin_caches(config, B=3, H=2, D=32, S=72):
    rope = dict(rope_inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2) / D)) if config.pre_rope else {}
    return [KIVICache(config, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D, **rope)
            for _ in range(2)]


def decode_steps(B=3, H=2, D=32, steps=40, seed=0):
    """A ragged prompt (one empty row), then one-token steps, some with a row idle (counts 0),
    crossing several key flushes (R = 16)."""
    gen = torch.Generator().manual_seed(seed)
    yield (torch.randn(B, H, 20, D, generator=gen), torch.randn(B, H, 20, D, generator=gen),
           Step(counts=torch.tensor([0, 20, 13])[:B]))
    for i in range(steps):
        counts = torch.tensor([1, 0, 1])[:B] if i % 7 == 3 else None
        yield torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen), Step(counts=counts)


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    # Each test starts with the whole budget: signatures compiled by earlier tests in this process
    # would otherwise send later ones to the reference.
    monkeypatch.setattr(cpu_compiled, "_signatures", defaultdict(set))
    with dispatch.cpu_kernels("compiled"):
        yield


@pytest.mark.parametrize("name", CONFIG_PARAMS)
def test_compiled_decode_writes_the_reference_bits_and_attends_like_it(name):
    config = CONFIGS[name]
    ref, comp = twin_caches(config)
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, (key, value, step) in enumerate(decode_steps()):
            query = torch.randn(3, 6, key.shape[2], 32, generator=gen)  # GQA: 3 query heads per kv head
            with dispatch.cpu_kernels("reference"):
                ref.layers[0].append(key, value, step)
                want = ref.layers[0].attend(query, step)
            comp.layers[0].append(key, value, step)
            got = comp.layers[0].attend(query, step)
            for field, a, b in zip(comp.layers[0].tensors()._fields, ref.layers[0].tensors(), comp.layers[0].tensors()):
                assert (a is None and b is None) or torch.equal(a, b), f"{field} differs after step {n}"
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {n}: {m}")
    # One compile per op served all 40 decode steps (and the idle-row steps, which pass counts).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4  # append and attend, with / without counts
    assert ref.lengths().tolist() == [40, 20 + 40 - 6, 13 + 40]  # row 1 idle on 6 steps


def test_the_choice_follows_the_selection():
    cache = twin_caches(CONFIGS["plain"])[0]
    layer = cache.layers[0].tensors()
    compiled = dispatch.choose("attend", device="cpu", mode="eager", q_len=1, layer=layer, cpu_kernels="compiled")
    assert compiled == dispatch.Choice("decomposed_fused", in_op=False, compiled=True)
    with dispatch.cpu_kernels("reference"):
        assert dispatch.current_cpu_kernels() == "reference"
    assert dispatch.current_cpu_kernels() == "compiled"


def test_past_the_budget_new_signatures_run_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_compiled, "MAX_SIGNATURES", 0)
    cache = twin_caches(CONFIGS["plain"], S=40)[0]
    key, value, step = next(decode_steps())
    cache.layers[0].append(key, value, step)
    query = torch.randn(3, 6, 1, 32)
    got = cache.layers[0].attend(query)
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    assert torch.equal(got, attend_reference(query, layer, None, params, 32 ** -0.5))  # bit for bit: the reference
    assert cpu_compiled._signatures[FUSED] == set()


def test_an_unknown_selection_in_the_environment_is_refused_at_import():
    env = dict(os.environ, KIVI_CPU_KERNELS="fast")
    proc = subprocess.run([sys.executable, "-c", "import kivi_ops"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert ("the environment variable KIVI_CPU_KERNELS must be one of ('compiled', 'reference'), got 'fast'"
            in proc.stderr)


@pytest.fixture(scope="module")
def patched():
    model, tok = load_model()
    return patch_model(model), tok


def test_the_library_loop_under_inference_mode_runs_the_compiled_kernels_and_the_reference_tokens(patched):
    # `kivi generate` and `kivi serve` without --compile: the library's loop (inference mode),
    # right-padded rows of different lengths.
    model, tok = patched
    ids = [tok("The capital of France is")["input_ids"], tok("def fibonacci(n):")["input_ids"]]

    def new_tokens():
        cache = make_cache(model, method="kivi", batch_size=2, max_seq_len=48,
                           kivi_config=KIVIConfig(group_size=8, residual_length=8))
        return generate(model, ids, max_new_tokens=20, cache=cache, pad_token_id=0).tokens

    with dispatch.cpu_kernels("reference"):
        want = new_tokens()
    cpu_compiled._signatures[FUSED].clear()
    assert new_tokens() == want
    assert len(cpu_compiled._signatures[FUSED]) == 1  # the compiled kernels ran, one shape


@pytest.mark.slow  # the library loop above runs the same compiled kernels in `make test`
def test_hf_generate_with_compile_disabled_runs_the_compiled_kernels_and_the_reference_tokens(patched):
    # The README's Hugging Face path with disable_compile=True: a left-padded batch, greedy, gives
    # the tokens the reference kernels give (the attention's fp32 rounding does not move them here).
    model, tok = patched
    tok.padding_side = "left"
    batch = tok(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True)

    def new_tokens():
        cache = make_cache(model, method="kivi", batch_size=2, max_seq_len=48,
                           kivi_config=KIVIConfig(group_size=8, residual_length=8))
        out = model.generate(**batch, past_key_values=cache, max_new_tokens=24, do_sample=False,
                             pad_token_id=tok.eos_token_id, disable_compile=True)
        return out[:, batch["input_ids"].shape[1]:].tolist()

    with dispatch.cpu_kernels("reference"):
        want = new_tokens()
    cpu_compiled._signatures[FUSED].clear()
    got = new_tokens()
    assert got == want
    assert len(cpu_compiled._signatures[FUSED]) >= 1  # the compiled kernels ran


def _scaled(factor, query, layer, counts, params, scale):
    return query * factor


def test_dynamos_recompile_limit_never_fails_a_compiled_op(monkeypatch):
    # Dynamo keeps a function's compiled versions per code object, at most recompile_limit, and
    # a fullgraph compile past it fails. torch.compile wraps every functools.partial in one shared
    # function, so partial forms shared that limit (seen in `make test-slow`: the paged attention's
    # first compile, 9th in the process, failed), and Dynamo recompiles for an inference tensor,
    # which has other dispatch keys. Here the limit is 1: two partial forms, two shapes each, then
    # the same shape as an inference tensor; each runs compiled, none fails.
    forms = {2.0: functools.partial(_scaled, 2.0), 3.0: functools.partial(_scaled, 3.0)}
    with torch._dynamo.config.patch(recompile_limit=1):
        for factor, form in forms.items():
            for n in (3, 5):
                x = torch.arange(n, dtype=torch.float32)
                assert torch.equal(cpu_compiled.attend(form, x, (), None, (), 1.0), x * factor)
            with torch.inference_mode():
                x = torch.arange(5, dtype=torch.float32)
                assert torch.equal(cpu_compiled.attend(form, x, (), None, (), 1.0), x * factor)
            assert len(cpu_compiled._signatures[form]) == 3  # compiled, not the reference's fallback
