"""`kivi bench memory | attention | decode | weight-quant | serve | hf-generate`: the performance
harness's command line."""

from __future__ import annotations

import json
from pathlib import Path

from kivi_benchmarks import DEFAULT_OUT

from .args import (check_weight_quant_modes, dumps_json, fraction_arg, int_list, positive_int,
                   positive_ints, usage_errors)

SHAPE_7B = "llama2-7b-shape"  # --model: random weights at Llama-2-7B's shape, for speed only


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="performance harness: cache memory, fused attention, end-to-end decode")
    bsub = b.add_subparsers(dest="bench_command", required=True)

    mem = bsub.add_parser("memory", help="exact cache bytes vs fp16 (Llama-2-7B shape), with the formula beside it")
    mem.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768, 131072])
    mem.add_argument("--budget-gib", type=float, default=None,
                     help="also report the largest batch whose cache fits this many GiB, per context")
    mem.add_argument("--sink-tokens", type=int, default=0, help="count a sink pool of N tokens per layer")
    mem.add_argument("--outlier-tokens", type=int, default=0,
                     help="count OTT outlier pools (N + 32 spill slots, none in the first two layers)")
    mem.add_argument("--sparse-outliers", type=fraction_arg, default=0.0, metavar="FRACTION",
                     help="count KVQuant's dense-and-sparse store for this fraction (e.g. 0.01)")

    att = bsub.add_parser("attention", help="fused KIVI decode attention vs scaled_dot_product_attention")
    att.add_argument("--contexts", type=int_list, default=None,
                     help="default: 1K..128K on cuda, 1K..16K on cpu")
    att.add_argument("--batch", type=positive_int, default=None, help="default: 8 on cuda, 1 on cpu")

    dec = bsub.add_parser("decode", help="end-to-end compiled decode tokens/s, fp vs KIVI")
    _add_model_flag(dec)
    dec.add_argument("--contexts", type=int_list, default=None, help="default: 1024,4096 on cpu")
    dec.add_argument("--batches", type=_int_list_any, default=None, help="default: 1,4")
    dec.add_argument("--new-tokens", type=positive_int, default=32)
    dec.add_argument("--budget-gib", type=_positive_float, default=None,
                     help="instead of fixed batches: the largest batch whose fp / KIVI cache fits this many GiB "
                          "(context + new tokens per sequence), and the decode throughput at it (KIVI's Figure 16)")
    dec.add_argument("--max-batch", type=positive_int, default=None, help="with --budget-gib: cap each batch")
    from kivi_models.weight_quant import WEIGHT_QUANT_MODES

    dec.add_argument("--weight-quant", choices=WEIGHT_QUANT_MODES, default="none",
                     help="torchao weight-only quantization of the Linear layers, for both the fp and KIVI rows")

    wq = bsub.add_parser("weight-quant", help="{fp, int8/int4 weights} x {fp, KIVI cache}: model + cache bytes, "
                                              "compiled decode tokens/s, one run")
    _add_model_flag(wq)
    wq.add_argument("--modes", type=_mode_list, default=None,
                    help="comma-separated weight modes, 'none' first "
                         "(default: none,int8 on cpu, none,int8,int4 on cuda)")
    wq.add_argument("--contexts", type=int_list, default=[1024])
    wq.add_argument("--batches", type=_int_list_any, default=[1, 4])
    wq.add_argument("--new-tokens", type=positive_int, default=32)

    srv = bsub.add_parser("serve", help="the kivi serve engine: static fp, paged fp, static KIVI-2 and paged KIVI-2 "
                                        "at one cache budget, one chat-like request stream")
    _add_model_flag(srv, extra=" (with the default model's tokenizer; cuda only unless --device cpu is given)")
    srv.add_argument("--budget-gib", type=_positive_float, default=0.25, help="cache bytes of every cache")
    srv.add_argument("--max-seq-len", type=positive_int, default=2048,
                     help="tokens per static row, and the most one request may hold in a paged cache")
    srv.add_argument("--requests", type=positive_int, default=400, help="requests in the stream (more than a run uses)")
    srv.add_argument("--clients", type=positive_int, default=None,
                     help="closed-loop clients (default: the most rows any cache gets, so that each can fill up)")
    srv.add_argument("--duration", type=_positive_float, default=60.0, help="seconds each cache serves the stream")
    srv.add_argument("--caches", type=_serve_caches, default=None,
                     help="comma-separated, from fp,fp-paged,kivi,kivi-paged (default: all four)")
    srv.add_argument("--length-scale", type=_positive_float, default=1.0,
                     help="multiply the trace's mean prompt and output lengths (ShareGPT: 161 + 338 tokens)")
    srv.add_argument("--shared-prefix", type=int, default=0,
                     help="every prompt starts with the same system prompt of this many tokens (e.g. 300)")
    srv.add_argument("--prefix-chunk", type=positive_int, default=None,
                     help="paged caches: prefix caching (kivi serve --prefix-caching) in chunks of this many tokens "
                          "(rounded up to a multiple of the page size); default: off")
    srv.add_argument("--residual-length", type=positive_int, default=128, help="KIVI's R (G stays 32)")
    srv.add_argument("--page-size", type=positive_int, default=None,
                     help="paged KIVI's page size (default: the paged cache's); paged fp uses 16")
    srv.add_argument("--compile", action="store_true", help="compile the decode step (as kivi serve --compile)")
    srv.add_argument("--max-rows", type=positive_int, default=256,
                     help="the most rows a paged cache gets (its rows' fixed state, KIVI's R-token window, comes out "
                          "of the budget before its pages)")
    srv.add_argument("--steady-fill", type=_fraction, default=None,
                     help="the steady-state window starts when the server first decodes a batch of this share of "
                          "the largest batch of the run (the startup fill done; default 0.9)")
    srv.add_argument("--warmup-turnover", type=float, default=None,
                     help="and only after this many completed requests per row of the largest batch (default 1.0: "
                          "the initial fill's sequences replaced once on average; 0: from the fill on)")

    hfg = bsub.add_parser("hf-generate", help="transformers' model.generate(): DynamicCache, quanto's QuantizedCache "
                                              "and our KIVI-2 cache (compiled and eager), decode tokens/s, side by side in one run")
    hfg.add_argument("--contexts", type=int_list, default=[1024, 8192],
                     help="prompt tokens (clipped to the model's positions minus --new-tokens)")
    hfg.add_argument("--batches", type=_int_list_any, default=[1, 4])
    hfg.add_argument("--new-tokens", type=positive_int, default=64)
    hfg.add_argument("--caches", type=_cache_list, default=None,
                     help="comma-separated, from dynamic,quanto,kivi_eager,kivi (default: all; quanto where "
                          "optimum-quanto is installed)")
    hfg.add_argument("--rounds", type=positive_int, default=1,
                     help="runs per cache, the caches taking turns; each cache's best run is reported (on a "
                          "shared machine 2 or more keep a busy moment from deciding a ratio)")

    hfg.add_argument("--threads", type=positive_ints, default=None,
                     help="comma-separated torch CPU thread counts, each measured in turn for every row, e.g. 1,2 "
                          "(default: torch's, one per core); each result row says its count")

    for p in (att, dec, wq, srv):
        p.add_argument("--threads", type=positive_int, default=None,
                       help="torch CPU threads (default: torch's, one per core). On a CPU other work is using, "
                            "1 avoids OpenMP oversubscription, which slows every row several-fold and erratically")

    for p in (mem, att, dec, wq, srv, hfg):
        p.add_argument("--device", choices=("cpu", "cuda"), default=None)
        p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                       help=f"output folder (default ./{DEFAULT_OUT}; the committed results: --out benchmarks/results)")
        p.add_argument("--json", action="store_true", help="print the result object")
        p.set_defaults(func=cmd_bench, parser=p)


