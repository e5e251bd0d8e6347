"""`kivi eval ppl | passkey | table`: the quality harness's command line."""

from __future__ import annotations

import sys
from pathlib import Path

from kivi_benchmarks import DEFAULT_OUT

from .args import (add_model_arguments, bits_report, check_weight_quant_modes, device_and_dtype, dumps_json, int_list,
                   kivi_config_from, positive_int, seed_int, usage_errors)


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="quality harness: perplexity, passkey retrieval, the KIVI tables")
    evsub = ev.add_subparsers(dest="eval_command", required=True)

    ppl = evsub.add_parser("ppl", help="teacher-forced perplexity through the KIVI cache")
    src = ppl.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a text file")
    src.add_argument("--corpus", choices=("pydoc",), help="pydoc: Python's pydoc_data.topics documentation")
    ppl.add_argument("--max-tokens", type=positive_int, default=8192, help="tokens of text to use")
    ppl.add_argument("--window", type=positive_int, default=1024, help="tokens per window (each starts an empty cache)")
    ppl.add_argument("--chunk", type=positive_int, default=1,
                     help="tokens fed per step; 1 (default) gives exact decode semantics")
    ppl.add_argument("--batch-size", type=positive_int, default=8, help="windows evaluated together")
    add_model_arguments(ppl, methods=("fp", "kivi", "fake"))
    ppl.add_argument("--k-axis", choices=("token", "channel", "head"), default="channel",
                     help="--method fake only: channel (groups of G tokens per channel), token (groups of G channels "
                          "per token) or head (per token, one group over the whole head: a scale and zero per token "
                          "per head)")
    ppl.add_argument("--v-axis", choices=("token", "channel", "head"), default="token", help="--method fake only")
    ppl.add_argument("--fake-format", choices=("int", "fp8"), default="int",
                     help="--method fake only: int (KIVI's min/max grid at --k-bits/--v-bits) or fp8 (float8 e4m3, "
                          "one scale per head; 8 bits)")
    ppl.add_argument("--json", action="store_true")
    ppl.set_defaults(func=cmd_ppl, parser=ppl)

    pk = evsub.add_parser("passkey", help="passkey retrieval accuracy per prompt length")
    pk.add_argument("--lengths", type=int_list, default=[1024, 2048, 4096, 8000])
    pk.add_argument("--trials", type=positive_int, default=5)
    pk.add_argument("--seed", type=seed_int, default=0)
    add_model_arguments(pk)
    pk.add_argument("--json", action="store_true")
    pk.set_defaults(func=cmd_passkey, parser=pk)

    tb = evsub.add_parser("table", help="run the standard set; write quality.json, quality.md and PNG plots")
    tb.add_argument("--quick", action="store_true", help="a small variant (about 3 minutes on 2 CPU cores)")
    tb.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"output folder (default ./{DEFAULT_OUT}; the committed table: --out benchmarks/results)")
    tb.add_argument("--model", default="default", help="as for `kivi generate`; the nuq rows need levels calibrated "
                                                      "for it (--nuq-levels, --kvquant-levels), or are skipped")
    tb.add_argument("--nuq-levels", type=Path, default=None, metavar="PATH",
                    help="`kivi calibrate` levels for the 'KIVI-2 + nuq2' row (default: the embedded model's, "
                         "benchmarks/results/nuq_levels_smollm2.json)")
    tb.add_argument("--kvquant-levels", type=Path, default=None, metavar="PATH",
                    help="`kivi calibrate --pre-rope --sparse-outliers 0.01 --bits 2,3,4` levels for the KVQuant rows "
                         "(default: the embedded model's, benchmarks/results/nuq_levels_smollm2_prerope_sparse1.json)")
    tb.add_argument("--windows", type=positive_int, default=None, help="perplexity windows (default 4; --quick 2)")
    tb.add_argument("--window", type=positive_int, default=None, help="tokens per window (default 1024; --quick 256)")
    tb.add_argument("--trials", type=positive_int, default=None, help="passkey trials per length (default 3; --quick 2)")
    tb.add_argument("--lengths", type=int_list, default=None,
                    help="passkey prompt lengths (default 1024,2048,4096; --quick 512)")
    tb.add_argument("--rows", type=lambda text: [p for p in text.split(",") if p], default=None, metavar="TEXT,...",
                    help="run only the rows whose name contains one of these (the 16-bit baseline always runs), "
                         "e.g. KVQuant,OTT")
    tb.set_defaults(func=cmd_table, parser=tb)


