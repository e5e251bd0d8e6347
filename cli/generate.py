"""`kivi generate`: text generation with a KIVI (or fp) static cache."""

from __future__ import annotations

import time

import torch

from .args import (add_model_arguments, add_prompt_arguments, add_sampling_arguments, bits_report, check_memory,
                   check_weight_quant_modes, device_and_dtype, dumps_json, encode, generation_report, kivi_config_from,
                   print_generations, read_prompts, usage_errors, warn_unused_sampling)
from kivi_models.generate import SamplingConfig, compile_decode_step, decode_step, generate, make_cache
from kivi_models.loading import load_model, log
from kivi_models.parallel import tp_size


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with a KIVI or fp static cache")
    add_prompt_arguments(g, batch_help="a file with one prompt per line (batched generation)")
    add_model_arguments(g)
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    g.add_argument("--allow-beyond-context", action="store_true",
                   help="generate past the model's trained context (max_position_embeddings); refused otherwise")
    add_sampling_arguments(g)
    g.set_defaults(func=cmd_generate, parser=g)


def cmd_generate(args, parser) -> int:
    kivi_config = kivi_config_from(args, parser)
    device, dtype = device_and_dtype(args, parser)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    warn_unused_sampling(args)
    prompts = read_prompts(args, parser)
    from kivi_models.weight_quant import apply_weight_quant, model_weight_nbytes

    check_weight_quant_modes([args.weight_quant], device, parser)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)  # errors: the `kivi` handler (kivi_cli.main)
    from kivi_models.attention import patch_model

    with usage_errors(parser):
        apply_weight_quant(model, args.weight_quant)
    model_bytes = model_weight_nbytes(model)
    patch_model(model)
    ids = [encode(tokenizer, p, args.chat) for p in prompts]
    max_seq_len = max(len(i) for i in ids) + args.max_new_tokens
    context = model.config.max_position_embeddings
    if max_seq_len > context and not args.allow_beyond_context:
        parser.error(f"the longest prompt ({max_seq_len - args.max_new_tokens} tokens) + --max-new-tokens "
                     f"{args.max_new_tokens} = {max_seq_len} exceeds the model's context of {context} tokens "
                     "(max_position_embeddings); shorten them, or pass --allow-beyond-context")
    with usage_errors(parser):  # e.g. --outlier-skip-layers covering every layer of this model
        sized = make_cache(model, method=args.method, batch_size=len(ids), max_seq_len=max_seq_len,
                           kivi_config=kivi_config, device="meta")
    check_memory(sized.nbytes(), device, what=f"the cache ({len(ids)} x {max_seq_len} tokens)")
    cache = make_cache(model, method=args.method, batch_size=len(ids), max_seq_len=max_seq_len, kivi_config=kivi_config)
    step_fn, warmup = decode_step, 0
    if args.compile:
        how = ", CUDA graphs" if device == "cuda" else ", KIVI ops decomposed for Inductor" if args.method == "kivi" else ""
        log(f"Compiling the decode step (torch.compile fullgraph{how}); the first steps are not timed...")
        step_fn, warmup = compile_decode_step(torch.device(device)), 2
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    start = time.perf_counter()
    result = generate(model, ids, max_new_tokens=args.max_new_tokens, cache=cache, sampling=sampling,
                      eos_token_id=eos, pad_token_id=pad, step_fn=step_fn, warmup_steps=warmup, seed=args.seed)
    if args.compile:
        log(f"Compiled and warmed up in {result.compile_s:.1f} s")
    texts, report = generation_report(tokenizer, result)
    config = {"model": args.model, "method": args.method, "device": device, "dtype": str(dtype).replace("torch.", ""),
              "compile": args.compile, "weight_quant": args.weight_quant, "batch_size": len(ids),
              "max_new_tokens": args.max_new_tokens,
              "sampling": vars(sampling), **({"kivi": kivi_config.to_record(args.nuq)} if args.method == "kivi" else {})}
    report.update({
        "compile_s": result.compile_s,
        "cache_bytes": result.cache_bytes,
        "cache_bytes_by_kind": cache.nbytes_by_kind(),  # full-attention and sliding-window layers
        **bits_report(model, args.method, kivi_config, max_seq_len),
        "fp16_cache_bytes": result.fp16_cache_bytes,
        "model_bytes": model_bytes,
        "tp_size": tp_size(model),  # cache_bytes and model_bytes are this rank's share
        "wall_s": time.perf_counter() - start,
        "config": config,
    })
    if args.json:
        print(dumps_json(report))
        return 0
    print_generations(prompts, texts, args.chat)
    ratio = result.fp16_cache_bytes / result.cache_bytes
    print(f"\nprefill: {result.prefill_tokens_per_s:.1f} tokens/s ({sum(result.prompt_tokens)} tokens)")
    print(f"decode:  {result.decode_tokens_per_s:.1f} tokens/s ({result.decode_tokens} timed tokens"
          + (f"; compile + warm-up {result.compile_s:.1f} s not counted" if args.compile else "") + ")")
    weights = ("unquantized" if args.weight_quant == "none"
               else f"{args.weight_quant} weight-only Linear layers (torchao); embeddings and norms {config['dtype']}")
    print(f"model:   {model_bytes / 2**20:.1f} MiB, {weights}")
    extras = "".join([" flush-policy=ott" if kivi_config.flush_policy == "ott" else "",
                      f" sink={kivi_config.sink_tokens}" if kivi_config.sink_tokens else "",
                      f" outliers={kivi_config.outlier_tokens}" if kivi_config.outlier_tokens else "",
                      " pre-RoPE" if kivi_config.pre_rope else "",
                      f" nuq={args.nuq}" if kivi_config.has_nuq else "",
                      f" sparse={kivi_config.sparse_outliers:g}" if kivi_config.sparse_outliers else "",
                      f" rotate-keys={kivi_config.rotate_keys}" if kivi_config.rotate_keys != "none" else "",
                      f" rotate-values={kivi_config.rotate_values}" if kivi_config.rotate_values != "none" else ""])
    widths = ("per-layer widths " + ",".join(f"{k}/{v}" for k, v in kivi_config.layer_bits) if kivi_config.layer_bits
              else f"KIVI-{kivi_config.k_bits}/{kivi_config.v_bits}")
    label = (f"{widths} G={kivi_config.group_size} "
             f"R={kivi_config.residual_length}{extras}, {config['dtype']} scales and residual" if args.method == "kivi"
             else f"fp ({config['dtype']})")
    print(f"cache:   {result.cache_bytes / 2**20:.2f} MiB {label} vs {result.fp16_cache_bytes / 2**20:.2f} MiB "
          f"fp16 for {max_seq_len} tokens x {len(ids)} sequence(s): fp16 / this = {ratio:.2f}x"
          + (" (the full-precision residual window dominates a sequence this short)"
             if ratio < 1 and args.method == "kivi" else ""))
    kinds = cache.nbytes_by_kind()
    if kinds["window"]:
        print(f"         full-attention layers {kinds['full'] / 2**20:.2f} MiB, sliding-window layers "
              f"{kinds['window'] / 2**20:.2f} MiB (each holds its window, full precision)")
    if args.method == "kivi" and context > max_seq_len:
        # Same cache at the model's full context, built on the meta device (no memory).
        full = make_cache(model, method="kivi", batch_size=len(ids), max_seq_len=context, kivi_config=kivi_config,
                          device="meta")
        print(f"         at the full {context}-token context: {full.nbytes() / 2**20:.1f} MiB vs "
              f"{full.fp16_nbytes() / 2**20:.1f} MiB fp16 ({full.fp16_nbytes() / full.nbytes():.2f}x smaller)")
    return 0
