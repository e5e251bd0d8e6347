"""Collect per-row `kivi eval ppl --json` and `kivi eval passkey --json` results (one process per
row, run one at a time by lab/run_rows.sh) into one quality table: JSON, Markdown and a plot of
perplexity against stored bits per element.

    lab/run_rows.sh QUEUE DIR
    python -m lab rotation_table --runs DIR --log DIR/log.txt --out benchmarks/results/quality_rotation \
        [--model gemma3-270m --no-committed]

DIR holds NAME.json (the row's `kivi eval ppl --json` output) and pk_NAME.json (its `kivi eval
passkey --json` output); the log holds the lines "<date> START NAME :: <command>" and
"<date> END NAME rc=..." the runner wrote. Bits per element are recomputed from each row's config
(kivi_benchmarks.quality_table.bits_per_element) on --model.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# (file stem, row name, group), in table order
ROWS = [
    ("fp", "16-bit", "baseline"),
    ("kivi4", "KIVI-4 (G=32, R=128)", "kivi"),
    ("kivi4_rotkv", "KIVI-4 + rotated K+V (G=32, R=128)", "rotation"),
    ("kivi3", "KIVI-3 (G=32, R=128)", "kivi"),
    ("kivi3_rotkv", "KIVI-3 + rotated K+V (G=32, R=128)", "rotation"),
    ("kivi2", "KIVI-2 (G=32, R=128)", "kivi"),
    ("kivi2_rotk", "KIVI-2 + rotated K (G=32, R=128)", "rotation"),
    ("kivi2_rotv", "KIVI-2 + rotated V (G=32, R=128)", "rotation"),
    ("kivi2_rotkv", "KIVI-2 + rotated K+V (G=32, R=128)", "rotation"),
    ("kivi2_calk", "KIVI-2 + calibrated rotation K (G=32, R=128)", "calibrated rotation"),
    ("kivi2_calv", "KIVI-2 + calibrated rotation V (G=32, R=128)", "calibrated rotation"),
    ("kivi2_calkv", "KIVI-2 + calibrated rotation K+V (G=32, R=128)", "calibrated rotation"),
    ("kvquant2_sink", "KVQuant-2 + sink 1 (G=32, R=128)", "kvquant"),
    ("kvquant2_sink_rotv", "KVQuant-2 + sink 1 + rotated V (G=32, R=128)", "rotation"),
    ("kivi2_sparse_sink_rotkv", "KIVI-2 + 1% sparse + sink 1 + rotated K+V (G=32, R=128)", "rotation"),
    ("fake_fp8", "fake FP8 e4m3, per-head scale", "per-token / fp8"),
    ("fake_int4_head", "fake int4 per token-head", "per-token / fp8"),
    ("fake_int4_head_rot", "fake int4 per token-head, rotated K+V", "per-token / fp8"),
    ("fake_int2_head", "fake int2 per token-head", "per-token / fp8"),
    ("fake_int2_head_rot", "fake int2 per token-head, rotated K+V", "per-token / fp8"),
    ("fake_kivi2", "fake 2-bit K per-channel, V per-token", "fake"),
    ("fake_kivi2_rotk", "fake 2-bit K per-channel, V per-token, rotated K", "per-token / fp8"),
    ("fake_kivi2_rotv", "fake 2-bit K per-channel, V per-token, rotated V", "per-token / fp8"),
    ("fake_kivi2_rotkv", "fake 2-bit K per-channel, V per-token, rotated K+V", "per-token / fp8"),
    ("kivi2_g64r64", "KIVI-2 (G=64, R=64)", "per-layer widths"),
    ("kivi2_g64r64_calrot", "KIVI-2 + calibrated rotation K+V (G=64, R=64)", "per-layer widths"),
    ("preset_quality2bit", "calibrated K+V, per-layer 2/3-bit (G=64, R=64)", "per-layer widths"),
    ("layer_bits_sink1", "calibrated K+V, per-layer 2/3-bit, sink 1 (G=64, R=64)", "preset"),
    ("layer_bits_sink4", "calibrated K+V, per-layer 2/3-bit, sink 4 (G=64, R=64)", "preset"),
    ("preset_nuq", "calibrated K+V, nuq levels in their basis, per-layer 2/3-bit, sink 1 (G=64, R=64)", "preset"),
    ("preset_nuq_bnuq", "the same, widths chosen on the nuq levels (--budget-nuq)", "preset"),
    ("preset_nuq_w16", "the same, widths on nuq, calibrated on 16 windows", "preset"),
    ("preset_rnuq", "the same, widths and rotations chosen on nuq levels (--budget-nuq --rotations-nuq)", "preset"),
    ("preset_nuq_ott3", "calibrated K+V, nuq, per-layer 2/3-bit within 2.86 bits, sink 1 + OTT 3 outliers (G=64, R=64)",
     "preset"),
    ("preset_nuq_sink4", "--preset quality-2bit on SmolLM2: calibrated K+V, nuq levels in their basis, per-layer "
                         "2/3-bit, sink 4 (G=64, R=64)", "preset"),
    ("learned", "the preset's recipe, rotations learned per head (kivi calibrate --learned-rotations)", "preset"),
    ("learned_w16", "the same, calibrated on 16 windows", "preset"),
    ("e2e", "the preset's file, rotations trained end to end (lab e2e_rotations, lr 2e-3, best of 60 steps: 10)",
     "preset"),
    ("e2e_lr5e-4", "the same, lr 5e-4, best of 40 steps: 40", "preset"),
    ("kvquant2_sparse05_sink_g128", "--preset quality-2bit on Gemma 3: KVQuant-2 + 0.5% sparse + sink 1 (G=128, R=128), levels "
                                    "from 16 windows",
     "preset"),
    ("kvquant2_sparse05_sink_g128_w8", "KVQuant-2 + 0.5% sparse + sink 1 (G=128, R=128), levels from 8 windows",
     "preset"),
    ("kvquant2_sparse05_sink4_g128", "KVQuant-2 + 0.5% sparse + sink 4 (G=128, R=128), levels from 8 windows", "preset"),
]


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# Rows not re-run here come from the committed tables at the same settings (4 x 1024, chunk 1;
# reference CPU kernels, 2 threads: docs/quality.md says how far that moves the last digits).
# quality_rotation.json: this table's own earlier rows, each with its own command.
COMMITTED = ("quality_rotation.json", "quality.json", "quality_kvquant.json")
# Rows renamed since a committed table named them: today's name -> the committed one.
COMMITTED_AS = {"calibrated K+V, per-layer 2/3-bit (G=64, R=64)":
                "--preset quality-2bit: calibrated K+V, per-layer 2/3-bit (G=64, R=64)",
                "calibrated K+V, per-layer 2/3-bit, sink 1 (G=64, R=64)":
                "--preset quality-2bit on SmolLM2: calibrated K+V, per-layer 2/3-bit, sink 1 (G=64, R=64)"}


def _names(name: str) -> set:
    """The names a row may have in a committed table: today's, or the one it had before a rename."""
    return {name, COMMITTED_AS.get(name, name)}


