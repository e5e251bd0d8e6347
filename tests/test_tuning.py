"""kivi_ops/dispatch/tuning.py and the CUDA decode choice in dispatch.py, driven on CPU: fake kernels, a fake
timer and a faked capture / compile stand in for the GPU."""

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kivi_ops import dispatch
from kivi_ops.dispatch import tuning
from kivi_ops.dispatch import Choice
from kivi_ops.dispatch import implementations
from kivi_ops.kernels.cuda import loader
from kivi_ops.kernels.cuda.toolkit import CudaKernelUnavailable
from kivi_ops.layout import LayerTensors, QuantParams
from kivi_ops.kernels.reference.packing import packed_bytes
from kivi_ops.dispatch.tuning import Candidate, ShapeClass, Tuner

A, B, C = Candidate("triton_decode"), Candidate("triton_split"), Candidate("cuda_cpp", (("num_splits", 1),))
CLS = ShapeClass(256, 1024, 1, 128, 2, 2, "float16", False)


class FakeTimer:
    """seconds[label] per timed candidate; counts the timings."""

    def __init__(self, seconds):
        self.seconds, self.timed = seconds, []

    def __call__(self, fn):
        label = fn()  # the fake measure returns the candidate's label
        self.timed.append(label)
        return self.seconds[label]


def tuner(seconds, table=None, busy=lambda: False):
    timer = FakeTimer(seconds)
    return Tuner(table or {}, timer=timer, busy=busy, device_name=lambda: "Fake GPU"), timer


def label(c):
    return c.label()


# ---------------------------------------------------------------- shape classes and the table

def test_bucket_rounds_up_to_powers_of_two():
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025, 32768)] == [1, 1, 2, 4, 1024, 1024, 2048, 32768]


def test_shape_class_buckets_rows_and_context_only():
    cls = tuning.shape_class(batch=6, kv_heads=32, context=1000, query_heads=32, head_dim=128, k_bits=2, v_bits=2,
                             dtype=torch.float16, paged=False)
    assert cls == CLS  # 192 rows -> 256, 1000 tokens -> 1024
    gqa = tuning.shape_class(batch=8, kv_heads=8, context=32768, query_heads=32, head_dim=128, k_bits=4, v_bits=2,
                             dtype=torch.bfloat16, paged=True)
    assert gqa == ShapeClass(64, 32768, 4, 128, 4, 2, "bfloat16", True)


def test_committed_table_holds_the_h200_sweep():
    table = tuning.read_table()
    h200 = table["NVIDIA H200"]
    # what the 2026-11-27 sweep measured fastest (sweep_cuda_cpp.log at 1a0a8a9): one split at 1K,
    # the launcher's default split count at 32K, for MHA 32/32 and GQA 32/8 alike
    assert h200[CLS] == Candidate("cuda_cpp", (("num_splits", 1),))
    assert h200[CLS._replace(context=32768)] == Candidate("cuda_cpp")
    assert h200[ShapeClass(64, 1024, 4, 128, 2, 2, "float16", False)] == Candidate("cuda_cpp", (("num_splits", 1),))
    assert h200[ShapeClass(64, 32768, 4, 128, 2, 2, "float16", False)] == Candidate("cuda_cpp")
    assert len(h200) == 4  # nothing beyond what was measured


def test_table_of_another_format_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"format": 99, "devices": {}}')
    with pytest.raises(ValueError, match="tuning table format must be 1, got 99"):
        tuning.read_table(path)
    assert tuning.read_table(tmp_path / "none.json") == {}


# ---------------------------------------------------------------- the tuner

def test_autotune_times_each_candidate_once_picks_the_fastest_and_caches_it(caplog):
    t, timer = tuner({label(A): 3e-6, label(B): 2e-6, label(C): 5e-6})
    with caplog.at_level(logging.INFO, logger="kivi_ops.dispatch.tuning"):
        assert t.pick(CLS, [A, B, C], A, label) == B
        assert sorted(timer.timed) == sorted(map(label, (A, B, C)))
        for _ in range(3):
            assert t.pick(CLS, [A, B, C], A, label) == B
    assert len(timer.timed) == 3  # later calls of the class time nothing
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "triton_split, from autotuned" in logged[0] and "Fake GPU" in logged[0]
    # another class is tuned on its own
    assert t.pick(CLS._replace(context=2048), [A, C], A, label) == A
    assert len(timer.timed) == 5


