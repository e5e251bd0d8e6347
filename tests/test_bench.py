"""Performance harness: memory accounting against the formula, the attention bench runs and writes results."""

import json

import pytest
import torch

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
    for r in result["rows"]:  # every layer is full attention: the cache's bits over its K and V elements
        assert r["bits_per_element"] == pytest.approx(8 * r["kivi_bytes"] / (2 * 32 * 32 * r["tokens"] * 128))
    assert 2 < rows[(2, 32, 128, 32768)]["bits_per_element"] < rows[(2, 32, 128, 4096)]["bits_per_element"] < 4


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


@pytest.mark.slow  # `make test` keeps the serve bench's CLI; each bench is a run of its own
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
    from kivi_ops import KIVIConfig

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
    assert row["kivi_bits_per_element"] == perf.cache_bits_per_element(model, "kivi", KIVIConfig(), context + new)
    assert row["bits_per_element_tokens"] == context + new


def test_bench_decode_json_reports_the_bits_per_element_kivi_eval_does(tmp_path, monkeypatch, capsys):
    # `kivi bench decode --json` rows: the KIVI cache's bits per element at the length it holds
    # (context + new tokens), as `kivi eval ppl --json` reports them at that window. The decode
    # timing itself (compiled, tens of seconds) is stubbed; the eval runs for real on a tiny GGUF.
    from gguf_files import write_tiny_llama_gguf
    from kivi_benchmarks import perf

    monkeypatch.setenv("KIVI_MODEL_CACHE", str(tmp_path / "model-cache"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf)
    monkeypatch.setattr(perf, "measure_decode", lambda *a, **k: dict(tokens_per_s=1.0, median_step_tokens_per_s=1.0,
                                                                      cache_bytes=1))
    assert main(["bench", "decode", "--model", str(gguf), "--device", "cpu", "--contexts", "192", "--batches", "1",
                 "--new-tokens", "32", "--out", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["bits_per_element_tokens"] == 224  # the tiny GGUF has 256 positions
    assert main(["eval", "ppl", "--model", str(gguf), "--corpus", "pydoc", "--window", "224", "--max-tokens", "224",
                 "--chunk", "224", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["bits_per_element_tokens"] == 224 and evaluated["method"] == "kivi"
    assert row["kivi_bits_per_element"] == evaluated["bits_per_element"] < 16


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


@pytest.mark.slow  # four caches, 4 s each, and their compiles; test_bench_serve_takes_a_gguf_model is in `make test`
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
    assert result["bits_per_element_tokens"] == 256 and 2 < result["kivi_bits_per_element"] < 16
    assert by["fp-paged"]["rows"] > by["fp"]["rows"]  # and more paged rows: short requests take few pages
    for r in by.values():
        assert r["cache_bytes"] <= 0.02 * 2**30 and r["generated_tokens"] > 0 and r["peak_held"] <= r["rows"]
    assert by["fp-paged"]["peak_pages_used"] <= by["fp-paged"]["pages"]
    assert (tmp_path / "bench_serve_cpu.png").is_file()
    # A loaded machine may spend a slow cache's 4 s on prefills alone (each gives the first token).
    assert any(r["whole"]["decode_calls"] > 0 for r in by.values())
    for r in by.values():  # the windows: inside the run, the counts of the later ones within the earlier ones
        whole, after, steady = r["whole"], r["after_fill"], r["steady"]
        assert whole["output_tokens"] == r["generated_tokens"] and whole["seconds"] == pytest.approx(r["seconds"])
        assert whole["total_tokens_per_s"] > whole["output_tokens_per_s"] > 0
        assert 0 < whole["decode_s"] + whole["prefill_s"] <= whole["seconds"] + 1e-6
        assert whole["prefill_calls"] >= 1
        if whole["decode_calls"] == 0:  # a loaded machine (above): no request has two text events
            assert whole["itl_p50_s"] is None
        elif whole["itl_p50_s"] is not None:  # (a decoded token may add no text: an EOS, part of a character)
            assert whole["itl_p50_s"] <= whole["itl_p99_s"]
        assert 0 < whole["engine_cpu_share"] <= 1.05  # the engine thread's CPU clock over the wall clock
        assert 0 <= r["fill_done_s"] < r["seconds"] and 1 <= r["largest_batch"] <= r["rows"]
        assert after["seconds"] == pytest.approx(r["seconds"] - r["fill_done_s"])
        assert after["output_tokens"] <= whole["output_tokens"] and after["peak_held"] <= r["rows"]
        assert r["warmup_completions"] == r["largest_batch"]  # one turnover by default
        if whole["requests_done"] < r["warmup_completions"]:
            assert steady is None and r["steady_from_s"] is None
        else:
            assert r["fill_done_s"] <= r["steady_from_s"] < r["seconds"]
            assert steady["output_tokens"] <= after["output_tokens"] and len(r["steady_halves_output_tokens_per_s"]) == 2
    assert result["steady_fill"] == 0.9 and result["warmup_turnover"] == 1.0
    from kivi_benchmarks.serve_bench import serve_markdown

    table = serve_markdown(result)
    assert "Steady state" in table and "After the fill" in table and "Whole run" in table
    assert table.count("| fp-paged |") == 3
    for bad in (["--steady-fill", "0"], ["--steady-fill", "1.5"]):
        with pytest.raises(SystemExit):
            main(["bench", "serve", *bad, "--out", str(tmp_path)])


@pytest.mark.slow  # a cold Inductor build of the compiled cache's step
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


def test_hf_generate_bench_rows_at_each_thread_count_say_which():
    # --threads 1,2: every point is measured at each count, each row records its count, and torch's
    # own count is restored afterwards (the next bench or test must not inherit 1).
    from kivi_benchmarks.hf_generate_bench import bench_hf_generate

    def byte_tokenizer(text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 64 for c in text]}

    before = torch.get_num_threads()
    partials = []  # on_row: the result so far after each row, so that a run cut off keeps its rows
    result = bench_hf_generate(tiny_llama(), byte_tokenizer, contexts=[24], batches=[1], new_tokens=6,
                               caches=["dynamic", "kivi_eager"], threads=[1, 2], on_row=partials.append)
    assert torch.get_num_threads() == before and result["threads"] == [1, 2]
    assert [(r["batch"], r["threads"]) for r in result["rows"]] == [(1, 1), (1, 2)]
    assert [len(p["rows"]) for p in partials] == [1, 2] and not any(p["complete"] for p in partials)
    assert result["complete"] and partials[-1]["rows"] == result["rows"]
    assert all(r["kivi_eager"]["tokens"] == r["dynamic"]["tokens"] for r in result["rows"])
    with pytest.raises(ValueError, match="threads must be a list of positive ints"):
        bench_hf_generate(tiny_llama(), byte_tokenizer, contexts=[24], batches=[1], caches=["dynamic"], threads=[0])


@pytest.mark.parametrize("bad", ["0,2", "x", ","])
def test_hf_generate_bench_bad_threads_is_a_usage_error(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "hf-generate", "--threads", bad, "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--threads: must be positive integers" in capsys.readouterr().err


def test_hf_generate_cli_keeps_rows_beside_an_earlier_result_until_the_run_ends(tmp_path, monkeypatch, capsys):
    # A run cut off after a row leaves its rows in bench_hf_generate_cpu.partial.json and the earlier
    # complete result untouched; a finished run writes the result and removes the partial file.
    import kivi_benchmarks.hf_generate_bench as bench
    import kivi_models

    earlier = tmp_path / "bench_hf_generate_cpu.json"
    earlier.write_text('{"complete": true, "rows": ["earlier"]}')
    monkeypatch.setattr(kivi_models, "load_model", lambda **kwargs: (None, None))
    monkeypatch.setattr(bench, "plot_hf_generate", lambda result, path: None)
    monkeypatch.setattr(bench, "print_hf_generate", lambda result: None)

    def cut_off(model, tokenizer, *, on_row, **kwargs):
        on_row(dict(rows=["row 1"], complete=False))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "bench_hf_generate", cut_off)
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "hf-generate", "--out", str(tmp_path)])
    partial = tmp_path / "bench_hf_generate_cpu.partial.json"
    assert json.loads(partial.read_text())["rows"] == ["row 1"]
    assert json.loads(earlier.read_text())["rows"] == ["earlier"]

    def finishes(model, tokenizer, *, on_row, **kwargs):
        on_row(dict(rows=["row 1"], complete=False))
        return dict(rows=["row 1", "row 2"], complete=True)

    monkeypatch.setattr(bench, "bench_hf_generate", finishes)
    main(["bench", "hf-generate", "--out", str(tmp_path)])
    assert json.loads(earlier.read_text())["rows"] == ["row 1", "row 2"] and not partial.exists()


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


def test_serve_percentile_is_linear_between_ranks():
    from kivi_benchmarks.serve_bench import percentile

    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input; between the 2nd and 3rd
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)  # numpy.percentile(range(1, 101), 99)
    assert percentile([1, 2, 3], 0) == 1 and percentile([1, 2, 3], 100) == 3
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_serve_steady_window_starts_after_the_fill_and_one_turnover():
    from kivi_benchmarks.serve_bench import fill_done, steady_start

    # A server that admits 10 requests, prefills them one at a time (t 0-10), then decodes them
    # (decode steps of 10, 9, 10 ... rows); one decode step of 2 rows ran before the fill.
    phases = [("prefill", 0, 1, 2), ("decode", 1, 1.5, 2), ("prefill", 1.5, 10, 8)]
    phases += [("decode", 10 + i, 11 + i, 9 if i % 2 else 10) for i in range(20)]
    assert fill_done(phases, [], 1.0) == (10, 10)
    assert fill_done(phases, [], 0.9) == (10, 10)  # ceil(9) rows: the 2-row step does not count
    assert fill_done(phases, [], 0.2) == (1, 10)  # ceil(2) rows
    # Held samples (t, held) count rows admitted before their prefill: without phases they say so.
    assert fill_done([], [(0, 0), (0.5, 10), (20, 9)], 0.9) == (0.5, 10)
    assert fill_done([], [(0, 0)], 0.9) == (None, 0)
    done = [12, 14, 15, 17, 18, 20, 21, 23, 24, 25, 27]
    assert steady_start(phases, [], done, fill=0.9, turnover=0) == 10  # the fill alone
    assert steady_start(phases, [], done, fill=0.9, turnover=1.0) == 25  # the 10th completion
    assert steady_start(phases, [], done, fill=0.9, turnover=0.5) == 18  # the 5th
    assert steady_start(phases, [], done[:9], fill=0.9, turnover=1.0) is None  # 9 of 10: no steady window
    assert steady_start(phases, [], [1, 2, 3], fill=0.9, turnover=0.1) == 10  # never before the fill
    with pytest.raises(ValueError):
        fill_done(phases, [], 0)
    with pytest.raises(ValueError):
        steady_start(phases, [], done, turnover=-1)


def test_serve_window_metrics_count_only_the_window():
    from kivi_benchmarks.serve_bench import window_metrics

    def req(sub, first, done, prompt, out, chunks):
        return dict(submitted_s=sub, first_token_s=first, done_s=done, prompt_tokens=prompt, output_tokens=out,
                    chunk_s=chunks)

    requests = [
        req(0.0, 1.0, 5.0, 10, 5, [1.0, 2.0, 3.0, 4.0, 5.0]),  # first token before the window: TPOT not counted
        req(0.0, 11.0, 15.0, 20, 3, [11.0, 13.0, 15.0]),  # inside: TTFT 11, TPOT 2
        req(12.0, 13.0, 19.0, 30, 4, [13.0, 15.0, 17.0, 19.0]),  # inside: TTFT 1, TPOT 2
        req(14.0, 16.0, None, 40, 2, [16.0, 18.0]),  # cancelled at the end: no completion, its prefill counts
        req(19.0, None, None, 50, 0, []),  # no token: not in TTFT
    ]
    # (t, held, pages, generated so far, preemptions so far)
    samples = [(0.0, 0, 0, 0, 0), (4.0, 1, 3, 4, 0), (10.0, 2, 5, 5, 1), (15.0, 2, 6, 9, 1), (20.0, 1, 4, 14, 3)]
    phases = [("prefill", 0.5, 1.0, 1), ("decode", 1.0, 5.0, 1), ("prefill", 10.0, 11.0, 1), ("decode", 11.0, 12.0, 1),
              ("prefill", 12.0, 13.0, 1), ("decode", 13.0, 20.0, 2)]
    m = window_metrics(requests, samples, phases, 10.0, 20.0)
    assert m["seconds"] == 10.0
    assert m["output_tokens"] == 14 - 5 and m["output_tokens_per_s"] == pytest.approx(0.9)
    assert m["requests_done"] == 2 and m["requests_per_s"] == pytest.approx(0.2)
    assert m["prompt_tokens"] == 20 + 30 + 40  # first token at 11, 13, 16
    assert m["total_tokens_per_s"] == pytest.approx((9 + 90) / 10)
    assert m["ttft_p50_s"] == pytest.approx(2.0)  # of [11, 1, 2]
    assert m["tpot_p50_s"] == pytest.approx(2.0) and m["tpot_p99_s"] == pytest.approx(2.0)
    assert m["itl_p50_s"] == pytest.approx(2.0)  # 2 s gaps only; request 1's 1 s gaps are outside
    assert m["preemptions"] == 2 and m["peak_held"] == 2 and m["peak_pages_used"] == 6
    assert m["prefill_s"] == pytest.approx(2.0) and m["prefill_calls"] == 2
    assert m["decode_s"] == pytest.approx(8.0) and m["decode_calls"] == 2
    assert m["prefill_s_per_prompt"] == pytest.approx(2.0 / 3) and m["decode_s_per_step"] == pytest.approx(4.0)
    assert "engine_cpu_share" not in m  # no CPU clock in these samples
    cpu = [(*s, 0.5 * s[0]) for s in samples]  # the engine got half a core throughout
    m = window_metrics(requests, cpu, phases, 10.0, 20.0)
    assert m["engine_cpu_s"] == pytest.approx(5.0) and m["engine_cpu_share"] == pytest.approx(0.5)
    assert m["output_tokens_per_engine_cpu_s"] == pytest.approx(9 / 5)
    whole = window_metrics(requests, samples, phases, 0.0, 20.0)
    assert whole["output_tokens"] == 14 and whole["requests_done"] == 3
    assert whole["tpot_p50_s"] == pytest.approx(2.0)  # of [1, 2, 2]
    assert whole["prefill_s"] == pytest.approx(2.5) and whole["decode_s"] == pytest.approx(12.0)
    with pytest.raises(ValueError):
        window_metrics(requests, samples, phases, 5.0, 5.0)


# `kivi bench serve --model ... --device cuda`: the GPU suite's serve stage (lab/gpu_suite.sh on
# the gpusuite branch), word for word; it must parse here before a GPU minute is spent on it.
GPU_SUITE_SERVE = ["bench", "serve", "--device", "cuda", "--model", "llama2-7b-shape", "--caches", "fp-paged,kivi-paged",
                   "--compile", "--budget-gib", "20", "--max-seq-len", "2048", "--duration", "30", "--requests", "2000",
                   "--out", "/tmp/gpu_results", "--json"]


def test_bench_serve_parses_the_gpu_suites_command():
    from kivi_cli.main import build_parser

    args = build_parser().parse_args(GPU_SUITE_SERVE)
    assert (args.bench_command, args.device, args.model, args.caches) == ("serve", "cuda", "llama2-7b-shape",
                                                                          ["fp-paged", "kivi-paged"])
    assert args.compile and args.json and (args.budget_gib, args.max_seq_len, args.duration, args.requests) == (
        20.0, 2048, 30.0, 2000)
    assert build_parser().parse_args(["bench", "serve"]).model == "default"


@pytest.mark.parametrize("argv, flag", [
    (["--caches", "fp,bf16"], "--caches"), (["--budget-gib", "0"], "--budget-gib"), (["--device", "tpu"], "--device"),
    (["--max-seq-len", "-1"], "--max-seq-len"), (["--duration", "x"], "--duration"),
])
def test_bench_serve_bad_values_are_usage_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", *argv])
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def _no_model(*args, **kwargs):
    raise AssertionError("a model was built before the refusal")


def test_bench_serve_refuses_cuda_and_the_7b_shape_on_a_cpu_host(monkeypatch, capsys):
    import torch

    from kivi_cli import bench as bench_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_cli, "_bench_model", _no_model)
    with pytest.raises(SystemExit) as exc:
        main(GPU_SUITE_SERVE)
    assert exc.value.code == 2 and "--device cuda was requested but no CUDA device is available" in capsys.readouterr().err
    # 27 GB of float32 random weights: only an explicit --device cpu builds them (here: _no_model)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--model", "llama2-7b-shape"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--model llama2-7b-shape" in err and "--device cpu" in err
    with pytest.raises(AssertionError, match="before the refusal"):
        main(["bench", "serve", "--model", "llama2-7b-shape", "--device", "cpu"])


