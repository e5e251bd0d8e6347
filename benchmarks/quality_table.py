"""`kivi eval table`: the KIVI quality tables (Tables 1, 3, 5 style) on the embedded model or --model.

Writes <out>/quality.json (every number plus environment and command), quality.md (the tables:
perplexity, passkey, and each cache's exact bytes against fp16 at 4K and 32K tokens) and two PNG
plots (perplexity per configuration; passkey accuracy vs length).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from kivi_models.corpus import load_text, token_windows
from kivi_ops import KIVIConfig

from .environment import environment
from .passkey import passkey_accuracy
from .perplexity import FakeQuantConfig, cache_bits_per_element, cache_perplexity, fake_quant_perplexity


@dataclass(frozen=True)
class Row:
    name: str
    group: str  # "baseline" | "fake" | "kivi" | "group size" | "residual" | "ott / sink" | "kvquant" | "rotation"
    #             | "per-token / fp8" (the fake-quantization baselines) | "preset" (--preset NAME)
    method: str  # "fp" | "kivi" | "fake"
    kivi: Optional[KIVIConfig] = None
    fake: Optional[FakeQuantConfig] = None
    levels_file: Optional[str] = None  # where kivi's nuq levels come from (recorded instead of the numbers)
    preset: Optional[str] = None  # the --preset this row is

    def key(self):
        return (self.method, self.kivi, self.fake)

    def config_record(self) -> Optional[dict]:
        if self.kivi is None:
            return self.fake.to_dict() if self.fake else None
        record = self.kivi.to_record(self.levels_file)
        return dict(record, preset=self.preset) if self.preset else record


@dataclass(frozen=True)
class LevelFiles:
    """The `kivi calibrate` files the nuq rows read: `plain` (no pre-RoPE, no outliers) for
    "KIVI-2 + nuq2", `full` (--pre-rope --sparse-outliers 0.01) for the KVQuant rows. The default:
    the embedded model's (commands in kvquant_fake.json); `kivi eval table --nuq-levels
    --kvquant-levels` name another model's."""
    plain: Path = Path(__file__).resolve().parent / "results" / "nuq_levels_smollm2.json"
    full: Path = Path(__file__).resolve().parent / "results" / "nuq_levels_smollm2_prerope_sparse1.json"
    # The KVQuant-3 rows' nuq3 levels (levels3()): by default `full` itself, except for the embedded
    # model's default file, whose nuq3 levels come from a later calibration (`--bits 2,3,4`, the same
    # settings; its 2- and 4-bit levels differ from `full`'s in the last digits, so the KVQuant-2/4
    # rows keep `full`'s).
    full3: Optional[Path] = None

    def levels3(self) -> Path:
        if self.full3 is not None:
            return self.full3
        return _EMBEDDED_NUQ3 if self.full == LevelFiles.full else self.full


_EMBEDDED_NUQ3 = Path(__file__).resolve().parent / "results" / "nuq_levels_smollm2_prerope_sparse1_nuq234.json"


def _levels(file: Path, bits: int, **settings) -> dict:
    from kivi_ops.calibration.nuq import config_levels

    return config_levels(file, k_bits=bits, v_bits=bits, num_layers=None, group_size=32, **settings)


def fake_rows(quick: bool) -> list[Row]:
    rows = [] if quick else [
        Row("fake 4-bit K per-token, V per-token", "fake", "fake", fake=FakeQuantConfig(4, 4, 32, "token", "token")),
        Row("fake 4-bit K per-channel, V per-token", "fake", "fake", fake=FakeQuantConfig(4, 4, 32, "channel", "token")),
    ]
    for k_axis, v_axis in (("token", "token"), ("channel", "token"), ("channel", "channel"), ("token", "channel")):
        rows.append(Row(f"fake 2-bit K per-{k_axis}, V per-{v_axis}", "fake", "fake",
                        fake=FakeQuantConfig(2, 2, 32, k_axis, v_axis)))
    return rows


def standard_rows(quick: bool, levels: LevelFiles = LevelFiles(), model: str = "default") -> list[Row]:
    """The perplexity rows; the full table's end with the presets shipped for --model `model`
    (preset_rows), the quick one (CI's, timed) has none."""
    if quick:
        # 256-token windows: R=32 keeps most of each window quantized.
        return ([Row("16-bit", "baseline", "fp")] + fake_rows(quick)
                + [Row("KIVI-2 (G=32, R=32)", "kivi", "kivi", kivi=KIVIConfig(2, 2, 32, 32))])
    rows = [Row("16-bit", "baseline", "fp")] + fake_rows(quick) + [
        Row("KIVI-4 (G=32, R=128)", "kivi", "kivi", kivi=KIVIConfig(4, 4, 32, 128)),
        Row("KIVI-3 (G=32, R=128)", "kivi", "kivi", kivi=KIVIConfig(3, 3, 32, 128)),
        Row("KIVI-2 (G=32, R=128)", "kivi", "kivi", kivi=KIVIConfig(2, 2, 32, 128)),
    ]
    rows += [Row(f"KIVI-2 G={g} (R=128)", "group size", "kivi", kivi=KIVIConfig(2, 2, g, 128)) for g in (32, 64, 128)]
    rows += [Row(f"KIVI-2 R={r} (G=32)", "residual", "kivi", kivi=KIVIConfig(2, 2, 32, r)) for r in (32, 64, 96, 128)]
    return (rows + extension_rows() + kvquant_rows(levels) + rotation_rows(levels) + baseline_rows()
            + preset_rows(model))


HAD = "hadamard"
ROTATED = {"K": dict(rotate_keys=HAD), "V": dict(rotate_values=HAD), "K+V": dict(rotate_keys=HAD, rotate_values=HAD)}


def rotation_rows(levels: LevelFiles = LevelFiles()) -> list[Row]:
    """KIVI-2/3/4 with keys, values or both stored Walsh–Hadamard-rotated (kivi_ops/options/rotation.py),
    and the best 2-bit KVQuant rows with the rotations they admit: values rotated (pre-RoPE keys
    refuse a key rotation; the nuq value levels were calibrated unrotated), and the post-RoPE
    options (1% sparse + sink 1) with both rotated."""
    rows = [Row(f"KIVI-{b} + rotated {part} (G=32, R=128)", "rotation", "kivi", kivi=KIVIConfig(b, b, 32, 128, **rot))
            for b in (2, 3, 4) for part, rot in ROTATED.items()]
    full = dict(pre_rope=True, sparse_outliers=0.01)
    return rows + [
        Row("KVQuant-2 + sink 1 + rotated V (G=32, R=128)", "rotation", "kivi",
            kivi=KIVIConfig(2, 2, 32, 128, sink_tokens=1, rotate_values=HAD, **full, **_levels(levels.full, 2, **full)),
            levels_file=levels.full.name),
        Row("KIVI-2 + 1% sparse + sink 1 + rotated K+V (G=32, R=128)", "rotation", "kivi",
            kivi=KIVIConfig(2, 2, 32, 128, sink_tokens=1, sparse_outliers=0.01, **ROTATED["K+V"])),
    ]


def baseline_rows() -> list[Row]:
    """Fake-quantization baselines (every token quantized, no residual): FP8 e4m3 with one scale
    per head; int4 / int2 per token per head (a scale and zero per token per head, vLLM-like),
    plain and Walsh–Hadamard-rotated (TurboQuant-like); KIVI's fake 2-bit row rotated."""
    rows = [Row("fake FP8 e4m3, per-head scale", "per-token / fp8", "fake", fake=FakeQuantConfig(8, 8, format="fp8"))]
    for b in (4, 2):
        rows.append(Row(f"fake int{b} per token-head", "per-token / fp8", "fake",
                        fake=FakeQuantConfig(b, b, 32, "head", "head")))
        rows.append(Row(f"fake int{b} per token-head, rotated K+V", "per-token / fp8", "fake",
                        fake=FakeQuantConfig(b, b, 32, "head", "head", HAD, HAD)))
    for part, (kr, vr) in (("K", (HAD, "none")), ("V", ("none", HAD)), ("K+V", (HAD, HAD))):
        rows.append(Row(f"fake 2-bit K per-channel, V per-token, rotated {part}", "per-token / fp8", "fake",
                        fake=FakeQuantConfig(2, 2, 32, "channel", "token", kr, vr)))
    return rows


def kvquant_rows(levels: LevelFiles = LevelFiles()) -> list[Row]:
    """KVQuant's techniques in the cache, alone and combined, G=32 R=128 like KIVI-2:
    pre-RoPE keys, nuq levels, 1% dense-and-sparse outliers, attention sink. Their levels are
    per layer of the model they were calibrated on (`levels`; rows whose levels are for another
    model are skipped)."""
    full = dict(pre_rope=True, sparse_outliers=0.01)
    PLAIN, FULL = levels.plain.name, levels.full.name
    return [
        Row("KIVI-2 + pre-RoPE (G=32, R=128)", "kvquant", "kivi", kivi=KIVIConfig(2, 2, 32, 128, pre_rope=True)),
        Row("KIVI-2 + nuq2 (G=32, R=128)", "kvquant", "kivi",
            kivi=KIVIConfig(2, 2, 32, 128, **_levels(levels.plain, 2)), levels_file=PLAIN),
        Row("KIVI-2 + 1% sparse (G=32, R=128)", "kvquant", "kivi", kivi=KIVIConfig(2, 2, 32, 128, sparse_outliers=0.01)),
        Row("KVQuant-2: pre-RoPE + nuq2 + 1% (G=32, R=128)", "kvquant", "kivi",
            kivi=KIVIConfig(2, 2, 32, 128, **full, **_levels(levels.full, 2, **full)), levels_file=FULL),
        Row("KVQuant-2 + sink 1 (G=32, R=128)", "kvquant", "kivi",
            kivi=KIVIConfig(2, 2, 32, 128, sink_tokens=1, **full,
                            **_levels(levels.full, 2, **full)), levels_file=FULL),
        Row("KVQuant-4: pre-RoPE + nuq4 + 1% (G=32, R=128)", "kvquant", "kivi",
            kivi=KIVIConfig(4, 4, 32, 128, **full, **_levels(levels.full, 4, **full)), levels_file=FULL),
    ] + kvquant3_rows(levels)


def kvquant3_rows(levels: LevelFiles = LevelFiles()) -> list[Row]:
    """KVQuant's main setting, 3 bits (pre-RoPE, nuq3, 1% dense-and-sparse), with and without an
    attention sink; skipped when the levels file has no 3-bit levels (`kivi calibrate --bits 2,3,4`)."""
    full = dict(pre_rope=True, sparse_outliers=0.01)
    try:
        levels3 = _levels(levels.levels3(), 3, **full)
    except ValueError as e:
        if "not 3" not in str(e):
            raise
        print(f"  skipping the KVQuant-3 rows: {e}", file=sys.stderr, flush=True)
        return []
    return [
        Row("KVQuant-3: pre-RoPE + nuq3 + 1% (G=32, R=128)", "kvquant", "kivi",
            kivi=KIVIConfig(3, 3, 32, 128, **full, **levels3), levels_file=levels.levels3().name),
        Row("KVQuant-3 + sink 1 (G=32, R=128)", "kvquant", "kivi",
            kivi=KIVIConfig(3, 3, 32, 128, sink_tokens=1, **full, **levels3), levels_file=levels.levels3().name),
    ]


def extension_rows() -> list[Row]:
    """OTT-2 (the OTT paper: 3 outlier tokens, none in the first two layers, spill pool 32) and
    attention-sink rows, comparable to the KIVI-2 rows of the same G and R. "OTT-2 as published"
    is the paper's own configuration on its own schedule (flush_policy="ott": keys and values
    quantized G at a time, the last R exact): G=128, R=32, compared as in the paper with
    "KIVI-2 G=128 (R=128)"; "KIVI-2 on the ott policy" is the schedule without outlier tokens.
    "OTT-2 G=128 (R=128, 3 outliers)" is OTT's outlier pool on KIVI's schedule."""
    return [
        Row("OTT-2 as published (ott policy: G=128, R=32, 3 outliers)", "ott / sink", "kivi",
            kivi=KIVIConfig(2, 2, 128, 32, outlier_tokens=3, flush_policy="ott")),
        Row("KIVI-2 on the ott policy (G=128, R=32)", "ott / sink", "kivi",
            kivi=KIVIConfig(2, 2, 128, 32, flush_policy="ott")),
        Row("OTT-2 (G=32, R=128, 3 outliers)", "ott / sink", "kivi", kivi=KIVIConfig(2, 2, 32, 128, outlier_tokens=3)),
        Row("OTT-2 G=128 (R=128, 3 outliers)", "ott / sink", "kivi", kivi=KIVIConfig(2, 2, 128, 128, outlier_tokens=3)),
        Row("KIVI-2 + sink 1 (G=32, R=128)", "ott / sink", "kivi", kivi=KIVIConfig(2, 2, 32, 128, sink_tokens=1)),
        Row("KIVI-2 + sink 4 (G=32, R=128)", "ott / sink", "kivi", kivi=KIVIConfig(2, 2, 32, 128, sink_tokens=4)),
        Row("OTT-2 + sink 1 (G=32, R=128)", "ott / sink", "kivi",
            kivi=KIVIConfig(2, 2, 32, 128, sink_tokens=1, outlier_tokens=3)),
    ]


def preset_rows(model: str) -> list[Row]:
    """A row per --preset with a shipped calibration for --model `model` (none for the others):
    the cache `--preset NAME` builds (kivi_benchmarks.presets.preset_config)."""
    from .presets import preset_config, preset_settings, presets_for

    rows = []
    for name in presets_for(model):
        config, nuq = preset_config(name, model), preset_settings(name, model).get("nuq")
        rows.append(Row(f"--preset {name} (G={config.group_size}, R={config.residual_length})", "preset", "kivi",
                        kivi=config, preset=name, levels_file=None if nuq is None else str(nuq)))
    return rows


def passkey_rows(quick: bool, levels: LevelFiles = LevelFiles(), model: str = "default") -> list[Row]:
    if quick:
        return [Row("16-bit", "baseline", "fp"), Row("KIVI-2 (G=32, R=32)", "kivi", "kivi", kivi=KIVIConfig(2, 2, 32, 32))]
    return [Row("16-bit", "baseline", "fp"),
            Row("KIVI-4 (G=32, R=128)", "kivi", "kivi", kivi=KIVIConfig(4, 4, 32, 128)),
            Row("KIVI-3 (G=32, R=128)", "kivi", "kivi", kivi=KIVIConfig(3, 3, 32, 128)),
            Row("KIVI-2 (G=32, R=128)", "kivi", "kivi", kivi=KIVIConfig(2, 2, 32, 128)),
            *[r for r in extension_rows() if "G=128" not in r.name and "OTT-2 + sink" not in r.name],
            *[r for r in kvquant_rows(levels) if r.name.startswith("KVQuant")],
            *[r for r in rotation_rows(levels) if "rotated K+V" in r.name], *preset_rows(model)]


def selected(rows: list[Row], only: Optional[list[str]]) -> list[Row]:
    """The rows whose name contains one of `only` (all when None); the 16-bit baseline always
    stays, since every row is reported against it."""
    if only is None:
        return rows
    return [r for r in rows if r.method == "fp" or any(part in r.name for part in only)]


BYTES_CONTEXTS = (4096, 32768)


def cache_bytes(patched_model, row: Row, tokens: int) -> dict:
    """One sequence of `tokens` in this row's cache, fp16, exact (sized on the meta device), per
    layer kind, against an fp16 cache (whose sliding-window layers hold their window)."""
    from kivi_models.generate import make_cache

    cache = make_cache(patched_model, method=row.method, batch_size=1, max_seq_len=tokens, kivi_config=row.kivi,
                       device="meta", dtype=torch.float16)
    return dict(tokens=tokens, **cache.nbytes_by_kind(), total=cache.nbytes(), fp16=cache.fp16_nbytes())


def llama2_7b_bytes(row: Row, tokens: int) -> dict:
    """One sequence of `tokens` in this row's cache at Llama-2-7B's attention shape (32 layers, 32
    KV heads, head_dim 128; kivi bench memory's), fp16, exact (sized on the meta device), against an
    fp16 cache. The per-layer constants follow the row: its nuq levels (its first layer's, in each
    of the 32 layers) and, for pre-RoPE keys, Llama-2's RoPE frequencies (base 10000)."""
    from dataclasses import replace

    from kivi_ops import KIVICache, fp16_cache_nbytes

    from .perf import LLAMA2_7B

    fp16 = fp16_cache_nbytes(batch_size=1, num_tokens=tokens, **LLAMA2_7B)
    if row.method == "fp":
        return dict(tokens=tokens, total=fp16, fp16=fp16)
    cfg, n = row.kivi, LLAMA2_7B["num_layers"]
    if cfg.has_nuq:
        cfg = replace(cfg, key_levels=(cfg.key_levels[0],) * n, value_levels=(cfg.value_levels[0],) * n)
    rope = {}
    if cfg.pre_rope:
        D = LLAMA2_7B["head_dim"]
        rope = dict(rope_inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D), rope_scaling=1.0)
    cache = KIVICache(cfg, batch_size=1, max_seq_len=tokens, dtype=torch.float16, device="meta", **LLAMA2_7B, **rope)
    return dict(tokens=tokens, total=cache.nbytes(), fp16=fp16)


def bits_per_element(patched_model, row: Row, tokens: int = BYTES_CONTEXTS[0]) -> float:
    """Stored bits per key/value element, scales counted: a fake row's quantized format; a cache
    row's exact bytes for one sequence of `tokens` (4K) in the model's full-attention layers,
    residual window and options included (perplexity.cache_bits_per_element)."""
    if row.method == "fake":
        config = patched_model.config
        return row.fake.bits_per_element(getattr(config, "head_dim", None)
                                         or config.hidden_size // config.num_attention_heads)
    return cache_bits_per_element(patched_model, row.method, row.kivi, tokens)


def run_table(plain_model, patched_model, tokenizer, *, quick: bool, out_dir: Path, window: int, windows: int,
              chunk: int, passkey_lengths: list[int], passkey_trials: int, seed: int = 0,
              only: Optional[list[str]] = None, levels: LevelFiles = LevelFiles(), model: str = "default") -> dict:
    started = time.perf_counter()
    num_layers = patched_model.config.num_hidden_layers

    def runnable(row: Row) -> bool:  # nuq levels are per layer of the model they were calibrated on
        if row.kivi is not None and row.kivi.has_nuq and len(row.kivi.key_levels) != num_layers:
            print(f"  skipping {row.name}: its nuq levels ({row.levels_file}) are for another model",
                  file=sys.stderr, flush=True)
            return False
        return True

    text = load_text(corpus="pydoc")
    wins = token_windows(tokenizer, text, window=window, max_tokens=window * windows)
    ppl_results, done = [], {}
    for row in filter(runnable, selected(standard_rows(quick, levels, model), only)):
        if row.key() not in done:
            if row.method == "fake":
                done[row.key()] = fake_quant_perplexity(plain_model, wins, row.fake, desc=row.name)
            else:
                done[row.key()] = cache_perplexity(patched_model, wins, method=row.method, kivi_config=row.kivi,
                                                   chunk=chunk, desc=row.name)
        r = done[row.key()]
        print(f"  {row.name:<40} ppl {r.ppl:8.3f}  ({r.seconds:.0f} s)", file=sys.stderr, flush=True)
        ppl_results.append(dict(name=row.name, group=row.group, method=row.method,
                                config=row.config_record(), bits_per_element=bits_per_element(patched_model, row),
                                **r.to_dict()))
    passkey_results = []
    for row in filter(runnable, selected(passkey_rows(quick, levels, model), only)):
        res = passkey_accuracy(patched_model, tokenizer, lengths=passkey_lengths, trials=passkey_trials,
                               method=row.method, kivi_config=row.kivi, seed=seed, desc=f"passkey {row.name}")
        print(f"  passkey {row.name:<32} {res['accuracy']}  ({res['seconds']:.0f} s)", file=sys.stderr, flush=True)
        passkey_results.append(dict(name=row.name, method=row.method,
                                    config=row.config_record(), **res))
    bytes_results = [dict(name=row.name, contexts=[cache_bytes(patched_model, row, n) for n in BYTES_CONTEXTS])
                     for row in filter(runnable, selected(standard_rows(quick, levels, model), only)) if row.method != "fake"]
    # Per-layer widths and calibrated rotations are the model's own: no row at another model's shape.
    llama_results = [dict(name=row.name, contexts=[llama2_7b_bytes(row, n) for n in BYTES_CONTEXTS])
                     for row in filter(runnable, selected(standard_rows(quick, levels, model), only))
                     if row.method != "fake" and not (row.kivi and (row.kivi.layer_bits or row.kivi.rotations))]
    report = dict(
        model=model, quick=quick, corpus="pydoc_data.topics", window=window, windows=int(wins.shape[0]), chunk=chunk,
        passkey_lengths=passkey_lengths, passkey_trials=passkey_trials, seed=seed, rows=only,
        perplexity=ppl_results, passkey=passkey_results, cache_bytes=bytes_results,
        cache_bytes_llama2_7b=llama_results, runtime_s=time.perf_counter() - started,
        environment=environment(),
    )
    write_outputs(report, out_dir)
    return report


def markdown(report: dict) -> str:
    lines = [f"Perplexity on {report['windows']} x {report['window']}-token windows of pydoc_data.topics "
             f"(chunk {report['chunk']}; fake rows: every token quantized, no residual)", "",
             "| configuration | PPL | vs 16-bit | bits / element |", "| --- | --- | --- | --- |"]
    base = report["perplexity"][0]["ppl"]
    for r in report["perplexity"]:
        bits = f"{r['bits_per_element']:.2f}" if r.get("bits_per_element") is not None else ""
        lines.append(f"| {r['name']} | {r['ppl']:.2f} | {r['ppl'] - base:+.2f} | {bits} |")
    lines += ["", "bits / element: stored bits per key/value element, scales and zeros counted; cache rows: "
              "exact bytes of one 4K-token sequence in the full-attention layers, the fp residual window included; "
              "fake rows: the quantized format alone (no residual)."]
    lengths = report["passkey_lengths"]
    lines += ["", f"Passkey retrieval accuracy ({report['passkey_trials']} trials per length)", "",
              "| configuration | " + " | ".join(map(str, lengths)) + " |", "| --- |" + " --- |" * len(lengths)]
    for r in report["passkey"]:
        lines.append(f"| {r['name']} | " + " | ".join(f"{r['accuracy'][n]:.2f}" for n in lengths) + " |")
    if report.get("cache_bytes"):
        contexts = [c["tokens"] for c in report["cache_bytes"][0]["contexts"]]
        lines += ["", "Cache bytes per sequence (fp16, exact; sliding-window layers are fp rings of their window; "
                  "fp16 cache: the same window layers, full layers unquantized)", "",
                  "| configuration | " + " | ".join(f"{n // 1024}K: bytes (full + window) | vs fp16" for n in contexts)
                  + " |", "| --- |" + " --- | --- |" * len(contexts)]
        for r in report["cache_bytes"]:
            lines.append(f"| {r['name']} | " + " | ".join(
                f"{c['total']:,} ({c['full']:,} + {c['window']:,}) | {c['fp16'] / c['total']:.2f}x"
                for c in r["contexts"]) + " |")
    if report.get("cache_bytes_llama2_7b"):
        contexts = [c["tokens"] for c in report["cache_bytes_llama2_7b"][0]["contexts"]]
        lines += ["", "Cache bytes per sequence at Llama-2-7B's shape (32 layers, 32 KV heads, head_dim 128; fp16, "
                  "exact)", "",
                  "| configuration | " + " | ".join(f"{n // 1024}K: bytes | vs fp16" for n in contexts) + " |",
                  "| --- |" + " --- | --- |" * len(contexts)]
        for r in report["cache_bytes_llama2_7b"]:
            lines.append(f"| {r['name']} | " + " | ".join(f"{c['total']:,} | {c['fp16'] / c['total']:.2f}x"
                                                         for c in r["contexts"]) + " |")
    lines += ["", f"Runtime {report['runtime_s'] / 60:.1f} min; torch {report['environment']['torch']}, "
              f"{report['environment']['threads']} threads, git {str(report['environment']['git_sha'])[:10]}"]
    return "\n".join(lines) + "\n"


COLORS = {"baseline": "tab:gray", "fake": "tab:orange", "kivi": "tab:blue", "group size": "tab:green",
          "residual": "tab:purple", "ott / sink": "tab:red", "kvquant": "tab:brown", "rotation": "tab:cyan",
          "per-token / fp8": "tab:olive", "preset": "tab:pink"}


def plot_bits(report: dict, path: Path, title: str) -> None:
    """Perplexity against stored bits per element, one point per row that records its bits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["perplexity"] if r.get("bits_per_element") is not None]
    fig, ax = plt.subplots(figsize=(9, 6))
    for group in dict.fromkeys(r["group"] for r in rows):
        sel = [r for r in rows if r["group"] == group]
        ax.scatter([r["bits_per_element"] for r in sel], [r["ppl"] for r in sel], color=COLORS.get(group, "k"),
                   label=group, marker="s" if sel[0]["method"] == "fake" else "o")
        for r in sel:
            ax.annotate(r["name"], (r["bits_per_element"], r["ppl"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per key/value element (scales counted)")
    ax.set_ylabel("perplexity (log scale, lower is better)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    # JSON keys must be strings; keep lengths readable.
    for r in report["passkey"]:
        r["accuracy"] = {int(k): v for k, v in r["accuracy"].items()}
    (out_dir / "quality.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "quality.md").write_text(markdown(report))

    rows = report["perplexity"]
    colors = COLORS
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [r["ppl"] for r in rows], color=[colors[r["group"]] for r in rows])
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("perplexity (log scale, lower is better)")
    for i, r in enumerate(rows):
        ax.text(r["ppl"], i, f" {r['ppl']:.2f}", va="center", fontsize=8)
    name = "SmolLM2-135M" if report.get("model", "default") == "default" else Path(report["model"]).name
    ax.set_title(f"{name}, {report['windows']} x {report['window']} tokens of pydoc topics")
    fig.tight_layout()
    fig.savefig(out_dir / "quality_ppl.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report["passkey"]:
        xs = report["passkey_lengths"]
        ax.plot(xs, [r["accuracy"][n] for n in xs], marker="o", label=r["name"])
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("passkey accuracy")
    ax.legend()
    ax.set_title("Passkey retrieval")
    fig.tight_layout()
    fig.savefig(out_dir / "quality_passkey.png", dpi=110)
    plt.close(fig)
    plot_bits(report, out_dir / "quality_bits.png", f"{name}: quality against bits per element")