def _add_model_flag(parser, extra: str = "") -> None:
    parser.add_argument("--model", default="default",
                        help=f"'default', '{SHAPE_7B}' (random weights{extra}), a GGUF file or a directory")


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def _fraction(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _serve_caches(text: str) -> list[str]:
    import argparse

    from kivi_benchmarks.serve_bench import CACHES

    caches = [x for x in text.split(",") if x]
    if not caches or any(c not in CACHES for c in caches):
        raise argparse.ArgumentTypeError(f"expected comma-separated caches from {','.join(CACHES)}, got {text!r}")
    return caches


def _int_list_any(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _cache_list(text: str) -> list[str]:
    import argparse

    from kivi_benchmarks.hf_generate_bench import CACHES

    caches = [x for x in text.split(",") if x]
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches or "dynamic" not in caches:
        raise argparse.ArgumentTypeError(f"expected comma-separated caches from {', '.join(CACHES)}, dynamic among "
                                         f"them (the baseline), got {text!r}")
    return caches


def _mode_list(text: str) -> list[str]:
    import argparse

    from kivi_models.weight_quant import WEIGHT_QUANT_MODES

    modes = [x for x in text.split(",") if x]
    bad = [m for m in modes if m not in WEIGHT_QUANT_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected comma-separated modes from {', '.join(WEIGHT_QUANT_MODES)}, "
                                         f"got {text!r}")
    return modes


def _device(args, parser) -> str:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was requested but no CUDA device is available")
    return device


def cmd_bench(args, parser) -> int:
    from kivi_benchmarks import perf
    from kivi_benchmarks.plots import plot_bench

    device = _device(args, parser)
    if getattr(args, "threads", None) and args.bench_command != "hf-generate":  # hf-generate: a list, per row
        import torch

        torch.set_num_threads(args.threads)
    if args.bench_command == "memory":
        with usage_errors(parser):
            result = perf.bench_memory(args.contexts, sink_tokens=args.sink_tokens, outlier_tokens=args.outlier_tokens,
                                       sparse_outliers=args.sparse_outliers)
        if args.budget_gib:
            result["budget_gib"] = args.budget_gib
            budget = args.budget_gib * 2**30
            for row in result["rows"]:
                row["max_batch_kivi"] = perf.max_batch_for_budget(row["kivi_bytes"], budget)
                row["max_batch_fp16"] = perf.max_batch_for_budget(row["fp16_bytes"], budget)
        from kivi_benchmarks.paged_memory import bench_paged_memory

        result["serving"] = bench_paged_memory(args.budget_gib or 40.0)
        name = "bench_memory"
    elif args.bench_command == "attention":
        contexts = args.contexts or ([1024 * 2**i for i in range(8)] if device == "cuda" else [1024, 4096, 16384])
        result = perf.bench_attention(device, contexts, batch=args.batch or (8 if device == "cuda" else 1))
        name = f"bench_attention_{device}"
    elif args.bench_command == "decode":
        if args.budget_gib and args.batches:
            parser.error("--batches and --budget-gib exclude each other: the budget picks each cache's batch")
        if args.max_batch and not args.budget_gib:
            parser.error("--max-batch applies only with --budget-gib")
        check_weight_quant_modes([args.weight_quant], device, parser)
        model = _quantized(_bench_model(args, device, parser)[0], args.weight_quant, parser)
        if args.budget_gib:
            with usage_errors(parser):
                result = perf.bench_budget(model, device=device, contexts=args.contexts or [1024],
                                           budget_bytes=args.budget_gib * 2**30, new_tokens=args.new_tokens,
                                           max_batch=args.max_batch)
            result["budget_gib"] = args.budget_gib
        else:
            result = perf.bench_decode(model, device=device, contexts=args.contexts or [1024, 4096],
                                       batches=args.batches or [1, 4], new_tokens=args.new_tokens)
        result.update(model=args.model, weight_quant=args.weight_quant)
        name = (f"bench_budget_{device}" if args.budget_gib else f"bench_decode_{device}") + (
            "" if args.weight_quant == "none" else f"_{args.weight_quant}")
    elif args.bench_command == "serve":
        from kivi_ops import KIVIConfig

        from kivi_benchmarks.environment import environment
        from kivi_benchmarks.serve_bench import CACHES, bench_serve

        if args.shared_prefix < 0:
            parser.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
        if args.model == SHAPE_7B and device == "cpu" and args.device != "cpu":
            # 6.7B float32 parameters are 27 GB, more than most hosts have, and would serve a few
            # tokens a minute: only an explicit --device cpu builds them there.
            parser.error(f"--model {SHAPE_7B} is 6.7B random parameters (27 GB in float32 on the CPU) and is meant "
                         "for --device cuda (float16, 13.5 GB); no CUDA device is here: use --model default or a "
                         "GGUF file, or pass --device cpu to build it on the CPU anyway")
        model, tokenizer = _bench_model(args, device, parser, with_tokenizer=True)
        with usage_errors(parser):
            result = bench_serve(model, tokenizer, budget_bytes=args.budget_gib * 2**30, max_seq_len=args.max_seq_len,
                                 requests=args.requests, clients=args.clients,
                                 kivi_config=KIVIConfig(residual_length=args.residual_length), compile=args.compile,
                                 caches=args.caches or CACHES, duration=args.duration, length_scale=args.length_scale,
                                 shared_prefix=args.shared_prefix, page_size=args.page_size, max_rows=args.max_rows,
                                 prefix_chunk=args.prefix_chunk,
                                 **({} if args.steady_fill is None else dict(steady_fill=args.steady_fill)),
                                 **({} if args.warmup_turnover is None else dict(warmup_turnover=args.warmup_turnover)))
        result.update(device=device, model=args.model, model_shape=_model_shape(model), compile=args.compile,
                      budget_gib=args.budget_gib, environment=environment(device))
        name = (f"bench_serve_{device}" + (f"_prefix{args.shared_prefix}" if args.shared_prefix else "")
                + (f"_shared{args.prefix_chunk}" if args.prefix_chunk else ""))
    elif args.bench_command == "hf-generate":
        import torch

        from kivi_models import load_model

        from kivi_benchmarks.hf_generate_bench import bench_hf_generate

        model, tokenizer = load_model(dtype=torch.float16 if device == "cuda" else torch.float32, device=device)
        name = f"bench_hf_generate_{device}"

        # The rows so far ("complete": false) go beside the result, not over it: a run cut off keeps its
        # rows without replacing an earlier complete result in --out; the finished run removes the file.
        partial_path = args.out / f"{name}.partial.json"

        def save_partial(partial: dict) -> None:
            args.out.mkdir(parents=True, exist_ok=True)
            partial_path.write_text(json.dumps(dict(partial, model="default"), indent=2))

        with usage_errors(parser):
            result = bench_hf_generate(model, tokenizer, contexts=args.contexts, batches=args.batches,
                                       new_tokens=args.new_tokens, caches=args.caches, rounds=args.rounds,
                                       threads=args.threads, on_row=save_partial)
        result["model"] = "default"
    else:
        modes = args.modes or (["none", "int8", "int4"] if device == "cuda" else ["none", "int8"])
        check_weight_quant_modes(modes, device, parser)
        result = perf.bench_weight_quant(lambda mode: _quantized(_bench_model(args, device, parser)[0], mode, parser),
                                         device=device, contexts=args.contexts, batches=args.batches,
                                         weight_modes=modes, new_tokens=args.new_tokens)
        result["model"] = args.model
        name = f"bench_weight_quant_{device}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    if args.bench_command == "hf-generate":
        partial_path.unlink(missing_ok=True)
    if args.bench_command == "weight-quant":
        (args.out / f"{name}.md").write_text(perf.weight_quant_markdown(result))
        written = f"{name}.md"
    elif args.bench_command == "memory":
        from kivi_benchmarks.paged_memory import paged_memory_markdown

        plot_bench(name, _plot_view(result), args.out / f"{name}.png")
        (args.out / f"{name}_serving.md").write_text(paged_memory_markdown(result["serving"]))
        written = f"{name}.png and {name}_serving.md"
    elif args.bench_command == "serve":
        from kivi_benchmarks.serve_bench import plot_serve

        plot_serve(result, args.out / f"{name}.png")
        written = f"{name}.png"
    elif args.bench_command == "hf-generate":
        from kivi_benchmarks.hf_generate_bench import plot_hf_generate

        plot_hf_generate(result, args.out / f"{name}.png")
        written = f"{name}.png"
    else:
        plot_bench(name, _plot_view(result), args.out / f"{name}.png")
        written = f"{name}.png"
    if args.json:
        print(dumps_json(result))
    else:
        print_table("budget" if name.startswith("bench_budget") else args.bench_command, result)
        print(f"\nwrote {(args.out / (name + '.json')).resolve()} and {written}")
    return 0


def _plot_view(result: dict) -> dict:
    """The attention plot draws one line per `bits` value of rows: with compiled rows, label the
    eager and compiled lines apart (the JSON keeps them in separate lists)."""
    if result["rows"] and "graph_speedup" in result["rows"][0]:
        rows = [dict(r, bits=f"{r['bits']}, eager") for r in result["rows"]]
        rows += [dict(r, bits=f"{r['bits']}, CUDA graphs", speedup=r["graph_speedup"]) for r in result["rows"]]
        return dict(result, rows=rows)
    if not result.get("compiled_rows"):
        return result
    rows = [dict(r, bits=f"{r['bits']} op vs SDPA, eager") for r in result["rows"]]
    rows += [dict(r, bits=f"{r['bits']} decomposed vs SDPA, both compiled") for r in result["compiled_rows"]]
    return dict(result, rows=rows)


def _quantized(model, mode, parser):
    from kivi_models.weight_quant import apply_weight_quant

    with usage_errors(parser):
        return apply_weight_quant(model, mode)


def _bench_model(args, device, parser, *, with_tokenizer: bool = False):
    """(patched model, tokenizer) for --model: float16 on CUDA, float32 on the CPU. The 7B shape has
    random weights (speed only) and, with with_tokenizer, the default model's tokenizer (None without)."""
    import torch

    from kivi_models import load_model, patch_model

    dtype = torch.float16 if device == "cuda" else torch.float32
    if args.model == SHAPE_7B:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = _default_tokenizer() if with_tokenizer else None
        # The default tokenizer has 49152 ids, Llama-2 32000: the embedding must take every id a
        # prompt holds (a larger LM head, about 1% more weight bytes per step than Llama-2-7B's).
        vocab = max(32000, len(tokenizer)) if tokenizer is not None else 32000
        config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=32, vocab_size=vocab, max_position_embeddings=131072)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()  # random weights: speed only
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    return patch_model(model), tokenizer


def _default_tokenizer():
    from transformers import AutoTokenizer

    from kivi_models.loading import DEFAULT_MODEL, resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL), local_files_only=True)