def _load(args, parser, *, patched: bool, plain: bool):
    from kivi_models import load_model, patch_model
    from kivi_models.weight_quant import apply_weight_quant

    device, dtype = device_and_dtype(args, parser)
    weight_quant = getattr(args, "weight_quant", "none")  # `eval table` has no --weight-quant

    def quantized(model):
        with usage_errors(parser):
            return apply_weight_quant(model, weight_quant)

    check_weight_quant_modes([weight_quant], device, parser)
    out = []
    if plain:
        out.append(quantized(load_model(args.model, dtype=dtype, device=device)[0]))
    if patched:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        out.append(patch_model(quantized(model)))
    else:
        from transformers import AutoTokenizer

        from kivi_models.loading import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model), local_files_only=True)
    return (*out, tokenizer)


def cmd_ppl(args, parser) -> int:
    from kivi_models.corpus import load_text

    from kivi_benchmarks.perplexity import FakeQuantConfig, cache_perplexity, fake_quant_perplexity

    kivi_config = kivi_config_from(args, parser)
    try:
        text = load_text(text_file=args.text, corpus=args.corpus)
    except OSError as e:
        parser.error(f"cannot read --text: {e}")
    if args.method == "fake":
        if args.window % args.group_size:
            parser.error(f"--window must be a multiple of --group-size={args.group_size} for --method fake")
        if args.fake_format == "fp8":
            if getattr(args, "explicit", set()) & {"k_bits", "v_bits"} and (args.k_bits, args.v_bits) != (8, 8):
                parser.error("--fake-format fp8 stores 8 bits per element; leave out --k-bits/--v-bits or give 8")
            args.k_bits = args.v_bits = 8
        with usage_errors(parser):
            spec = FakeQuantConfig(args.k_bits, args.v_bits, args.group_size, args.k_axis, args.v_axis,
                                   args.rotate_keys, args.rotate_values, args.rotation_seed, args.fake_format)
        model, tokenizer = _load(args, parser, patched=False, plain=True)
        nuq = _nuq_tables(args, parser, model.config) if args.nuq else None
        windows = _windows(tokenizer, text, args, parser)
        result = fake_quant_perplexity(model, windows, spec, batch_size=args.batch_size, nuq=nuq,
                                       sparse_outliers=args.sparse_outliers, pre_rope=args.pre_rope)
        config = dict(spec.to_dict(), nuq=args.nuq, sparse_outliers=args.sparse_outliers, pre_rope=args.pre_rope)
        head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        bits = dict(bits_per_element=spec.bits_per_element(head_dim), bits_per_element_tokens=None)
    else:
        model, tokenizer = _load(args, parser, patched=True, plain=False)
        windows = _windows(tokenizer, text, args, parser)
        result = cache_perplexity(model, windows, method=args.method, kivi_config=kivi_config, chunk=args.chunk,
                                  batch_size=args.batch_size)
        config = kivi_config.to_record(args.nuq) if args.method == "kivi" else {}
        bits = bits_report(model, args.method, kivi_config, args.window)
    report = dict(ppl=result.ppl, tokens=result.tokens, method=args.method, config=config, window=args.window,
                  windows=int(windows.shape[0]), chunk=args.chunk if args.method != "fake" else None,
                  **bits, seconds=result.seconds)
    if args.json:
        print(dumps_json(report))
    else:
        print(f"perplexity {result.ppl:.3f} over {result.tokens} predicted tokens "
              f"({report['windows']} x {args.window}-token windows, method {args.method}, {result.seconds:.0f} s)")
    return 0


