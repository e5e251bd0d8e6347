"""`kivi bench memory | attention | decode`: cache bytes, fused attention speed, end-to-end decode speed.

Every ratio is measured side by side in one run. GPU timings use triton.testing.do_bench (warm-up,
median over many repeats); CPU timings take the median of repeated wall-clock runs. Inputs are
random, never zeros. Results carry the device, versions, git sha and the exact command.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kivi_models.generate import cache_bytes_per_sequence
from kivi_ops import KIVICache, KIVIConfig, dispatch, fp16_cache_nbytes

from .environment import environment
from .perplexity import cache_bits_per_element, stored_bits_per_element

# Llama-2-7B's attention shape: 32 layers, 32 KV heads, head_dim 128.
LLAMA2_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128)


# ---------------------------------------------------------------- memory


def theoretical_kivi_bytes(cfg: KIVIConfig, *, tokens: int, num_layers: int, num_kv_heads: int, head_dim: int,
                           scale_bytes: int = 2, batch_size: int = 1) -> int:
    """The paper's accounting: packed codes, a scale and zero per group, the fp residual window;
    with sink / OTT outlier tokens, each layer's pool too: P slots of exact key + value and an
    int64 position per (sequence, kv head), P = sink + outlier + spill (no outliers in the
    first outlier_skip_layers layers); with KVQuant's dense-and-sparse outliers, nk exact entries
    per channel per flushed R-window and nv per value token, each a value and an int16 index."""
    D, G = head_dim, cfg.group_size
    per_head = (tokens * D * (cfg.k_bits + cfg.v_bits) // 8          # codes
                + 2 * math.ceil(tokens / G) * D * scale_bytes          # key scale + zero per (G tokens, channel)
                + 2 * tokens * (D // min(G, D)) * scale_bytes          # value scale + zero per (token, G channels)
                + 2 * min(cfg.residual_slots(), tokens) * D * scale_bytes)  # key and value residual rings
    nk, nv = cfg.sparse_counts(D)
    per_head += (tokens // cfg.residual_length * nk * D + tokens * nv) * (scale_bytes + 2)
    pool_slots = sum(cfg.layer_pool_size(layer) for layer in range(num_layers))
    pool = batch_size * num_kv_heads * pool_slots * (2 * D * scale_bytes + 8)
    return num_layers * batch_size * (num_kv_heads * per_head + 8) + pool  # + the int64 length per sequence


def bench_memory(contexts=(1024, 4096, 16384, 32768, 131072), sink_tokens: int = 0, outlier_tokens: int = 0,
                 sparse_outliers: float = 0.0) -> dict:
    """Exact bytes of KIVICache (meta device) vs the formula vs fp16; sink_tokens / outlier_tokens
    (OTT, paper defaults otherwise: spill 32, none in the first two layers) and sparse_outliers
    (KVQuant's dense-and-sparse fraction) apply to every row."""
    rows = []
    for bits in (2, 4):
        for G in (32, 128):
            for R in (32, 128):
                if R % G:
                    continue  # keys flush whole groups: R must be a multiple of G (G=128, R=32 is invalid)
                cfg = KIVIConfig(bits, bits, G, R, sink_tokens=sink_tokens, outlier_tokens=outlier_tokens,
                                 sparse_outliers=sparse_outliers)
                for n in contexts:
                    cache = KIVICache(cfg, max_seq_len=n, batch_size=1, dtype=torch.float16, device="meta",
                                      **LLAMA2_7B)
                    fp16 = fp16_cache_nbytes(batch_size=1, num_tokens=n, **LLAMA2_7B)
                    rows.append(dict(bits=bits, group_size=G, residual_length=R, tokens=n, sink_tokens=sink_tokens,
                                     outlier_tokens=outlier_tokens, sparse_outliers=sparse_outliers,
                                     kivi_bytes=cache.nbytes(), theory_bytes=theoretical_kivi_bytes(cfg, tokens=n, **LLAMA2_7B),
                                     fp16_bytes=fp16, ratio=fp16 / cache.nbytes(),
                                     bits_per_element=stored_bits_per_element(cache, n)))
    return dict(model_shape=LLAMA2_7B, scale_dtype="float16", rows=rows, environment=environment("cpu"))


# ---------------------------------------------------------------- attention


def median_time(fn, device: str = "cpu", repeats: int = 30) -> float:
    """Median seconds of fn() (after one warm-up call on CPU; Triton's do_bench on CUDA)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_graph_time(fn) -> float:
    """Median seconds of fn() captured in a CUDA graph and replayed (no host overhead)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device, 5)
    return 2 * src.numel() * src.element_size() / t


