"""Performance harness: memory accounting against the formula, the attention bench runs and writes results."""

import json

import pytest

import tiny_models
from kivi_cli.main import main


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


def test_bench_memory_counts_the_sparse_outlier_store(tmp_path, capsys):
    args = ["bench", "memory", "--contexts", "4096", "--out", str(tmp_path), "--json"]
    assert main(args) == 0
    plain = {(r["bits"], r["group_size"], r["residual_length"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main(args + ["--sparse-outliers", "0.01"]) == 0
    for r in json.loads(capsys.readouterr().out)["rows"]:
        assert r["kivi_bytes"] == r["theory_bytes"]
        # 1% of R and of head_dim 128 rounds to 1 entry per key channel per window / per value token:
        # fp16 value + int16 index each, 32 layers x 32 kv heads.
        entries = 4096 // r["residual_length"] * 128 + 4096
        extra = 32 * 32 * entries * (2 + 2)
        assert r["kivi_bytes"] - plain[(r["bits"], r["group_size"], r["residual_length"])]["kivi_bytes"] == extra


def test_bench_attention_cpu_runs(tmp_path, capsys):
    assert main(["bench", "attention", "--device", "cpu", "--contexts", "256", "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["bits"] for r in result["rows"]] == [2, 4]
    assert all(r["kivi_s"] > 0 and r["sdpa_s"] > 0 for r in result["rows"])
    assert result["environment"]["torch"] and (tmp_path / "bench_attention_cpu.json").exists()


def tiny_llama():
    return tiny_models.tiny_llama(hidden_size=64, intermediate_size=128, max_position_embeddings=1024)


def tiny_patched_llama():
    from kivi_models import patch_model

    return patch_model(tiny_llama())


def test_budget_batches_follow_exact_cache_bytes():
    from kivi_benchmarks.perf import cache_bytes_per_sequence, max_batch_for_budget
    from kivi_ops import KIVIConfig, fp16_cache_nbytes

    model = tiny_patched_llama()  # fp32: 2 layers, 2 kv heads, head_dim 16
    fp = cache_bytes_per_sequence(model, method="fp", tokens=512)
    assert fp == 2 * fp16_cache_nbytes(num_layers=2, batch_size=1, num_tokens=512, num_kv_heads=2, head_dim=16)
    kivi = cache_bytes_per_sequence(model, method="kivi", tokens=512, kivi_config=KIVIConfig())
    assert kivi < fp
    assert max_batch_for_budget(fp, 10 * fp + 1) == 10 and max_batch_for_budget(fp, fp - 1) == 0


@pytest.mark.slow  # a minute on 2 busy cores: 3 caches x prefill + compiled decode
def test_bench_budget_runs_each_cache_at_its_largest_batch(monkeypatch):
    from kivi_benchmarks import perf

    model = tiny_patched_llama()
    context, new = 256, 6
    fp_seq = perf.cache_bytes_per_sequence(model, method="fp", tokens=context + new)
    kivi_seq = perf.cache_bytes_per_sequence(model, method="kivi", tokens=context + new)
    budget = 3 * fp_seq + 1  # 3 fp sequences; KIVI fits more
    result = perf.bench_budget(model, device="cpu", contexts=[context], budget_bytes=budget, new_tokens=new)
    (row,) = result["rows"]
    assert row["fp_batch"] == 3 and row["kivi_batch"] == budget // kivi_seq > 3
    assert row["kivi_cache_bytes"] <= budget and row["fp_cache_bytes"] <= budget
    assert row["fp_timed_steps"] == new - 3 and row["kivi_median_step_tokens_per_s"] > 0
    assert row["batch_ratio"] == row["kivi_batch"] / 3


def test_bench_budget_refuses_a_budget_below_one_sequence():
    from kivi_benchmarks import perf

    with pytest.raises(ValueError, match="raise --budget-gib"):
        perf.bench_budget(tiny_patched_llama(), device="cpu", contexts=[128], budget_bytes=1000, new_tokens=4)


def test_results_default_to_the_current_directory(tmp_path, monkeypatch, capsys):
    # Not into the package's benchmarks/results (tracked files in an editable install).
    from kivi_benchmarks import RESULTS_DIR

    before = {p: p.stat().st_mtime_ns for p in RESULTS_DIR.iterdir()}
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "memory", "--contexts", "4096"]) == 0
    assert (tmp_path / "kivi-results" / "bench_memory.json").is_file()
    assert str(tmp_path / "kivi-results" / "bench_memory.json") in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in RESULTS_DIR.iterdir()} == before


def test_bench_serve_runs_the_caches_at_one_budget(tmp_path):
    # A few seconds per cache: static fp, paged fp and static KIVI (paged KIVI where built), the
    # same stream of short chat-like requests, the same bytes.
    assert main(["bench", "serve", "--requests", "40", "--budget-gib", "0.02", "--max-seq-len", "256",
                 "--length-scale", "0.2", "--residual-length", "32", "--duration", "4", "--out", str(tmp_path),
                 "--json"]) == 0
    result = json.loads((tmp_path / "bench_serve_cpu.json").read_text())
    by = {r["cache"]: r for r in result["rows"]}
    assert {"fp", "fp-paged", "kivi"} <= by.keys() and by.keys() | result["skipped"].keys() == {
        "fp", "fp-paged", "kivi", "kivi-paged"}
    assert by["kivi"]["rows"] > by["fp"]["rows"] >= 1  # the same bytes hold more KIVI rows
    assert by["fp-paged"]["rows"] > by["fp"]["rows"]  # and more paged rows: short requests take few pages
    for r in by.values():
        assert r["cache_bytes"] <= 0.02 * 2**30 and r["generated_tokens"] > 0 and r["peak_held"] <= r["rows"]
    assert by["fp-paged"]["peak_pages_used"] <= by["fp-paged"]["pages"]
    assert (tmp_path / "bench_serve_cpu.png").is_file()


def test_hf_generate_bench_times_every_cache_through_model_generate():
    # A tiny random Llama and a byte tokenizer: every cache's row is filled, and with R=128 above
    # the context the KIVI cache holds every token exact, so its greedy tokens equal DynamicCache's.
    from kivi_benchmarks.hf_generate_bench import bench_hf_generate

    plain = tiny_llama()

    def byte_tokenizer(text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 64 for c in text]}

    result = bench_hf_generate(plain, byte_tokenizer, contexts=[24], batches=[2], new_tokens=6,
                               caches=["dynamic", "kivi_eager", "kivi"], rounds=2)
    (row,) = result["rows"]
    assert result["caches"] == ["dynamic", "kivi_eager", "kivi"]
    assert row["context"] == 24 and row["batch"] == 2
    for cache in result["caches"]:
        assert row[cache]["tokens_per_s"] > 0 and row[cache]["timed_steps"] == 6 - 1 - 3
    assert row["kivi"]["tokens"] == row["kivi_eager"]["tokens"] == row["dynamic"]["tokens"]
    assert row["dynamic"]["vs_dynamic"] == 1.0
    for cache in result["caches"]:  # two rounds: the reported run is the faster one
        assert len(row[cache]["rounds_tokens_per_s"]) == 2
        assert row[cache]["tokens_per_s"] == max(row[cache]["rounds_tokens_per_s"])


def test_bench_memory_serving_table_holds_the_issues_numbers(tmp_path):
    # Exact bytes, 40 GiB: KIVI-2 static rows of 4K / 8K hold 91 / 49 Llama-2-7B sequences, paged
    # fp16 about 160 chat sequences; paged KIVI-2 (where built) holds more than paged fp16.
    from benchmarks.paged_memory import bench_paged_memory

    result = bench_paged_memory(40, chat_samples=2000)
    held = {(r["shape"], r["workload"], r["cache"]): r["sequences"] for r in result["rows"]}
    assert held[("llama2-7b", "chat", "KIVI-2 static 4K rows")] == 91
    assert held[("llama2-7b", "chat", "KIVI-2 static 8K rows")] == 49
    assert 150 <= held[("llama2-7b", "chat", "fp16 paged")] <= 175
    assert held[("llama2-7b", 2048, "fp16 paged")] == 39  # 2048 tokens x 512 KiB + the block-table row
    assert held[("llama2-7b", 8192, "fp16 static 4K rows")] is None  # a 4K row cannot hold 8K tokens
    assert held[("llama3-8b", 2048, "fp16 paged")] == 159  # 8 KV heads: 4x the 7B shape's
    if result["paged_kivi"] == "exact":
        assert held[("llama2-7b", "chat", "KIVI-2 paged")] > 2 * held[("llama2-7b", "chat", "fp16 paged")]
        # Paging the window saves the exact tokens a short sequence does not hold: 2R - (L mod R) -
        # min(L, R) per sequence, so more chat sequences, and at 8K (L mod R = 0: R keys fewer) a few.
        # A 2048- or 8192-token sequence keeps min(L, R) = R values and 0 keys exact: exactly the
        # key buffer less, 128 tokens x 256 KiB (32 layers x 32 heads x 128 x 2 bytes) = 32 MiB.
        from benchmarks.paged_memory import WINDOW_PAGED
        bytes_of = {(r["workload"], r["cache"]): r["bytes_per_seq"] for r in result["rows"] if r["shape"] == "llama2-7b"}
        assert held[("llama2-7b", "chat", WINDOW_PAGED)] > held[("llama2-7b", "chat", "KIVI-2 paged")]
        for n in (2048, 8192):
            assert bytes_of[(n, "KIVI-2 paged")] - bytes_of[(n, WINDOW_PAGED)] == 128 * 256 * 1024
    assert main(["bench", "memory", "--contexts", "4096", "--out", str(tmp_path)]) == 0
    assert "| llama3-8b | chat | fp16 paged |" in (tmp_path / "bench_memory_serving.md").read_text()
