"""Performance harness: memory accounting against the formula, the attention bench runs and writes results."""

import json

import pytest

from kivi_models.cli import main


def test_bench_memory_matches_formula_and_paper_ratios(tmp_path, capsys):
    assert main(["bench", "memory", "--contexts", "4096,32768", "--budget-gib", "16", "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["bits"], r["group_size"], r["residual_length"], r["tokens"]): r for r in result["rows"]}
    for r in result["rows"]:
        assert r["kivi_bytes"] == r["theory_bytes"]
        assert r["max_batch_kivi"] >= r["max_batch_fp16"]
    assert rows[(2, 32, 128, 4096)]["ratio"] == pytest.approx(4.57, abs=0.01)
    assert rows[(2, 32, 128, 32768)]["ratio"] == pytest.approx(5.22, abs=0.01)
    assert (2, 128, 32, 4096) not in rows  # R must be a multiple of G
    assert (tmp_path / "bench_memory.png").stat().st_size > 0


def test_bench_memory_counts_sink_and_outlier_pools(tmp_path, capsys):
    args = ["bench", "memory", "--contexts", "4096", "--out", str(tmp_path), "--json"]
    assert main(args) == 0
    plain = {(r["bits"], r["group_size"], r["residual_length"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main(args + ["--sink-tokens", "1", "--outlier-tokens", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for r in rows:
        assert r["kivi_bytes"] == r["theory_bytes"]
        # 30 layers with 1 + 3 + 32 slots, 2 with 1; 32 kv heads; key + value fp16 (2 * 128 * 2) + int64 position
        extra = (30 * 36 + 2 * 1) * 32 * (2 * 128 * 2 + 8)
        assert r["kivi_bytes"] - plain[(r["bits"], r["group_size"], r["residual_length"])]["kivi_bytes"] == extra
    with pytest.raises(SystemExit):
        main(args + ["--outlier-tokens", "-1"])


def test_bench_attention_cpu_runs(tmp_path, capsys):
    assert main(["bench", "attention", "--device", "cpu", "--contexts", "256", "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["bits"] for r in result["rows"]] == [2, 4]
    assert all(r["kivi_s"] > 0 and r["sdpa_s"] > 0 for r in result["rows"])
    assert result["environment"]["torch"] and (tmp_path / "bench_attention_cpu.json").exists()