def attend_read_bytes(cache: KIVICache, tokens: int) -> int:
    """Bytes the fused op must read for one decode step at `tokens` context (all batch rows)."""
    c = cache.config
    one = KIVICache(c, num_layers=1, batch_size=cache.batch_size, max_seq_len=tokens,
                    num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, dtype=cache.dtype, device="meta")
    return one.nbytes()


def bench_attention(device: str, contexts, bits_list=(2, 4), batch: int = 1, q_heads: int = 32, kv_heads: int = 32,
                    head_dim: int = 128, repeats: int = 20, compiled: bool | None = None) -> dict:
    """Eager rows: the kivi op (fused kernel on CUDA, reference on CPU) vs SDPA, per bits.
    compiled (default: on CPU): also `compiled_rows`, KIVI-2's decomposed attention
    (kivi_ops/kernels/decomposed/attend.py, what compiled CPU decode runs) under torch.compile vs compiled SDPA
    over a static fp cache with a length mask (what FPCache runs), timed round by round."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    compiled = device == "cpu" if compiled is None else compiled
    bandwidth = copy_bandwidth(device) if device == "cuda" else None
    load_before = os.getloadavg()  # the CPU may be shared: record how busy it was
    rows, compiled_rows = [], []
    if compiled:
        torch.compiler.reset()
    for n in tqdm(contexts, desc="attention", leave=False):
        k = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(batch, q_heads, 1, head_dim, device=device, dtype=dtype)
        sdpa = median_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device, repeats)
        for bits in bits_list:
            cache = KIVICache(KIVIConfig(bits, bits, 32, 128), num_layers=1, batch_size=batch, max_seq_len=n,
                              num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
            layer = cache.layers[0]
            layer.append(k, v)
            t = median_time(lambda: layer.attend(q), device, repeats)
            row = dict(tokens=n, bits=bits, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                       sdpa_s=sdpa, kivi_s=t, speedup=sdpa / t)
            if bandwidth:
                # Eager timings include the host's launch overhead (Python checks, op dispatch:
                # about 0.5 ms here), which hides the kernels at short contexts. A decode step runs
                # under CUDA graphs, so both are also timed replayed from a graph: GPU time only.
                sdpa_graph = _median_graph_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                kivi_graph = _median_graph_time(lambda: layer.attend(q))
                read = attend_read_bytes(cache, n)
                # bandwidth counts read + written bytes: the DRAM traffic rate a copy achieves
                row.update(read_bytes=read, achieved_bytes_per_s=read / t, copy_bandwidth=bandwidth,
                           bandwidth_share=read / t / bandwidth, sdpa_graph_s=sdpa_graph, kivi_graph_s=kivi_graph,
                           graph_speedup=sdpa_graph / kivi_graph, graph_bandwidth_share=read / kivi_graph / bandwidth)
            rows.append(row)
            if compiled and bits == 2:
                compiled_rows.append(_compiled_attention_row(cache, q, k, v, repeats, device))
            del cache, layer
        del k, v
    result = dict(device=device, dtype=str(dtype), rows=rows, environment=environment(device))
    if compiled:
        result["compiled_rows"] = compiled_rows
    result["environment"].update(load_average_before=load_before, load_average_after=os.getloadavg())
    return result


def _sdpa_static_cache(query, k, v, lengths):
    """fp static-cache decode attention as kivi_ops/cache/fp_layer.py runs it: keys t < lengths visible."""
    t = torch.arange(k.shape[2], device=query.device)
    visible = t[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(query, k, v, attn_mask=visible[:, None, None, :], enable_gqa=True)


def _attend(layer, query):
    return layer.attend(query)


def _compiled_attention_row(cache: KIVICache, q, k, v, repeats: int, device: str) -> dict:
    """Compiled KIVI decomposed attention vs compiled SDPA on the same data (cache holds k, v)."""
    B, Hq, _, D = q.shape
    n = k.shape[2]
    lengths = torch.full((B,), n, dtype=torch.int64, device=device)
    sdpa_c = torch.compile(_sdpa_static_cache, fullgraph=True, dynamic=False)
    kivi_c = torch.compile(_attend, fullgraph=True, dynamic=False)
    layer = cache.layers[0]
    reference = layer.attend(q)  # eager: the kivi op
    # Compiled on CPU, the cache runs its decomposed attention (kivi_ops/dispatch/__init__.py).
    fns = dict(sdpa=lambda: sdpa_c(q, k, v, lengths), kivi=lambda: kivi_c(layer, q))
    start = time.perf_counter()
    diff = (fns["kivi"]() - reference).abs().max().item()
    fns["sdpa"]()
    compile_s = time.perf_counter() - start
    times = interleaved_times(fns, device, repeats)
    sdpa_s, kivi_s = statistics.median(times["sdpa"]), statistics.median(times["kivi"])
    return dict(tokens=n, bits=cache.config.k_bits, impl=dispatch.compiled_decode(device)["attend"], batch=B, q_heads=Hq,
                kv_heads=cache.num_kv_heads, head_dim=D, sdpa_compiled_s=sdpa_s, kivi_compiled_s=kivi_s,
                speedup=sdpa_s / kivi_s,
                median_round_speedup=statistics.median(a / b for a, b in zip(times["sdpa"], times["kivi"])),
                max_abs_diff_vs_op=diff, compile_s=compile_s)


def interleaved_times(fns: dict, device: str, repeats: int, warmup: int = 3) -> dict:
    """Seconds per call of each fn, the fns alternating round by round (a busy neighbour hits
    them alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------- decode


def _random_prompts(model, batch: int, context: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).tolist()


def measure_decode(model, prompts, *, device: str, method: str, new_tokens: int, kivi_config,
                   warmup_steps: int = 3) -> dict:
    """Compiled decode of `prompts` with a fresh `method` cache, one generation of new_tokens:
    tokens/s over the steps after the compile + warm-up steps (total tokens / total time, as
    generate() reports it), tokens/s of the median step (batch / median step time), cache bytes,
    CUDA peak bytes."""
    from kivi_models import compile_decode_step, generate, make_cache

    cache = make_cache(model, method=method, batch_size=len(prompts), max_seq_len=len(prompts[0]) + new_tokens,
                       kivi_config=kivi_config)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    compiled, step_times = compile_decode_step(torch.device(device)), []

    def timed_step(*args):
        start = time.perf_counter()
        logits = compiled(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
        return logits

    r = generate(model, prompts, max_new_tokens=new_tokens, cache=cache, step_fn=timed_step, warmup_steps=warmup_steps)
    timed = step_times[warmup_steps:]
    out = dict(tokens_per_s=r.decode_tokens_per_s, median_step_tokens_per_s=len(prompts) / statistics.median(timed),
               timed_steps=len(timed), compile_and_warmup_s=r.compile_s, prefill_s=r.prefill_s,
               cache_bytes=cache.nbytes())
    if device == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def kivi_bits(model, kivi_config, tokens: int) -> dict:
    """A result row's KIVI cache bits per element (`kivi eval --json`'s bits_per_element:
    perplexity.cache_bits_per_element) for one sequence of `tokens`, the length the cache holds."""
    return dict(kivi_bits_per_element=cache_bits_per_element(model, "kivi", kivi_config, tokens),
                bits_per_element_tokens=tokens)


def bench_decode(model, *, device: str, contexts, batches, new_tokens: int = 32, kivi_config=None) -> dict:
    """Compiled decode tokens/s, fp vs KIVI, same model, same run (CUDA graphs on GPU)."""
    kivi_config = kivi_config or KIVIConfig()
    load_before = os.getloadavg()  # the CPU may be shared: record how busy it was
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        for n in contexts:
            prompts = _random_prompts(model, batch, n, gen)
            row = dict(batch=batch, context=n, new_tokens=new_tokens,
                       **kivi_bits(model, kivi_config, n + new_tokens))
            for method in ("fp", "kivi"):
                torch.compiler.reset()  # one compiled graph per row: no recompile limit, no stale guards
                m = measure_decode(model, prompts, device=device, method=method, new_tokens=new_tokens,
                                   kivi_config=kivi_config)
                row[f"{method}_tokens_per_s"] = m["tokens_per_s"]
                row[f"{method}_median_step_tokens_per_s"] = m["median_step_tokens_per_s"]
                row[f"{method}_cache_bytes"] = m["cache_bytes"]
                if device == "cuda":
                    row[f"{method}_peak_bytes"] = m["peak_bytes"]
            row["speedup"] = row["kivi_tokens_per_s"] / row["fp_tokens_per_s"]
            row["median_step_speedup"] = row["kivi_median_step_tokens_per_s"] / row["fp_median_step_tokens_per_s"]
            row["load_average"] = os.getloadavg()[0]  # 1-minute, when the row finished
            print(f"  batch {batch} context {n}: fp {row['fp_tokens_per_s']:.1f} tok/s, "
                  f"KIVI {row['kivi_tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x; median step "
                  f"{row['median_step_speedup']:.2f}x; load {row['load_average']:.2f})", file=sys.stderr, flush=True)
            rows.append(row)
    env = environment(device)
    env.update(load_average_before=load_before, load_average_after=os.getloadavg())
    # What the compiled KIVI steps run (kivi_models.compile_decode_step), as kivi_ops.dispatch decides.
    return dict(device=device, kivi=kivi_config.to_dict(), kivi_compiled_impl=dispatch.compiled_decode(device),
                rows=rows, environment=env)


# ---------------------------------------------------------------- memory budget (KIVI Figure 16)


def max_batch_for_budget(per_sequence_bytes: int, budget_bytes: float) -> int:
    """The largest batch whose cache fits the budget (0 if not even one sequence does)."""
    return int(budget_bytes // per_sequence_bytes)


def fill_cache_randomly(cache, context: int, gen: torch.Generator, chunk: int = 1024) -> None:
    """Store `context` random (never zero) keys/values per sequence in every layer, `chunk` tokens
    per append: what a prefill would leave behind, without a prefill's activations (a batch of
    90 x 4K prompt tokens through a 7B model would need far more memory than its cache). Decode
    speed does not depend on the values, only on how many tokens the cache holds."""
    B, H, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    for layer in cache.layers:
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            k = torch.randn(B, H, n, D, generator=gen, device=gen.device, dtype=cache.dtype)
            layer.append(k, torch.randn_like(k))


def measure_filled_decode(model, *, device: str, method: str, batch: int, context: int, new_tokens: int,
                          kivi_config=None, warmup_steps: int = 3) -> dict:
    """Compiled decode steps (CUDA graphs on GPU) over a cache holding `context` random tokens per
    sequence: tokens/s of the median step after compile + warm-up, cache bytes, CUDA peak bytes."""
    from kivi_models import compile_decode_step, make_cache

    cache = make_cache(model, method=method, batch_size=batch, max_seq_len=context + new_tokens,
                       kivi_config=kivi_config)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        fill_cache_randomly(cache, context, gen)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step = compile_decode_step(torch.device(device))
        tokens = torch.randint(3, model.config.vocab_size, (batch,), generator=gen, device=device)
        positions = torch.full((batch,), context, dtype=torch.int64, device=device)
        times = []
        for _ in range(new_tokens):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = step(model, cache, tokens, positions).argmax(dim=-1)
            positions += 1
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    timed = times[warmup_steps:]
    out = dict(batch=batch, tokens_per_s=batch * len(timed) / sum(timed),
               median_step_tokens_per_s=batch / statistics.median(timed), timed_steps=len(timed),
               compile_and_warmup_s=sum(times[:warmup_steps]), cache_bytes=cache.nbytes())
    if device == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    del cache
    return out


def bench_budget(model, *, device: str, contexts, budget_bytes: float, new_tokens: int = 32,
                 max_batch: int | None = None, kivi_config=None) -> dict:
    """KIVI's Figure 16: the largest batch whose cache fits `budget_bytes` with the fp static cache
    and with KIVI, and the decode throughput (tokens/s, all rows) at that batch, side by side per
    context. The cache holds context + new_tokens tokens per sequence."""
    kivi_config = kivi_config or KIVIConfig()
    rows = []
    for n in contexts:
        row = dict(context=n, new_tokens=new_tokens, budget_bytes=budget_bytes,
                   **kivi_bits(model, kivi_config, n + new_tokens))
        for method in ("fp", "kivi"):
            per_seq = cache_bytes_per_sequence(model, method=method, tokens=n + new_tokens, kivi_config=kivi_config)
            batch = max_batch_for_budget(per_seq, budget_bytes)
            row[f"{method}_bytes_per_sequence"] = per_seq
            row[f"{method}_max_batch"] = batch
            if max_batch is not None:
                batch = min(batch, max_batch)
            if batch == 0:
                raise ValueError(f"budget {budget_bytes / 2**30:.2f} GiB does not hold one {method} sequence of "
                                 f"{n + new_tokens} tokens ({per_seq / 2**30:.2f} GiB); raise --budget-gib")
            # Free the previous cache before allocating the next: it sits in a reference cycle
            # (the transformers Cache and its layer views), and compiled graphs / CUDA-graph pools
            # hold it until reset.
            torch.compiler.reset()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            m = measure_filled_decode(model, device=device, method=method, batch=batch, context=n,
                                      new_tokens=new_tokens, kivi_config=kivi_config)
            row.update({f"{method}_{k}": v for k, v in m.items()})
        row["batch_ratio"] = row["kivi_batch"] / row["fp_batch"]
        row["throughput_ratio"] = row["kivi_median_step_tokens_per_s"] / row["fp_median_step_tokens_per_s"]
        print(f"  context {n}: fp batch {row['fp_batch']} {row['fp_median_step_tokens_per_s']:.1f} tok/s, "
              f"KIVI batch {row['kivi_batch']} {row['kivi_median_step_tokens_per_s']:.1f} tok/s "
              f"({row['batch_ratio']:.2f}x batch, {row['throughput_ratio']:.2f}x throughput)", file=sys.stderr,
              flush=True)
        rows.append(row)
    return dict(device=device, kivi=kivi_config.to_dict(), kivi_compiled_impl=dispatch.compiled_decode(device),
                budget_bytes=budget_bytes,
                max_batch=max_batch, rows=rows, environment=environment(device))


# ---------------------------------------------------------------- weight quantization x cache


def bench_weight_quant(load_model_fn, *, device: str, contexts, batches, weight_modes=("none", "int8"),
                       new_tokens: int = 32, kivi_config=None) -> dict:
    """{weight modes} x {fp static cache, KIVI} compiled decode in one run: model bytes (real, packed
    weights + scales), cache bytes at the measured context, decode tokens/s of the median step
    after compile + 3 warm-up steps (and the mean over those steps).

    load_model_fn(mode) returns a fresh patched model with its weights quantized by `mode` (see
    kivi_models.weight_quant.apply_weight_quant): quantization is in place and one-way, so each mode
    gets its own copy; all copies are loaded first, and for each (batch, context) the configurations
    run back to back, so a change in the machine's load hits them alike. The same random prompts go
    to every configuration. torch.compile's caches are reset between configurations so that none
    hits the recompile limit."""
    from kivi_models.weight_quant import model_weight_nbytes

    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    kivi_config = kivi_config or KIVIConfig()
    load_before = os.getloadavg()  # the CPU is shared: a busy machine slows every row, record it
    rows = []
    models = {mode: load_model_fn(mode) for mode in weight_modes}
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        for n in contexts:
            prompts = _random_prompts(models[weight_modes[0]], batch, n, gen)
            for mode, model in models.items():
                model_bytes = model_weight_nbytes(model)
                for method in ("fp", "kivi"):
                    torch.compiler.reset()
                    start = time.perf_counter()
                    m = measure_decode(model, prompts, device=device, method=method, new_tokens=new_tokens,
                                       kivi_config=kivi_config)
                    row = dict(weights=mode, cache=method, batch=batch, context=n, new_tokens=new_tokens,
                               bits_per_element=cache_bits_per_element(model, method, kivi_config, n + new_tokens),
                               bits_per_element_tokens=n + new_tokens, model_bytes=model_bytes, **m,
                               total_bytes=model_bytes + m["cache_bytes"], seconds=time.perf_counter() - start)
                    rows.append(row)
                    print(f"  weights {mode:>4}, {method:>4} cache, batch {batch} context {n}: "
                          f"{row['median_step_tokens_per_s']:.2f} tok/s (median step), "
                          f"model {model_bytes / 2**20:.1f} MiB + cache {row['cache_bytes'] / 2**20:.1f} MiB "
                          f"({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    del models
    base = {(r["batch"], r["context"]): r for r in rows if r["weights"] == "none" and r["cache"] == "fp"}
    for r in rows:
        b = base.get((r["batch"], r["context"]))
        if b:
            r["speedup_vs_fp"] = r["median_step_tokens_per_s"] / b["median_step_tokens_per_s"]
            r["memory_vs_fp"] = r["total_bytes"] / b["total_bytes"]
    env = environment(device)
    env.update(torchao=torchao_version, load_average_before=load_before, load_average_after=os.getloadavg())
    return dict(device=device, kivi=kivi_config.to_dict(), weight_modes=list(weight_modes), rows=rows,
                environment=env)


def weight_quant_markdown(result: dict) -> str:
    env = result["environment"]
    k = result["kivi"]
    lines = [f"# Weight quantization x KV cache, compiled decode ({result['device']})", "",
             f"Model `{result.get('model', '')}`; KIVI-{k['k_bits']}/{k['v_bits']} G={k['group_size']} "
             f"R={k['residual_length']}. Decode tok/s: batch / median step time over the "
             f"{result['rows'][0]['timed_steps']} steps after compile and 3 warm-up steps (mean over those steps "
             "beside it). Model bytes: real storage, quantized weights as their integer data + scales + zero points. "
             "Cache bytes: the static cache for context + new tokens. All rows from one process.", "",
             "| weights | cache | batch | context | model MiB | cache MiB | model + cache MiB | vs fp/fp "
             "| decode tok/s (median step) | (mean) | vs fp/fp |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        cache = "fp static" if r["cache"] == "fp" else f"KIVI-{k['k_bits']}"
        weights = "fp" if r["weights"] == "none" else r["weights"]
        lines.append(f"| {weights} | {cache} | {r['batch']} | {r['context']} | {r['model_bytes'] / 2**20:.1f} "
                     f"| {r['cache_bytes'] / 2**20:.1f} | {r['total_bytes'] / 2**20:.1f} "
                     f"| {r.get('memory_vs_fp', float('nan')):.2f}x | {r['median_step_tokens_per_s']:.2f} "
                     f"| {r['tokens_per_s']:.2f} "
                     f"| {r.get('speedup_vs_fp', float('nan')):.2f}x |")
    lines += ["", f"Device {env['device']}, {env['threads']} threads; torch {env['torch']}, torchao {env['torchao']}, "
              f"git {env['git_sha']}; 1-minute load average {env['load_average_before'][0]:.1f} before, "
              f"{env['load_average_after'][0]:.1f} after", "", f"Command: `{env['command']}`", ""]
    return "\n".join(lines)