def _nuq_tables(args, parser, config) -> dict:
    """{"k": key levels per layer at --k-bits, "v": value levels per layer at --v-bits}, checked
    against the model (its config)."""
    from kivi_ops.calibration.nuq import KEY_AXIS, VALUE_AXIS, load_kv_levels

    from kivi_models.loading import head_dim_of, model_identity

    if (args.k_axis, args.v_axis) != (KEY_AXIS, VALUE_AXIS):
        parser.error(f"--nuq levels are calibrated for --k-axis {KEY_AXIS} --v-axis {VALUE_AXIS}, "
                     f"got --k-axis {args.k_axis} --v-axis {args.v_axis}")
    with usage_errors(parser):
        keys, values = load_kv_levels(args.nuq, k_bits=args.k_bits, v_bits=args.v_bits,
                                      num_layers=config.num_hidden_layers, group_size=args.group_size,
                                      pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers,
                                      model=model_identity(args.model), head_dim=head_dim_of(config))
    return dict(k=keys, v=values)


def _windows(tokenizer, text, args, parser):
    from kivi_models.corpus import token_windows

    with usage_errors(parser):
        return token_windows(tokenizer, text, window=args.window, max_tokens=args.max_tokens)


def cmd_passkey(args, parser) -> int:
    from kivi_benchmarks.passkey import passkey_accuracy

    kivi_config = kivi_config_from(args, parser)
    model, tokenizer = _load(args, parser, patched=True, plain=False)
    res = passkey_accuracy(model, tokenizer, lengths=args.lengths, trials=args.trials, method=args.method,
                           kivi_config=kivi_config, seed=args.seed)
    if args.json:
        longest = max(args.lengths)
        print(dumps_json(dict(accuracy=res["accuracy"], method=args.method,
                              config=kivi_config.to_record(args.nuq) if args.method == "kivi" else {},
                              **bits_report(model, args.method, kivi_config, longest),
                              trials=args.trials, details=res["details"], seconds=res["seconds"])))
    else:
        for length, acc in res["accuracy"].items():
            print(f"{length:>6} tokens: {acc:.2f}")
    return 0


def cmd_table(args, parser) -> int:
    from kivi_benchmarks.quality_table import LevelFiles, kvquant_rows, run_table

    args.device, args.dtype = "cpu", None
    given = (("plain", args.nuq_levels), ("full", args.kvquant_levels))
    levels = LevelFiles(**{name: path for name, path in given if path})
    with usage_errors(parser, ValueError, OSError):
        kvquant_rows(levels)  # reads the levels files: a missing or wrong one fails before the model loads
    plain, patched, tokenizer = _load(args, parser, patched=True, plain=True)
    # Chunk 1 (exact decode semantics) everywhere; the full table's size is set by its runtime on
    # 2 CPU cores (about 30 minutes), the quick one's by CI (under 3).
    params = (dict(window=256, windows=2, chunk=1, passkey_lengths=[512], passkey_trials=2) if args.quick else
              dict(window=1024, windows=4, chunk=1, passkey_lengths=[1024, 2048, 4096], passkey_trials=3))
    for name in ("windows", "window"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.trials is not None:
        params["passkey_trials"] = args.trials
    if args.lengths is not None:
        params["passkey_lengths"] = args.lengths
    report = run_table(plain, patched, tokenizer, quick=args.quick, out_dir=args.out, only=args.rows,
                       levels=levels, model=args.model, **params)
    from kivi_benchmarks.quality_table import markdown

    sys.stdout.write(markdown(report))
    print(f"\nwrote the table's files to {args.out.resolve()}", file=sys.stderr)
    return 0
