"""The CUDA C++ decode kernel (kivi_ops/cuda/decode_attend.cu) against the reference attention.

On a CUDA GPU (skipped elsewhere, "needs a CUDA GPU"): the built extension against
attend_reference for KIVI-2 G=32, head_dim 64 and 128, MHA and GQA, ragged lengths that are not
multiples of G or R, a padded row (count 0), both flush policies, several split counts, and the
dispatcher's choice under KIVI_CUDA_DECODE=cuda_cpp.

Everywhere: the same kernel modelled lane by lane in Python (tests/cuda_decode_emulator.py)
against the reference, the loader's and the dispatcher's refusals, and (slow, where the
cuda-build extra is installed) nvcc compiling the kernel for sm_90a with no spills.

Tolerance (decode_attend.cu's header): the kernel rounds q * k_scale, the dequantized values and
p to fp16 and accumulates in fp32. A base-2 score is off by at most 3 u sum_c |q'_c| (u = 2^-11,
q' = q * scale * log2(e) * k_scale of its group, codes <= 3), so each softmax weight by a factor
within 2^(+-2 du) of the exact one, du the largest such score error; the values by u |v|, p by u.
The output (a convex combination) is then off by at most
    (2^(2 du) - 1 + 3 u) * max|v| + u |ref|
which the test computes from the data (`bound`). fp32 accumulation error is far below it.
"""

import ctypes
import os

import numpy as np
import pytest
import torch

from kivi_ops import dispatch
from kivi_ops.cuda.attend import attend_cuda_cpp, default_num_splits, unsupported
from kivi_ops.cuda.toolkit import CudaKernelUnavailable, pip_toolkit_root
from kivi_ops.kernels.reference import append_reference, attend_reference
from kivi_ops.layout import LayerTensors, QuantParams
from kivi_ops.packing import packed_bytes
from kivi_ops.schedule import KIVI, OTT

from tests.cuda_decode_emulator import emulate_decode

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
U = 2.0**-11