def test_the_7b_shape_takes_every_id_of_the_default_tokenizer():
    # On the meta device (no bytes): Llama-2-7B's layers, the default tokenizer's vocabulary, so
    # that every prompt id of the served stream has an embedding row.
    import argparse

    from kivi_cli.bench import _bench_model

    model, tokenizer = _bench_model(argparse.Namespace(model="llama2-7b-shape"), "meta", None, with_tokenizer=True)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (32, 4096, 32, 32)
    assert c.vocab_size == len(tokenizer) > 32000
    assert _bench_model(argparse.Namespace(model="llama2-7b-shape"), "meta", None)[1] is None  # decode: no tokenizer


def test_bench_serve_takes_a_gguf_model(tmp_path, monkeypatch):
    # A tiny GGUF Llama reaches the engine: two caches, one second each; the result names the model.
    from gguf_files import write_tiny_llama_gguf

    monkeypatch.setenv("KIVI_MODEL_CACHE", str(tmp_path / "model-cache"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf)
    assert main(["bench", "serve", "--model", str(gguf), "--caches", "fp,fp-paged", "--requests", "20",
                 "--budget-gib", "0.002", "--max-seq-len", "256", "--length-scale", "0.2", "--duration", "1",
                 "--threads", "1", "--out", str(tmp_path), "--json"]) == 0
    result = json.loads((tmp_path / "bench_serve_cpu.json").read_text())
    assert result["model"] == str(gguf) and result["device"] == "cpu"
    shape = dict(result["model_shape"])
    assert shape.pop("parameters") > 0 and shape == dict(layers=2, hidden_size=64, heads=4, kv_heads=2,
                                                          vocab_size=262, dtype="torch.float32")
    by = {r["cache"]: r for r in result["rows"]}
    assert by.keys() == {"fp", "fp-paged"} and all(r["generated_tokens"] > 0 for r in by.values())
    ratio = result["ratios"]["fp-paged_over_fp"]
    assert ratio["requests_per_s"] == pytest.approx(
        by["fp-paged"]["whole"]["requests_per_s"] / max(by["fp"]["whole"]["requests_per_s"], 1e-9))