def _model_shape(model) -> dict:
    """What a result needs to say which model ran: its shape, dtype and parameter count."""
    c = model.config
    return dict(layers=c.num_hidden_layers, hidden_size=c.hidden_size, heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads, vocab_size=c.vocab_size, dtype=str(next(model.parameters()).dtype),
                parameters=sum(p.numel() for p in model.parameters()))


def print_table(kind: str, result: dict) -> None:
    rows = result["rows"]
    if kind == "memory":
        if rows and (rows[0].get("sink_tokens") or rows[0].get("outlier_tokens") or rows[0].get("sparse_outliers")):
            print(f"with sink_tokens={rows[0]['sink_tokens']}, outlier_tokens={rows[0]['outlier_tokens']}, "
                  f"sparse_outliers={rows[0]['sparse_outliers']} (included in KIVI and theory bytes)")
        print("bits  G    R    tokens   KIVI MiB   theory MiB   fp16 MiB   fp16/KIVI")
        for r in rows:
            print(f"{r['bits']:>4} {r['group_size']:>3} {r['residual_length']:>4} {r['tokens']:>8} "
                  f"{r['kivi_bytes'] / 2**20:>10.1f} {r['theory_bytes'] / 2**20:>12.1f} {r['fp16_bytes'] / 2**20:>10.1f} "
                  f"{r['ratio']:>10.2f}")
        if "serving" in result:
            from kivi_benchmarks.paged_memory import paged_memory_markdown

            print()
            print(paged_memory_markdown(result["serving"]))
    elif kind == "attention":
        print("eager: the kivi op vs SDPA")
        print("tokens  bits   SDPA ms   KIVI ms   speedup" + ("   bandwidth share" if "bandwidth_share" in rows[0] else ""))
        for r in rows:
            extra = f"   {r['bandwidth_share']:.0%}" if "bandwidth_share" in r else ""
            print(f"{r['tokens']:>6} {r['bits']:>5} {r['sdpa_s'] * 1e3:>9.3f} {r['kivi_s'] * 1e3:>9.3f} "
                  f"{r['speedup']:>9.2f}x{extra}")
        if "graph_speedup" in rows[0]:
            print("\nreplayed from CUDA graphs (GPU time, no launch overhead), as a decode step runs")
            print("tokens  bits   SDPA ms   KIVI ms   speedup   bandwidth share")
            for r in rows:
                print(f"{r['tokens']:>6} {r['bits']:>5} {r['sdpa_graph_s'] * 1e3:>9.3f} {r['kivi_graph_s'] * 1e3:>9.3f} "
                      f"{r['graph_speedup']:>9.2f}x   {r['graph_bandwidth_share']:.0%}")
        if result.get("compiled_rows"):
            print("\ncompiled: KIVI decomposed attention vs SDPA over a static fp cache (torch.compile, both)")
            print("tokens  bits   SDPA ms   KIVI ms   speedup   (median of per-round ratios)")
            for r in result["compiled_rows"]:
                print(f"{r['tokens']:>6} {r['bits']:>5} {r['sdpa_compiled_s'] * 1e3:>9.3f} "
                      f"{r['kivi_compiled_s'] * 1e3:>9.3f} {r['speedup']:>9.2f}x   ({r['median_round_speedup']:.2f}x)")
    elif kind == "budget":
        print(f"cache budget {result['budget_gib']} GiB; throughput = batch / median decode step")
        print("context   fp batch   fp tok/s   KIVI batch   KIVI tok/s   batch ratio   throughput ratio")
        for r in rows:
            print(f"{r['context']:>7} {r['fp_batch']:>10} {r['fp_median_step_tokens_per_s']:>10.1f} "
                  f"{r['kivi_batch']:>12} {r['kivi_median_step_tokens_per_s']:>12.1f} {r['batch_ratio']:>12.2f}x "
                  f"{r['throughput_ratio']:>17.2f}x")
    elif kind == "weight-quant":
        from kivi_benchmarks.perf import weight_quant_markdown

        print(weight_quant_markdown(result))
    elif kind == "hf-generate":
        from kivi_benchmarks.hf_generate_bench import print_hf_generate

        print_hf_generate(result)
    elif kind == "serve":
        from kivi_benchmarks.serve_bench import serve_markdown

        print(serve_markdown(result))
    else:
        print("batch  context   fp tok/s   KIVI tok/s   KIVI/fp   (median step)")
        for r in rows:
            step = f"   ({r['median_step_speedup']:.2f}x)" if "median_step_speedup" in r else ""
            print(f"{r['batch']:>5} {r['context']:>8} {r['fp_tokens_per_s']:>10.1f} {r['kivi_tokens_per_s']:>12.1f} "
                  f"{r['speedup']:>9.2f}x{step}")