def make_layer(B, H, S, D, R, G, lengths, policy=KIVI, seed=0, outlier_scale=1.0):
    """A fp16 KIVI-2 layer on CPU holding `lengths` tokens per row: a prefill chunk, then 3 decode
    steps, written by the reference append."""
    gen = torch.Generator().manual_seed(seed)
    ng, gv, W = -(-S // G), min(G, D), min(R + (G - 1 if policy == OTT else 0), S)
    shapes = [((B, H, S, packed_bytes(D, 2)), torch.uint8), ((B, H, ng, D), torch.float16),
              ((B, H, ng, D), torch.float16), ((B, H, W, D), torch.float16),
              ((B, H, S, packed_bytes(D, 2)), torch.uint8), ((B, H, S, D // gv), torch.float16),
              ((B, H, S, D // gv), torch.float16), ((B, H, W, D), torch.float16), ((B,), torch.int64)]
    layer = LayerTensors(*[torch.zeros(shape, dtype=dtype) for shape, dtype in shapes])
    params = QuantParams(2, 2, G, R, flush_policy=policy)
    lengths = torch.tensor(lengths)
    first = (lengths - 3).clamp(min=0)
    if int(first.max()):
        kv = (torch.randn(2, B, H, int(first.max()), D, generator=gen) * outlier_scale).half()
        append_reference(layer, kv[0], kv[1], first, params)
    for _ in range(3):
        kv = torch.randn(2, B, H, 1, D, generator=gen).half()
        append_reference(layer, kv[0], kv[1], (lengths - layer.lengths).clamp(max=1), params)
    assert layer.lengths.tolist() == lengths.tolist()
    return layer, params


def bound(query, layer, params, scale, ref):
    """The tolerance of the module doc, from the data (per output element)."""
    k_scale, v_res = layer.k_scale.float(), layer.v_res.float()
    B, Hq, _, D = query.shape
    H = k_scale.shape[1]
    q = query.float().reshape(B, H, Hq // H, D) * scale * 1.4426950408889634
    du = 3 * U * (q.abs()[:, :, :, None, :] * k_scale.abs()[:, :, None]).sum(-1).amax()  # over groups, heads
    vmax = max(layer.v_res.float().abs().max(),
               (3 * layer.v_scale.float().abs() + layer.v_zero.float().abs()).max(), v_res.abs().max())
    return float((2 ** (2 * du) - 1 + 3 * U) * vmax) + U * ref.float().abs() + 1e-6


def matched_reference(query, layer, counts, params, scale):
    """The attention computed in float64 with the kernel's own fp16 roundings (q * k_scale and the
    dequantized values of the quantized chunks), but exact p and sums: what is left between it and
    the kernel is p's fp16 rounding and fp32 accumulation, so `matched_bound` is tight and a
    misplaced channel or token shows (the reference bound alone is loose by design).
    Returns (out [B, Hq, 1, D] float64, per-element tolerance)."""
    kc, ks, kz, kr, vc, vs, vz, vr, lengths = (t.numpy() for t in layer.kivi)
    B, Hq, _, D = query.shape
    H, qg, G, R = kc.shape[1], Hq // kc.shape[1], params.group_size, params.residual_length
    Gv, W, ch = min(G, D), kr.shape[2], np.arange(D)
    out, tol = np.zeros((B, Hq, 1, D)), np.zeros((B, Hq, 1, D))
    f16 = lambda x: x.astype(np.float16).astype(np.float64)  # noqa: E731
    for b in range(B):
        L = int(lengths[b]) if counts is None or int(counts[b]) else 0
        if L == 0:
            continue
        if params.flush_policy == OTT:
            nqk = nqv = max(L - R, 0) // G * G
        else:
            nqk, nqv = L // R * R, max(L - R, 0)
        t = np.arange(L)
        fast = (t < min(nqk, nqv) // 32 * 32)[:, None]
        for h in range(H):
            q = (query[b, h * qg:(h + 1) * qg, 0].float() * np.float32(scale * 1.4426950408889634)).double().numpy()
            k_code = ((kc[b, h, :L][:, ch // 4] >> (2 * (ch % 4))) & 3).astype(np.float64)
            v_code = ((vc[b, h, :L][:, ch // 4] >> (2 * (ch % 4))) & 3).astype(np.float64)
            s, z = ks[b, h, t // G].astype(np.float64), kz[b, h, t // G].astype(np.float64)
            q_prime = f16((q[:, None, :] * s[None]).astype(np.float32))  # [qg, L, D]
            terms = np.abs(q_prime * k_code).sum(-1) + np.abs(q[:, None, :] * z[None]).sum(-1)
            score_fast = (q_prime * k_code).sum(-1) + (q[:, None, :] * z[None]).sum(-1)
            keys = np.where((t < nqk)[:, None], k_code * s + z, kr[b, h, t % W].astype(np.float64))
            score = np.where(fast[:, 0][None], score_fast, q @ keys.T)
            vsc, vze = vs[b, h, t][:, ch // Gv].astype(np.float64), vz[b, h, t][:, ch // Gv].astype(np.float64)
            exact = np.where((t < nqv)[:, None], v_code * vsc + vze, vr[b, h, t % W].astype(np.float64))
            values = np.where(fast, f16(v_code * vsc + vze), exact)
            p = np.exp2(score - score.max(-1, keepdims=True))
            o = (p @ values) / p.sum(-1, keepdims=True)
            du = 2 * (D + 8) * 2.0**-24 * terms.max()  # fp32 (and tensor-core) accumulation of a score
            out[b, h * qg:(h + 1) * qg, 0] = o
            tol[b, h * qg:(h + 1) * qg, 0] = ((2 ** (2 * du) - 1 + U + 2.0**-20) * np.abs(values).max()
                                              + U * np.abs(o) + 1e-6)
    return torch.from_numpy(out), torch.from_numpy(tol)


def check(out, query, layer, counts, params, scale, where=""):
    """out within the reference's bound and within the rounding-matched reference's tight one."""
    ref = attend_reference(query, layer, counts, params, scale)
    err = (out.float() - ref.float()).abs()
    assert (err <= bound(query, layer, params, scale, ref)).all(), f"{where}: max error vs reference {err.max()}"
    matched, tol = matched_reference(query, layer, counts, params, scale)
    err = (out.double() - matched).abs()
    assert (err <= tol).all(), f"{where}: max error vs the rounding-matched reference {err.max()} (tol {tol.min()})"


CASES = [  # (B, H, Hq, D, S, R, lengths): ragged, not multiples of G or R, a 32K-like spread kept small
    (3, 2, 2, 128, 512, 128, [300, 129, 7]),
    (2, 2, 8, 64, 512, 128, [445, 64]),
    (2, 1, 4, 128, 640, 128, [600, 255]),
    (1, 2, 16, 64, 384, 64, [383]),
]


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"B{c[0]}-H{c[1]}-Hq{c[2]}-D{c[3]}")
def test_emulated_kernel_matches_the_reference(case):
    """The kernel's fragment mapping, unpacking and scheduling, modelled lane by lane on CPU."""
    B, H, Hq, D, S, R, lengths = case
    layer, params = make_layer(B, H, S, D, R, 32, lengths)
    query = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(1)).half()
    scale = D**-0.5
    for splits in (1, 3):
        check(emulate_decode(query, layer, None, params, scale, splits), query, layer, None, params, scale,
              f"splits={splits}")


def test_emulated_kernel_padded_row_and_ott_policy():
    layer, params = make_layer(2, 1, 384, 64, 64, 32, [200, 150], policy=OTT)
    query = torch.randn(2, 2, 1, 64, generator=torch.Generator().manual_seed(2)).half()
    counts = torch.tensor([1, 0])
    out = emulate_decode(query, layer, counts, params, 0.125, 2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    check(out, query, layer, counts, params, 0.125)


def test_emulator_detects_a_wrong_mapping(monkeypatch):
    """The emulated comparison can fail: pair the key codes of k-step s with the query channels of
    k-step s + 1 (a fragment mapping off by one byte)."""
    from tests import cuda_decode_emulator as emu

    real = emu.k_channel
    monkeypatch.setattr(emu, "k_channel", lambda D, s, tig, e: real(D, (s + 1) % (D // 16), tig, e))
    layer, params = make_layer(1, 1, 256, 64, 64, 32, [200])
    query = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(3)).half()
    out = emu.emulate_decode(query, layer, None, params, 0.125, 1)
    with pytest.raises(AssertionError, match="max error"):
        check(out, query, layer, None, params, 0.125)


def test_emulator_uses_the_kernels_constants():
    """Drift guard: every bit-pattern constant of the kernel (masks, magic numbers, fp16x2 multipliers
    and addends, prmt selectors) is in the emulator, so an edit to one shows in the other's tests."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    kernel = set(re.findall(r"0x([0-9A-Fa-f]{4,8})u?\b", (root / "kivi_ops/cuda/decode_attend.cu").read_text()))
    emulator = (root / "tests/cuda_decode_emulator.py").read_text().upper()
    # 0x6400 is the comment's fp16 1024.0 (0x64006400 in code); 0xffffffff the shuffle mask
    missing = {c for c in kernel if f"0X{c.upper()}" not in emulator} - {"6400", "ffffffff"}
    assert not missing, f"constants of decode_attend.cu not in the emulator: {sorted(missing)}"


def test_what_the_kernel_supports():
    layer, params = make_layer(1, 2, 256, 64, 64, 32, [100])
    assert unsupported(layer, params, 1, 8) is None
    assert "q_len" in unsupported(layer, params, 4, 8)
    assert "at most 8" in unsupported(layer, params, 1, 18)
    assert "group_size" in unsupported(layer, params._replace(group_size=16), 1, 2)
    assert "2-bit" in unsupported(layer, params._replace(k_bits=4), 1, 2)
    assert "fp16" in unsupported(layer._replace(k_res=layer.k_res.float()), params, 1, 2)


def test_default_splits_fill_the_gpu_from_static_shapes():
    assert default_num_splits(rows=8 * 32, max_tokens=32768, sms=132) == 2  # 256 blocks per split already
    assert default_num_splits(rows=1 * 8, max_tokens=32768, sms=132) == 33
    assert default_num_splits(rows=1, max_tokens=300, sms=132) == 2  # never under 128 tokens a split
    assert default_num_splits(rows=1, max_tokens=10**6, sms=132) == 64


@pytest.mark.skipif(CUDA, reason="checks the refusal where there is no CUDA")
def test_loader_and_dispatch_refuse_cuda_cpp_here():
    from kivi_ops.cuda.loader import load, unavailable_reason

    assert "CUDA" in unavailable_reason()
    with pytest.raises(CudaKernelUnavailable, match="unavailable: needs a CUDA"):
        load()
    with pytest.raises(CudaKernelUnavailable, match="unavailable"):
        dispatch.set_cuda_decode("cuda_cpp")
    assert dispatch.current_cuda_decode() == "auto"  # a refused setting changes nothing
    with pytest.raises(ValueError, match="must be one of"):
        dispatch.set_cuda_decode("cuda")
    layer, params = make_layer(1, 1, 256, 64, 64, 32, [100])
    with pytest.raises(CudaKernelUnavailable):  # asked for through the environment: refused at the call
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "_cuda_decode", "cuda_cpp")
            dispatch.choose("attend", device="cuda", mode="eager", q_len=1, layer=layer, params=params,
                            query_heads=2)


@pytest.mark.skipif("KIVI_CUDA_DECODE" in os.environ, reason="KIVI_CUDA_DECODE is set")
def test_auto_is_the_default():
    """The tuning table or the autotune picks among the eligible kernels (tests/test_tuning.py)."""
    assert dispatch.current_cuda_decode() == "auto"


def test_dispatch_chooses_cuda_cpp_only_where_asked_and_supported(monkeypatch):
    """With the setting on (the build faked: no GPU here), what choose returns per call."""
    from kivi_ops.cuda import loader

    monkeypatch.setattr(loader, "load", lambda: object())
    monkeypatch.setattr(dispatch, "_cuda_decode", "cuda_cpp")
    layer, params = make_layer(1, 2, 256, 128, 64, 32, [100])

    def impl(**kw):
        args = dict(device="cuda", mode="eager", q_len=1, layer=layer, params=params, query_heads=4) | kw
        return dispatch.choose("attend", **args).implementation

    assert impl() == "cuda_cpp"
    assert impl(params=params._replace(v_bits=4)) == "triton_decode"
    assert impl(query_heads=32) == "triton_decode"  # 16 query heads per kv head
    assert impl(q_len=3) == "triton_split"
    assert impl(paged=True) == "triton_decode"
    assert impl(params=None) == "triton_decode"  # traced callers (dispatch.attend) never pass params
    assert impl(device="cpu") == "decomposed_fused"
    assert dispatch.choose("append", device="cuda", mode="eager", q_len=1, layer=layer,
                           params=params).implementation == "triton"


def test_environment_variable_is_checked_by_name():
    import subprocess
    import sys

    env = dict(os.environ, KIVI_CUDA_DECODE="cuda_c")
    run = subprocess.run([sys.executable, "-c", "import kivi_ops.dispatch"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "KIVI_CUDA_DECODE must be one of" in run.stderr


@pytest.mark.slow
@pytest.mark.skipif(pip_toolkit_root() is None, reason="needs the cuda-build extra (nvcc from PyPI)")
def test_kernel_compiles_for_sm90a_without_spills():
    from lab.cuda_decode_model import measure

    rows = measure("sm_90a")["rows"]
    assert {r["kernel"].split("decode_")[-1][:14] for r in rows} >= {"split_kernelIL", "merge_kernelEN"}
    for r in rows:
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and r["stack_bytes"] == 0, r
        assert r["registers"] <= 168, r  # 3 blocks of 4 warps per SM
    for r in (r for r in rows if "head_dim" in r):
        assert r["by_pipe"]["tensor"] == r["head_dim"] / 128  # 2 (QK + PV) x D/16 MMAs x 2 tiles / 32 tokens
        assert r["bandwidth_share_ceiling"] >= 0.8, r
        assert not {"I2F", "I2FP", "F2I"} & set(r["loop_opcodes"]), r  # codes reach fp16 by lop3 + fma only


def test_prebuilt_params_mirror_the_c_struct():
    from kivi_ops.cuda.prebuilt import DecodeParams

    # decode_attend.cu static_asserts the same three numbers
    assert (ctypes.sizeof(DecodeParams), DecodeParams.batch.offset, DecodeParams.qscale.offset) == (160, 112, 152)


@pytest.mark.slow
@pytest.mark.skipif(pip_toolkit_root() is None, reason="needs the cuda-build extra (nvcc from PyPI)")
def test_prebuilt_library_builds_and_loads_without_a_gpu(tmp_path):
    """The no-compiler route for a GPU machine: the library builds here, loads, and a launch with
    no GPU returns a CUDA error code instead of crashing."""
    from kivi_ops.cuda.prebuilt import DecodeParams, Library, build

    path = build(tmp_path / "libkivi_cuda_decode.so")
    assert path.stat().st_size < 8 * 2**20  # carried to the GPU machine with the working tree
    lib = Library(path)
    params = DecodeParams(batch=1, kv_heads=1, qg=1, head_dim=64, num_splits=1)
    assert lib.lib.kivi_decode_attend_launch(ctypes.byref(params), None) != 0


# ---------------------------------------------------------------- on a GPU


def _on_gpu(layer):
    return LayerTensors(*[t.cuda() if t is not None else None for t in layer])


@needs_gpu
@pytest.mark.parametrize("policy", [KIVI, OTT], ids=["kivi", "ott"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-Hq{c[2]}-D{c[3]}")
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_cuda_kernel_matches_the_reference(case, policy, splits):
    B, H, Hq, D, S, R, lengths = case
    if Hq // H > 8:
        pytest.skip("more than 8 query heads per kv head: Triton's (unsupported names it)")
    layer, params = make_layer(B, H, S, D, R, 32, lengths, policy=policy)
    query = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(1)).half()
    scale = D**-0.5
    counts = torch.ones(B, dtype=torch.int64)
    counts[-1] = 0 if B > 1 else 1  # the last row is padding (count 0) where there are several
    out = attend_cuda_cpp(query.cuda(), _on_gpu(layer), counts.cuda(), params, scale, num_splits=splits).cpu()
    assert out.dtype == torch.float16 and out.shape == query.shape
    check(out, query, layer, counts, params, scale)
    if B > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@needs_gpu
def test_cuda_kernel_long_context_and_large_values():
    """Many splits and chunks, and keys 30x larger (scores far from 0: the online softmax's rescale)."""
    layer, params = make_layer(2, 2, 8192, 128, 128, 32, [8000, 4133], outlier_scale=30.0)
    query = torch.randn(2, 8, 1, 128, generator=torch.Generator().manual_seed(4)).half()
    out = attend_cuda_cpp(query.cuda(), _on_gpu(layer), None, params, 128**-0.5).cpu()
    check(out, query, layer, None, params, 128**-0.5)


@needs_gpu
def test_dispatch_runs_the_cuda_kernel_when_asked():
    layer, params = make_layer(2, 2, 512, 128, 128, 32, [300, 77])
    gpu = _on_gpu(layer)
    query = torch.randn(2, 4, 1, 128, generator=torch.Generator().manual_seed(5)).half()
    previous = dispatch.set_cuda_decode("cuda_cpp")
    try:
        choice = dispatch.choose("attend", device="cuda", mode="eager", q_len=1, layer=gpu, params=params,
                                 query_heads=4)
        assert choice.implementation == "cuda_cpp"
        out = torch.ops.kivi.cache_attend(query.cuda(), *gpu, None, *params, 128**-0.5).cpu()
        # what it does not support still runs Triton
        assert dispatch.choose("attend", device="cuda", mode="eager", q_len=1, layer=gpu,
                               params=params._replace(k_bits=4), query_heads=4).implementation == "triton_decode"
    finally:
        dispatch.set_cuda_decode(previous)
    check(out, query, layer, None, params, 128**-0.5)
