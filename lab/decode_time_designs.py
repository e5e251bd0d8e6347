"""Predicted H200 times of the next GPU run's decode-attention points and of candidate designs
toward issue 40's targets, from the calibrated decode_time_model.

Targets (issue 40; batch 8, 32 x 128 heads, KIVI-2, fp16): at 32K, >= 4x SDPA and >= 75% of copy
bandwidth; at 1K, >= 1.0x SDPA; GQA 4:1 (32/8 heads) at 32K, >= 3x SDPA.

Each design is the CUDA C++ kernel's launch with one change the model can price from what it
models (round trips, instructions, occupancy, the schedule); what it cannot price is said in the
design's `assumes`.
"""

from __future__ import annotations

from .decode_time_model import (
    DEVICE, MODEL_VERSION, Params, cuda_cpp_launches, launches_of, must_read_bytes, predict_us, sdpa_launches,
)

COPY_BYTES_PER_S = 4.24e12  # the runs' measured copy bandwidth (read + write), the bandwidth share's base
SWEEP_SHAPES = [(32, 32, 1024), (32, 32, 32768), (32, 8, 1024), (32, 8, 32768)]
TRITON_CONFIGS = ((1, 32), (4, 16), (4, 32), (8, 32))
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# (name, cuda_cpp_launches keyword arguments, what the model assumes beyond its counted facts)
DESIGNS = [
    ("cuda_cpp as built (default splits)", {}, "today's kernel"),
    ("+ 2-stage cp.async prefetch", dict(stages=2), "each warp keeps 2 chunks' loads in flight: a chunk waits half a "
     "round trip; the chunk loop's instructions unchanged; +12 KB shared memory per block"),
    ("+ 4-stage cp.async prefetch", dict(stages=4), "as above, 4 chunks in flight, +36 KB shared memory per block"),
    ("+ scale and zero in one load", dict(chunk_instructions_saved=16),
     "16 fewer warp instructions per chunk (8 key scale/zero loads and their address arithmetic); an estimate, "
     "not a count: the new loop is not compiled"),
    ("+ residual window in the same kernel", dict(residual_as_chunks=True),
     "the tail's tokens run as 32-token fp16 chunks at the quantized chunk loop's instruction count, over the "
     "splits; no separate tail block"),
    ("4-stage prefetch + residual in kernel", dict(stages=4, residual_as_chunks=True), "the two above together"),
    ("4-stage prefetch + residual in kernel + 4 blocks per SM of splits",
     dict(stages=4, residual_as_chunks=True, splits_per_sm=4),
     "as above, with splits so that the grid has 4 blocks per SM (every SM busy at batch 1 and at 1K)"),
]


def design_launches(static: dict, B: int, Hq: int, H: int, L: int, splits_per_sm: int | None = None, **kw) -> list:
    if splits_per_sm:
        kw["num_splits"] = max(1, min(64, -(-splits_per_sm * DEVICE["sms"] // (B * H)), L // 128))
    return cuda_cpp_launches(static, B, Hq, H, L, **kw)


def share(B: int, Hq: int, H: int, L: int, us: float) -> float:
    return must_read_bytes(B, Hq, H, L) / COPY_BYTES_PER_S / (us * 1e-6)


def predictions(static: dict, params: Params) -> dict:
    as_is = []
    for Hq, H, L in SWEEP_SHAPES:
        point = dict(batch=8, q_heads=Hq, kv_heads=H, tokens=L)
        for warps, block_n in TRITON_CONFIGS:
            as_is.append(dict(point, kernel="triton_decode", num_warps=warps, block_n=block_n))
        for splits in (None, 1, 16):
            as_is.append(dict(point, kernel="cuda_cpp", num_splits=splits))
        as_is.append(dict(point, kernel="sdpa"))
    for L in CONTEXTS:  # kivi bench attention's curve (Triton default), MHA
        as_is.append(dict(batch=8, q_heads=32, kv_heads=32, tokens=L, kernel="triton_decode", num_warps=1, block_n=32))
    for row in as_is:
        row["predicted_us"] = round(predict_us(launches_of(row, static), params), 1)
    designs = []
    for B, Hq, H, L in ((8, 32, 32, 32768), (8, 32, 32, 1024), (8, 32, 8, 32768), (8, 32, 8, 1024),
                        (1, 32, 32, 1024), (1, 32, 32, 32768)):
        sdpa = predict_us(sdpa_launches(B, Hq, H, L), params)
        for name, kw, assumes in DESIGNS:
            us = predict_us(design_launches(static, B, Hq, H, L, **kw), params)
            designs.append(dict(design=name, assumes=assumes, batch=B, q_heads=Hq, kv_heads=H, tokens=L,
                                predicted_us=round(us, 1), predicted_sdpa_us=round(sdpa, 1),
                                speedup_vs_sdpa=round(sdpa / us, 2), bandwidth_share=round(share(B, Hq, H, L, us), 3)))
    return dict(model=MODEL_VERSION, params=vars(params), device=DEVICE["name"],
                note="predicted before the next GPU run; compare each row with its measurement. as_is: today's "
                     "kernels at the sweep's and kivi bench attention's shapes (batch 8, head_dim 128, KIVI-2, "
                     "fp16, CUDA-graph replay). designs: the CUDA C++ kernel with one change each",
                as_is=as_is, designs=designs)