def test_table_entry_is_used_without_timing_where_it_is_eligible():
    t, timer = tuner({label(A): 1e-6, label(B): 2e-6, label(C): 3e-6}, table={"Fake GPU": {CLS: C}})
    assert t.pick(CLS, [A, B, C], A, label) == C and timer.timed == []
    # another device's table entry does not apply
    t.device_name = lambda: "Other GPU"
    assert t.pick(CLS, [A, B, C], A, label) == A and len(timer.timed) == 3


def test_table_entry_that_is_not_eligible_here_is_autotuned():
    t, timer = tuner({label(A): 2e-6, label(B): 1e-6}, table={"Fake GPU": {CLS: C}})
    assert t.pick(CLS, [A, B], A, label) == B  # the C++ kernel cannot load in this process
    assert len(timer.timed) == 2


@pytest.mark.parametrize("why", ["capture", "compile", "export"])
def test_nothing_is_timed_while_capturing_or_tracing(monkeypatch, why):
    # the real check (tuning.tracing_or_capturing), its inputs faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: why == "capture")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: why == "compile")
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: why == "export")
    t, timer = tuner({label(A): 2e-6, label(B): 1e-6}, busy=tuning.tracing_or_capturing)
    assert t.pick(CLS, [A, B], A, label) == A  # the safe default
    assert timer.timed == [] and t.chosen == {}  # not remembered: tuned at the next eager call
    # the table still applies while busy
    t.table = {"Fake GPU": {CLS: B}}
    assert t.pick(CLS, [A, B], A, label) == B and timer.timed == []
    t.table = {}
    t.chosen.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: False)
    assert t.pick(CLS, [A, B], A, label) == B and len(timer.timed) == 2


def test_without_a_measure_the_default_runs_untimed():
    t, timer = tuner({label(A): 2e-6, label(B): 1e-6})
    assert t.pick(CLS, [A, B], A, None) == A and timer.timed == [] and t.chosen == {}


# ---------------------------------------------------------------- through dispatch.choose

