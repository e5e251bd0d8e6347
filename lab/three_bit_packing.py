"""How to pack 3-bit codes (issue 28): bytes, and the cost of unpacking them, measured.

Candidates for one token's row of D 3-bit codes:
  planes   (chosen, packing.py): 8 codes per 24-bit word, the words' three bytes stored as three
           contiguous byte planes of D/8 bytes: exactly 3D/8 bytes.
  int32x10 10 codes per int32 (30 bits used): ceil(D/10) words, 4 bytes each.

Three measurements:
  1. bytes per token row at D = 64, 128, 256;
  2. the decomposed CPU form: one decode step's key scores (unpack + dot with the query, what
     attend_fused does per token) compiled by Inductor for both candidates and for the 2- and
     4-bit rows, median time per call, one thread; and the whole fused decode attention
     (decomposed_fused, compiled) at 2, 3 and 4 bits;
  3. the Triton decode kernel at 2, 3 and 4 bits (sm_90, no GPU): instructions per token of the
     steady-state loop (issue_model.py) and registers / spills (ptxas).

    .venv/bin/python -m lab three_bit_packing [--json out.json] [--skip-triton]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kivi_benchmarks.environment import environment
from kivi_benchmarks.perf import median_time


def row_bytes(D: int) -> dict:
    return dict(head_dim=D, bits2=D // 4, bits3_planes=3 * D // 8, bits3_int32x10=4 * math.ceil(D / 10), bits4=D // 2)


def _scores_planes(packed, q):  # packed uint8 [S, 3 * D/8], q fp32 [8, D/8] (ij order)
    from kivi_ops.kernels.decomposed.attend import unpack_codes_ij

    return (unpack_codes_ij(packed, 3) * q).sum((-1, -2))


def _scores_int32x10(words, q):  # words int32 [S, ceil(D/10)], q fp32 [10, ceil(D/10)] (zero-padded)
    shifts = torch.arange(10, dtype=torch.int32)[:, None] * 3
    return ((torch.bitwise_right_shift(words[:, None, :], shifts) & 7).float() * q).sum((-1, -2))


def _scores_bytes(packed, q, bits):  # 2 or 4 bits: one byte a word
    from kivi_ops.kernels.decomposed.attend import unpack_codes_ij

    return (unpack_codes_ij(packed, bits) * q).sum((-1, -2))


def cpu_unpack(S: int = 32768, D: int = 128) -> list[dict]:
    """Inductor-compiled key scores of one query against S packed rows (the unpack + dot of the
    fused decode form), per candidate."""
    torch.manual_seed(0)
    nw10 = math.ceil(D / 10)
    cases = {
        "2-bit (4 codes / byte)": (lambda p, q: _scores_bytes(p, q, 2), torch.randint(0, 256, (S, D // 4), dtype=torch.uint8),
                                   torch.randn(4, D // 4)),
        "3-bit planes (8 codes / 3 bytes)": (_scores_planes, torch.randint(0, 256, (S, 3 * D // 8), dtype=torch.uint8),
                                            torch.randn(8, D // 8)),
        "3-bit int32x10 (10 codes / int32)": (_scores_int32x10, torch.randint(0, 2**30, (S, nw10), dtype=torch.int32),
                                             torch.randn(10, nw10)),
        "4-bit (2 codes / byte)": (lambda p, q: _scores_bytes(p, q, 4), torch.randint(0, 256, (S, D // 2), dtype=torch.uint8),
                                   torch.randn(2, D // 2)),
    }
    rows = []
    for name, (fn, packed, q) in cases.items():
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        t = median_time(lambda: compiled(packed, q))
        rows.append(dict(candidate=name, tokens=S, head_dim=D, bytes_read=packed.numel() * packed.element_size(),
                         median_us=round(t * 1e6, 1), ns_per_token=round(t * 1e9 / S, 2)))
    return rows


def cpu_fused_attention(S: int = 4096, H: int = 3, Hq: int = 9, D: int = 64) -> list[dict]:
    """One decode step of the fused decomposed attention (attend_fused, compiled like eager CPU
    decode runs it) at the embedded model's head shape, a full cache of S tokens."""
    from kivi_ops import KIVICache, KIVIConfig
    from kivi_ops.kernels.decomposed.attend import attend_fused

    rows = []
    for bits in (2, 3, 4):
        cache = KIVICache(KIVIConfig(bits, bits, 32, 128), num_layers=1, batch_size=1, max_seq_len=S, num_kv_heads=H,
                          head_dim=D)
        layer = cache.layers[0]
        gen = torch.Generator().manual_seed(bits)
        layer.append(torch.randn(1, H, S - 1, D, generator=gen), torch.randn(1, H, S - 1, D, generator=gen))
        t, p = layer.tensors(), layer.params
        q = torch.randn(1, Hq, 1, D, generator=gen)
        compiled = torch.compile(attend_fused, fullgraph=True, dynamic=False)
        sec = median_time(lambda: compiled(q, t, None, p, D**-0.5), repeats=20)
        rows.append(dict(bits=bits, tokens=S, kv_heads=H, q_heads=Hq, head_dim=D, cache_bytes=cache.nbytes(),
                         median_us=round(sec * 1e6, 1)))
    return rows


def triton_decode(arch: int = 90) -> list[dict]:
    """The decode kernel's steady-state loop at 2, 3, 4 bits (issue_model.model_row), D=128,
    Hq=32 on 8 kv heads, its default launch (1 warp x 32 tokens) and the no-spill one (4 x 16)."""
    from kivi_ops.kernels.triton.decode import attend_decode

    from .issue_model import model_row, token_bytes
    from .ptxas_usage import compile_instead_of_launch, layer_of

    rows = []
    for bits in (2, 3, 4):
        t, p = layer_of(kv_heads=8, head_dim=128, bits=bits, tokens=32768 + 256)
        q = torch.randn(1, 32, 1, 128, dtype=torch.float16)
        for warps, block_n in ((1, 32), (4, 16)):
            with compile_instead_of_launch(arch) as compiled:
                attend_decode(q, t, None, p, 0.088, num_splits=8, num_warps=warps, block_n=block_n)
            rows.append(dict(bits=bits, num_warps=warps, block_n=block_n,
                             **model_row(compiled[0][1], arch, block_n, 4, token_bytes(128, bits, 32))))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab three_bit_packing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-triton", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = dict(row_bytes=[row_bytes(D) for D in (64, 128, 256)])
    for r in result["row_bytes"]:
        print(r)
    result["cpu_unpack_scores"] = cpu_unpack()
    for r in result["cpu_unpack_scores"]:
        print(r)
    result["cpu_fused_attention"] = cpu_fused_attention()
    for r in result["cpu_fused_attention"]:
        print(r)
    if not args.skip_triton:
        result["triton_decode_sm90"] = triton_decode()
        for r in result["triton_decode_sm90"]:
            print({k: r[k] for k in ("bits", "num_warps", "block_n", "warp_instructions_per_token",
                                     "sm_cycles_per_token", "bandwidth_share_ceiling", "registers", "spill_bytes")})
    if args.json:
        meta = environment(command="python -m lab three_bit_packing" + (" --skip-triton" if args.skip_triton else ""))
        Path(args.json).write_text(json.dumps(dict(meta=meta, **result), indent=1) + "\n")


if __name__ == "__main__":
    main()
