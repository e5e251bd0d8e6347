"""The static issue model (lab/issue_model.py) counts the sm_90 SASS of the decode attention
kernels' steady-state loop, with no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.issue_model import first_loop, pipe_of, token_bytes

ROOT = Path(__file__).resolve().parent.parent  # `import lab` from the repository root


def test_token_bytes_of_kivi2_g32_d128():
    # 2 x 32 bytes of codes, 4 value groups x (scale + zero) x 2 bytes, 128 key channels x 4 bytes / 32 tokens
    assert token_bytes(128, 2, 32) == 64 + 16 + 16


def test_pipes_and_the_first_loop():
    assert [pipe_of(op) for op in ("FFMA", "HMMA.16816.F32", "I2F.F16", "LOP3.LUT", "LDS.U8", "SHFL.BFLY")] == [
        "fp32", "tensor", "xu", "int", "lsu", "shfl"]
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   FFMA R2, R2, R3, R4 ;
        /*0020*/              @!P0 LOP3.LUT R5, R5, 0x3, RZ, 0xc0, !PT ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   EXIT ;
    """
    assert first_loop(sass) == ["FFMA", "LOP3.LUT", "BRA"]
    with pytest.raises(ValueError, match="no loop"):
        first_loop("        /*0000*/                   EXIT ;")


MODEL_CASE = """
import json, torch
from lab.issue_model import model_row, token_bytes
from lab.ptxas_usage import compile_instead_of_launch, layer_of
from kivi_ops.kernels.triton.decode import attend_decode
from lab.triton_decode_mma import attend_decode_mma
t, p = layer_of(kv_heads=2, head_dim=64, bits=2, tokens=1024)
q = torch.randn(1, 8, 1, 64, dtype=torch.float16)
rows = {}
for name, launch, tokens, programs in (
        ("decode", lambda: attend_decode(q, t, None, p, 0.125, num_splits=2, num_warps=4, block_n=16), 16, 4),
        ("mma", lambda: attend_decode_mma(q, t, None, p, 0.125, num_splits=2), 32, 1)):
    with compile_instead_of_launch(90) as compiled:
        launch()
    rows[name] = model_row(compiled[0][1], 90, tokens, programs, token_bytes(64, 2, 32))
print(json.dumps(rows))
"""


@pytest.mark.slow  # a Triton compile to SASS for sm_90 (no GPU needed), about 10 s
def test_issue_model_counts_the_decode_loops_for_sm90():
    # A fresh process without TRITON_INTERPRET (interpreted kernels are never compiled).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", MODEL_CASE], capture_output=True, text=True, env=env, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    decode, mma = rows["decode"], rows["mma"]
    assert "tensor" not in decode["by_pipe"]  # per-element fp32 products
    assert mma["by_pipe"]["tensor"] > 0  # the tensor-core candidate's loop runs HMMA
    for row in (decode, mma):
        assert row["warp_instructions_per_token"] == pytest.approx(sum(row["by_pipe"].values()), abs=0.5)
        assert row["sm_cycles_per_token"] >= row["warp_instructions_per_token"] / 4  # at most 4 issued per cycle
        assert 0 < row["bandwidth_share_ceiling"] <= 1 and row["spill_bytes"] == 0
    # GQA 4:1: the decode kernel's 4 programs per kv head each issue the loop; the candidate's one
    assert mma["warp_instructions_per_token"] < decode["warp_instructions_per_token"]