def plain_layer(B=8, H=32, S=1024, D=128, R=128, G=32, dtype=torch.float16):
    """A KIVI-2 layer the CUDA C++ kernel supports (choose reads shapes, dtypes and None-ness only)."""
    W = min(R, S)
    shapes = [((B, H, S, packed_bytes(D, 2)), torch.uint8), ((B, H, S // G, D), dtype), ((B, H, S // G, D), dtype),
              ((B, H, W, D), dtype), ((B, H, S, packed_bytes(D, 2)), torch.uint8), ((B, H, S, D // G), dtype),
              ((B, H, S, D // G), dtype), ((B, H, W, D), dtype), ((B,), torch.int64)]
    return LayerTensors(*[torch.zeros(shape, dtype=dt) for shape, dt in shapes]), QuantParams(2, 2, G, R)


@pytest.fixture
def fake_gpu(monkeypatch):
    """dispatch with a fake tuner, the C++ kernel loadable, and fake kernels that log their launch."""
    t, timer = tuner({"triton_decode": 3e-6, "triton_split": 4e-6, "cuda_cpp": 2e-6, "cuda_cpp/num_splits=1": 1e-6,
                      "cuda_cpp/num_splits=16": 5e-6})
    monkeypatch.setattr(dispatch, "_tuner", t)
    monkeypatch.setattr(dispatch, "_cuda_decode", "auto")
    monkeypatch.setattr(dispatch, "_cuda_cpp_loads", True)
    monkeypatch.setattr(loader, "load", lambda: object())
    ran = []

    def fake(name):
        def kernel(query, layer, counts, params, scale, pages=None, **launch):
            ran.append(Candidate(name, tuple(sorted(launch.items()))).label())
            return ran[-1]
        return kernel, kernel

    for name in ("triton_decode", "triton_split", "cuda_cpp"):
        monkeypatch.setitem(implementations._TABLE["attend"], name, implementations.Forms(*fake(name)))
    return SimpleNamespace(tuner=t, timer=timer, ran=ran)


def cuda_query(layer, query_heads):
    """What tuned_attend reads of a query (device type and shape): the fake kernels ignore it."""
    B, _, _, D = layer.k_res.shape
    return SimpleNamespace(device=torch.device("cuda"), shape=(B, query_heads, 1, D))


def test_a_tuned_call_autotunes_then_runs_the_fastest_with_its_launch(fake_gpu):
    layer, params = plain_layer(S=4096)
    out = dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params, 0.1)
    assert out == "cuda_cpp/num_splits=1"
    assert sorted(fake_gpu.timer.timed) == sorted(["triton_decode", "triton_split", "cuda_cpp", "cuda_cpp/num_splits=1",
                                                   "cuda_cpp/num_splits=16"])
    fake_gpu.ran.clear()
    assert dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params, 0.1) == "cuda_cpp/num_splits=1"
    assert fake_gpu.ran == ["cuda_cpp/num_splits=1"] and len(fake_gpu.timer.timed) == 5  # cached
    assert list(fake_gpu.tuner.chosen) == [("Fake GPU", ShapeClass(256, 4096, 1, 128, 2, 2, "float16", False))]


def test_what_the_cpp_kernel_does_not_take_is_tuned_among_triton(fake_gpu):
    layer, params = plain_layer(S=2048)
    assert dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params._replace(k_bits=3), 0.1) == "triton_decode"
    assert sorted(fake_gpu.timer.timed) == ["triton_decode", "triton_split"]


def test_choose_times_nothing_and_marks_only_decode_calls_for_tuning(fake_gpu):
    """The layer's choice (traced or eager) is the Triton rule; a decode call is marked `tune`, so
    that the op runs the tuner's pick at run time, a prefill is not."""
    layer, params = plain_layer()
    for mode in ("compile", "export", "eager"):
        assert dispatch.choose("attend", device="cuda", mode=mode, q_len=1, layer=layer) == \
            Choice("triton_decode", in_op=True, tune=True)
    prefill = dispatch.choose("attend", device="cuda", mode="eager", q_len=4, layer=layer)
    assert prefill == Choice("triton_split", in_op=True, tune=False)
    assert fake_gpu.timer.timed == []


def test_override_triton_and_cuda_cpp_time_nothing(fake_gpu, monkeypatch):
    layer, params = plain_layer()
    monkeypatch.setattr(dispatch, "_cuda_decode", "triton")
    assert dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params, 0.1) == "triton_decode"
    monkeypatch.setattr(dispatch, "_cuda_decode", "cuda_cpp")
    assert dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params, 0.1) == "cuda_cpp"  # its default splits
    assert dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params._replace(v_bits=3), 0.1) == "triton_decode"
    assert fake_gpu.timer.timed == []


def test_table_entry_runs_through_dispatch(fake_gpu):
    layer, params = plain_layer(S=32768, H=8)  # the H200 sweep's GQA 32/8 at 32K
    fake_gpu.tuner.table = {"Fake GPU": tuning.read_table()["NVIDIA H200"]}
    assert dispatch.tuned_attend("triton_decode", cuda_query(layer, 32), layer, None, params, 0.1) == "cuda_cpp"
    assert fake_gpu.timer.timed == []


def test_paged_layers_take_their_row_capacity_as_context(fake_gpu):
    layer, params = plain_layer(S=64)  # a pool of pages: dim 2 is the page size, not a row's capacity
    choice = dispatch.tuned_choice("triton_decode", layer, params, 32, paged=True, context=8192,
                                   measure=lambda c: c.implementation)
    assert choice.implementation == "cuda_cpp"  # the C++ kernel has a paged form too
    (device, cls), = fake_gpu.tuner.chosen
    assert (cls.context, cls.paged) == (8192, True)


def test_unloadable_cpp_kernel_is_not_eligible_and_logged_once(monkeypatch, caplog):
    def refuse():
        raise CudaKernelUnavailable("no CUDA compiler")

    monkeypatch.setattr(loader, "load", refuse)
    monkeypatch.setattr(dispatch, "_cuda_cpp_loads", None)
    monkeypatch.setattr(dispatch, "_cuda_decode", "auto")
    layer, params = plain_layer()
    with caplog.at_level(logging.INFO, logger="kivi_ops.dispatch"):
        for _ in range(2):
            found = dispatch.decode_candidates(layer, params, 32, False, "triton_decode")
            assert [c.implementation for c in found] == ["triton_decode", "triton_split"]
    assert [r.getMessage() for r in caplog.records] == [
        "the CUDA C++ decode kernel is not eligible for autotuning in this process: no CUDA compiler"]


# ---------------------------------------------------------------- the setting

def test_bad_setting_is_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match=r"cuda decode must be one of \('auto', 'triton', 'cuda_cpp'\), got 'fast'"):
        dispatch.set_cuda_decode("fast")
    env = dict(os.environ, KIVI_CUDA_DECODE="fast")
    run = subprocess.run([sys.executable, "-c", "import kivi_ops"], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "the environment variable KIVI_CUDA_DECODE must be one of ('auto', 'triton', 'cuda_cpp'), got 'fast'" in run.stderr


def test_auto_can_be_set_back():
    previous = dispatch.set_cuda_decode("triton")
    try:
        assert dispatch.set_cuda_decode("auto") == "triton" and dispatch.current_cuda_decode() == "auto"
    finally:
        dispatch.set_cuda_decode(previous)


# ---------------------------------------------------------------- lab/gpu_tune.py

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_gpu_tune_refuses_on_cpu(tmp_path):
    from lab.gpu_tune import main

    with pytest.raises(SystemExit, match=r"gpu_tune: needs a CUDA GPU \(torch.cuda.is_available\(\) is False\)"):
        main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_gpu_tune_keeps_what_it_did_not_measure():
    from lab.gpu_tune import merged_table, shapes

    measured = [dict(ShapeClass(256, 1024, 1, 128, 2, 2, "float16", False)._asdict(), implementation="triton_decode",
                     launch={}, us={"triton_decode": 1.0})]
    table = merged_table("NVIDIA H200", {"command": "test"}, measured)
    h200 = {tuning.entry_key(e): tuning.entry_choice(e) for e in table["devices"]["NVIDIA H200"]["entries"]}
    assert h200[CLS] == Candidate("triton_decode")  # measured now: replaces the seed's entry
    assert h200[CLS._replace(context=32768)] == Candidate("cuda_cpp")  # not measured now: kept
    assert len(h200) == 4
    # bounded: the classes serving and the benchmarks use, the seed's four among them
    all_shapes = list(shapes())
    assert len(all_shapes) == 30
    assert {(8, 1024, 32, 32, 128, False), (8, 32768, 32, 8, 128, False)} <= set(all_shapes)


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
def test_gpu_tune_measures_every_eligible_kernel_of_a_class(fake_gpu, paged):
    # its cache building, candidates and entry, on CPU with the fake kernels (graph_us: one call)
    from lab.gpu_tune import PAGE_SIZE, measure

    timed = {"triton_decode": 3.0, "triton_split": 4.0, "cuda_cpp": 2.0, "cuda_cpp/num_splits=1": 2.5,
             "cuda_cpp/num_splits=16": 5.0}
    entry = measure(1, 2 * PAGE_SIZE, 4, 2, 64, paged, lambda fn: timed[fn()], device="cpu")
    assert tuning.entry_key(entry) == ShapeClass(2, 256, 2, 64, 2, 2, "float16", paged)
    assert entry["us"] == timed  # static and paged alike: the C++ kernel has both forms
    assert (entry["implementation"], entry["launch"]) == ("cuda_cpp", {})