def _committed(name: str, files=COMMITTED):
    for file in files:
        data = json.loads((RESULTS / file).read_text())
        for r in data["perplexity"]:
            # measured there, or carried there with its first source named
            if r["name"] in _names(name) and (r.get("started") or "(committed " in r.get("command", "(committed ")):
                env = data["environment"]
                command = r.get("command") or env["command"]
                if "(committed " in command:  # carried over once already: keep its first source
                    return r, command
                sha = env["git_sha"]  # a dirty tree's sha keeps its +uncommitted
                sha = sha[:10] + ("+uncommitted" if sha.endswith("+uncommitted") else "")
                return r, f"{command} (committed {file}, git {sha}, {env['threads']} threads)"
    return None, None


def _committed_passkey(name: str, files=COMMITTED):
    """A passkey row of the committed table this one extends (the first file), kept as it was."""
    data = json.loads((RESULTS / files[0]).read_text())
    row = next((r for r in data.get("passkey", []) if r["name"] in _names(name)), None)
    return dict(row, name=name) if row else None


def _last_json(path: Path) -> dict:
    """A row's result: the last line of its `--json` output."""
    return json.loads(path.read_text().strip().splitlines()[-1])


def _row_config(method: str, config: dict):
    from kivi_benchmarks.perplexity import FakeQuantConfig
    from kivi_ops import KIVIConfig

    if method == "fake":
        fields = {k: config[k] for k in ("k_bits", "v_bits", "group_size", "k_axis", "v_axis", "k_rotation",
                                         "v_rotation", "rotation_seed", "format") if k in config}  # older rows lack some
        return None, FakeQuantConfig(**fields)
    if method == "fp":
        return None, None
    fields = {k: v for k, v in config.items() if k != "nuq"}
    fields["layer_bits"] = tuple(tuple(p) for p in config.get("layer_bits", ()))  # JSON lists
    if config.get("rotations"):  # calibrated rotations, recorded as their file (kivi_ops/calibration/rotations.py)
        from kivi_ops.calibration.rotations import load_rotations

        file = Path(config["rotations"]["file"])
        fields["rotations"] = load_rotations(file if file.exists() else RESULTS / file.name, None)
    if config.get("nuq"):
        from kivi_ops.calibration.nuq import config_levels

        nuq = Path(config["nuq"]) if Path(config["nuq"]).exists() else RESULTS / Path(config["nuq"]).name
        fields.update(config_levels(nuq, k_bits=config["k_bits"], v_bits=config["v_bits"], num_layers=None,
                                    group_size=config["group_size"], pre_rope=config["pre_rope"],
                                    sparse_outliers=config["sparse_outliers"], layer_bits=fields["layer_bits"],
                                    rotate_keys=config["rotate_keys"], rotate_values=config["rotate_values"],
                                    rotations=fields.get("rotations")))
    return KIVIConfig(**fields), None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab rotation_table", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    p.add_argument("--title", default="SmolLM2-135M, 4 x 1024 tokens of pydoc topics")
    p.add_argument("--note", default="")
    p.add_argument("--model", default="default", help="as for `kivi eval` (bits per element depend on its head_dim)")
    p.add_argument("--no-committed", action="store_true",
                   help="rows not run here stay out (default: taken from the committed SmolLM2 tables)")
    p.add_argument("--carry", default=None, metavar="FILE",
                   help="carry rows not run here from this committed table in benchmarks/results "
                        "(default: the SmolLM2 tables)")
    p.add_argument("--only", type=lambda text: set(text.split(",")), default=None, metavar="STEM,...",
                   help="only these rows (file stems) and the 16-bit baseline")
    args = p.parse_args(argv)
    committed = (args.carry,) if args.carry else COMMITTED

    from kivi_benchmarks.environment import environment
    from kivi_benchmarks.quality_table import Row, bits_per_element, plot_bits
    from kivi_models import load_model, patch_model

    log = args.log.read_text().splitlines()
    # a row run twice: its last START line counts (later keys overwrite earlier ones)
    started = {m.group(2): (m.group(1), m.group(3)) for m in
               (re.match(r"(\S+) START (\S+) :: (.*)", line) for line in log) if m}
    ended = {m.group(2): m.group(1) for m in (re.match(r"(\S+) END (\S+) rc=0", line) for line in log) if m}
    model = patch_model(load_model(args.model)[0])
    rows, missing, passkey = [], [], []
    for stem, name, group in ROWS:
        if args.only is not None and stem not in args.only | {"fp"}:
            continue
        path, pk = args.runs / f"{stem}.json", args.runs / f"pk_{stem}.json"
        if f"pk_{stem}" in ended and pk.exists():
            run = _last_json(pk)
            passkey.append(dict(name=name, accuracy=run["accuracy"], trials=run["trials"], seconds=run["seconds"],
                                config=run["config"], command=started[f"pk_{stem}"][1],
                                started=started[f"pk_{stem}"][0], ended=ended[f"pk_{stem}"]))
        elif not args.no_committed and _committed_passkey(name, committed) is not None:
            passkey.append(_committed_passkey(name, committed))
        if stem not in ended or not path.exists() or not path.read_text().strip():
            old, source = (None, None) if args.no_committed else _committed(name, committed)
            if old is None:
                missing.append(name)
                continue
            kivi, fake = _row_config(old["method"], old["config"] or {})
            row = Row(name, group, old["method"], kivi=kivi, fake=fake)
            rows.append(dict(name=name, group=group, method=old["method"], ppl=old["ppl"], tokens=old["tokens"],
                             seconds=old["seconds"], bits_per_element=bits_per_element(model, row),
                             config=old["config"], command=source, started=old.get("started", ""),
                             ended=old.get("ended", "")))
            continue
        run = _last_json(path)
        kivi, fake = _row_config(run["method"], run["config"])
        row = Row(name, group, run["method"], kivi=kivi, fake=fake)
        rows.append(dict(name=name, group=group, method=run["method"], ppl=run["ppl"], tokens=run["tokens"],
                         seconds=run["seconds"], bits_per_element=bits_per_element(model, row),
                         config=run["config"], command=started[stem][1], started=started[stem][0], ended=ended[stem]))
    report = dict(model=args.model, corpus="pydoc_data.topics", window=1024, windows=4, chunk=1,
                  perplexity=rows, passkey=passkey, not_measured=missing, note=args.note,
                  environment=environment(command="; ".join(r["command"] for r in rows)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    base = next((r["ppl"] for r in rows if r["method"] == "fp"), None)
    dates = [r["started"] for r in [*rows, *passkey] if r["started"]]
    lines = [f"# {args.title}: rotations and the per-token / FP8 baselines", "",
             f"Model: {args.model}. Teacher-forced perplexity, pydoc_data.topics, 4 x 1024-token windows. Cache rows: chunk 1 (decode "
             "semantics), G=32, R=128, through the real cache. Fake rows: every token quantized, no residual.",
             "bits / element: stored bits per key/value element, scales and zeros counted (cache rows: exact bytes "
             "of one 4K-token sequence, the fp16 residual window included; fake rows: the format alone).", "",
             "| configuration | PPL | vs 16-bit | bits / element | command |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        gap = f"{r['ppl'] - base:+.2f} ({100 * (r['ppl'] / base - 1):+.1f}%)" if base else ""
        lines.append(f"| {r['name']} | {r['ppl']:.2f} | {gap} | {r['bits_per_element']:.2f} | `{r['command']}` |")
    if passkey:
        lengths = list(passkey[0]["accuracy"])
        fp = next((r["accuracy"] for r in passkey if r["name"] == "16-bit"), None)
        lines += ["", f"Passkey retrieval: accuracy over {passkey[0]['trials']} trials per length (`kivi eval passkey`; "
                      "in brackets, the ratio to 16-bit's)", "",
                  "| configuration | " + " | ".join(f"{n} tokens" for n in lengths) + " | command |",
                  "| --- |" + " --- |" * len(lengths) + " --- |"]
        for r in passkey:
            cells = [f"{r['accuracy'][n]:.2f}" + (f" ({r['accuracy'][n] / fp[n]:.2f}x)" if fp and fp[n] else "")
                     for n in lengths]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | `{r['command']}` |")
    env = report["environment"]
    lines += ["", f"Not measured: {', '.join(missing) or 'none'}.", "",
              f"Each row ran in its own process on one thread (lab/run_rows.sh: `OMP_NUM_THREADS=1 nice -n 10 "
              f"<command>`; two queues side by side, one per core) on the project's shared 2-core CPU "
              f"machine, default CPU kernels; torch {env['torch']}, transformers {env['transformers']}, python "
              f"{env['python']}, git {env['git_sha']}. Dates: {min(dates, default='')} to "
              f"{max((r['ended'] for r in [*rows, *passkey]), default='')}. Rows whose command names a committed file are that "
              "table's numbers, not re-run.", args.note]
    args.out.with_suffix(".md").write_text("\n".join(lines).rstrip() + "\n")
    plot_bits(report, args.out.parent / f"{args.out.name}_bits.png", f"{args.title}: perplexity vs bits per element")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
