"""Static-cache generation, gpt-fast style: one prefill, then a decode step that compiles once
(right-padded batches, positions as tensors: no per-token Python int reaches the compiled step)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from kivi_ops import FPCache, KIVICache, KIVIConfig, StaticCacheBase, Step
from kivi_ops.dispatch.compile_budget import compile_own_code, signature
from kivi_ops.options.rope import model_rope_frequencies

from .parallel import local_kv_heads, rank
from .windows import layer_windows

METHODS = ("fp", "kivi")


def local_kivi_config(model, kivi_config: KIVIConfig) -> KIVIConfig:
    """kivi_config with its calibrated rotations cut to this rank's KV heads."""
    rotations, local = kivi_config.rotations, local_kv_heads(model)
    if rotations is None or rotations.shape[1] == local:
        return kivi_config
    return dataclasses.replace(kivi_config, rotations=rotations.heads(rank() * local, local))


def make_cache(model, *, method: str, batch_size: int, max_seq_len: int,
               kivi_config: Optional[KIVIConfig] = None, device=None, portable: bool = False,
               dtype: Optional[torch.dtype] = None) -> StaticCacheBase:
    """A static KIVICache or FPCache for the patched `model` (device "meta" sizes one without allocating)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dims = dict(num_layers=cfg.num_hidden_layers, batch_size=batch_size, max_seq_len=max_seq_len,
                num_kv_heads=local_kv_heads(model), head_dim=head_dim, dtype=dtype or model.dtype, device=device or model.device,
                windows=layer_windows(model))
    if method == "kivi":
        kivi_config = local_kivi_config(model, kivi_config or KIVIConfig())
        rope = {}
        if kivi_config.pre_rope:
            inv_freq, scaling = model_rope_frequencies(model)
            rope = dict(rope_inv_freq=inv_freq, rope_scaling=scaling)
        cache = KIVICache(kivi_config, **dims, **rope, portable=portable)
    else:
        cache = FPCache(**dims)
    if cache.device.type == "cuda":
        # CUDA graphs only allow in-place updates of tensors at fixed addresses.
        for buf in cache.buffers():
            torch._dynamo.mark_static_address(buf)
    return cache


def make_paged_cache(model, *, method: str, batch_size: int, max_seq_len: int, num_pages: int,
                     page_size: Optional[int] = None, kivi_config: Optional[KIVIConfig] = None, device=None,
                     dtype: Optional[torch.dtype] = None):
    """A PagedFPCache or PagedKIVICache of num_pages pages per layer (page_size default: 16, or group_size)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if any(w is not None for w in layer_windows(model)):
        raise ValueError("--paged: this model has sliding-window layers, which have no paged form; serve it without "
                         "--paged")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dims = dict(num_layers=cfg.num_hidden_layers, batch_size=batch_size, num_kv_heads=local_kv_heads(model),
                head_dim=head_dim, dtype=dtype or model.dtype, device=device or model.device, num_pages=num_pages)
    if method == "fp":
        from kivi_ops.cache.paged_fp import DEFAULT_PAGE_SIZE, PagedFPCache

        page_size = page_size or DEFAULT_PAGE_SIZE
        cache = PagedFPCache(**dims, page_size=page_size, max_pages_per_seq=-(-max_seq_len // page_size))
    else:
        from kivi_ops.cache.paged import PagedKIVICache

        kivi_config = local_kivi_config(model, kivi_config or KIVIConfig())
        page_size = page_size or kivi_config.group_size  # a page holds whole quantization groups
        rope = {}
        if kivi_config.pre_rope:
            inv_freq, scaling = model_rope_frequencies(model)
            rope = dict(rope_inv_freq=inv_freq, rope_scaling=scaling)
        cache = PagedKIVICache(kivi_config, **dims, **rope, page_size=page_size,
                               max_pages_per_seq=-(-max_seq_len // page_size))
    if cache.device.type == "cuda":
        for buf in cache.buffers():
            torch._dynamo.mark_static_address(buf)
    return cache


def paged_bytes(model, *, method: str, batch_size: int, max_seq_len: int, page_size: Optional[int] = None,
                kivi_config: Optional[KIVIConfig] = None) -> tuple[int, int]:
    """(bytes per page, all layers; bytes of the rest) of a paged cache, sized on the meta device."""
    def size(pages):
        return make_paged_cache(model, method=method, batch_size=batch_size, max_seq_len=max_seq_len, num_pages=pages,
                                page_size=page_size, kivi_config=kivi_config, device="meta").nbytes()

    one, two = size(1), size(2)
    return two - one, one - (two - one)


def cache_bytes_per_sequence(model, *, method: str, tokens: int, kivi_config: Optional[KIVIConfig] = None) -> int:
    return make_cache(model, method=method, batch_size=1, max_seq_len=tokens, kivi_config=kivi_config,
                      device="meta").nbytes()


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:  # nan passes "< 0"
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sampling_probs(logits: torch.Tensor, temperature: float, *, top_k: Optional[int] = None,
                   top_p: Optional[float] = None) -> torch.Tensor:
    """Sampling probabilities [..., V]; scaled from the row's maximum in float64, so a tiny temperature
    tends to greedy, not NaN."""
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # <= 0, the maximum exactly 0
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # keep the token crossing p
        drop_sorted[..., 0] = False  # the most likely token, whatever top_p rounds to
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    # Exponential race instead of multinomial: same distribution, no host sync, compiles.
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def run_decoder_layer(layer, hidden_states, cache_layer, position_embeddings, step: Step):
    """One decoder layer over its own cache layer: the region that compiles once for every layer."""
    return layer(hidden_states, position_embeddings=position_embeddings, past_key_values=cache_layer, kivi_step=step)


def forward(model, cache: StaticCacheBase, input_ids: torch.Tensor, positions: torch.Tensor, step: Step,
            run_layer=run_decoder_layer) -> torch.Tensor:
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)  # Gemma 3's embedding scales by sqrt(hidden) itself
    for layer, cache_layer, position_embeddings in zip(decoder.layers, cache.layers,
                                                       layer_position_embeddings(decoder, hidden, positions)):
        hidden = run_layer(layer, hidden, cache_layer, position_embeddings, step)
    return decoder.norm(hidden)


def layer_position_embeddings(decoder, hidden: torch.Tensor, positions: torch.Tensor) -> list:
    rotary = decoder.rotary_emb
    if not hasattr(rotary, "layer_types"):
        return [rotary(hidden, positions)] * len(decoder.layers)
    tables = {kind: rotary(hidden, positions, kind) for kind in rotary.layer_types}
    return [tables[kind] for kind in decoder.config.layer_types]


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def prefill(model, cache: StaticCacheBase, input_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Prefill right-padded prompts [B, n] of fresh sequences; logits [B, V] of each last real token."""
    B, n = input_ids.shape
    positions = cache.lengths()[:, None] + torch.arange(n, device=input_ids.device)[None, :]
    hidden = forward(model, cache, input_ids, positions, Step(counts=counts, prefill=True))
    return lm_logits(model, hidden[torch.arange(B, device=input_ids.device), counts - 1])


def prefill_chunked(model, cache: StaticCacheBase, token_ids, chunk: int, *, start: int = 0,
                    on_boundary=None) -> torch.Tensor:
    """Prefill in chunks that attend through the cache, so the cache at a boundary depends on the tokens
    before it alone (prefix caching)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if cache.batch_size != 1:
        raise ValueError(f"prefill_chunked takes a batch-1 cache, got batch_size={cache.batch_size}")
    if start % chunk or not 0 <= start < len(token_ids):
        raise ValueError(f"start must be a multiple of chunk={chunk} below the prompt's {len(token_ids)} tokens, "
                         f"got {start}")
    held = int(cache.lengths()[0])
    if held != start:
        raise ValueError(f"the cache holds {held} tokens of this sequence; start must equal that, got {start}")
    device = cache.lengths().device
    for begin in range(start, len(token_ids), chunk):
        ids = torch.tensor([token_ids[begin:begin + chunk]], device=device)
        positions = begin + torch.arange(ids.shape[1], device=device)[None]
        hidden = forward(model, cache, ids, positions, Step())
        if on_boundary is not None and begin + chunk <= len(token_ids):
            on_boundary(begin + chunk)
    return lm_logits(model, hidden[:, -1])


def decode_step(model, cache: StaticCacheBase, tokens: torch.Tensor, positions: torch.Tensor,
                counts: Optional[torch.Tensor] = None, *, run_layer=run_decoder_layer) -> torch.Tensor:
    """tokens [B] at positions [B] -> logits [B, V]. Positions are an input: read from the cache's
    lengths, Inductor (torch 2.13) ordered them after the append (off by one)."""
    hidden = forward(model, cache, tokens[:, None], positions[:, None], Step(counts=counts), run_layer)
    return lm_logits(model, hidden[:, -1])


# Past this many cache shapes a compiled step runs eagerly (a cache sized per prompt would compile forever).
MAX_COMPILED_SHAPES = 16


def compile_decode_step(device: torch.device, *, regional: Optional[bool] = None):
    """decode_step compiled: the whole step under CUDA graphs on CUDA; on CPU one compiled decoder layer
    run for every layer, so a cold compile costs one layer."""
    device = torch.device(device)

    def compiled():
        if device.type == "cuda" and not regional:
            return compile_own_code(decode_step, fullgraph=True, dynamic=False, mode="reduce-overhead")
        if regional is False:
            return compile_own_code(decode_step, fullgraph=True, dynamic=False)
        compiled_layer = compile_own_code(run_decoder_layer, fullgraph=True, dynamic=False,
                                          options={"guard_filter_fn": torch.compiler.skip_guard_on_globals_unsafe,
                                                   "size_asserts": False, "alignment_asserts": False})
        return functools.partial(decode_step, run_layer=compiled_layer)

    per_shape = {}

    def step(model, cache: StaticCacheBase, tokens: torch.Tensor, positions: torch.Tensor,
             counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        cache.layers[0].check_room(1, counts)  # the compiled append cannot raise: check first
        # A new shape is a new compiled step, not a recompile: Dynamo's 8-version limit would fail the 9th.
        shape = signature(tokens, counts, len(cache.layers), type(cache.layers[0]), *cache.layers[0].buffers())
        if shape not in per_shape:
            if len(per_shape) >= MAX_COMPILED_SHAPES:
                if not step.warned:
                    step.warned = True
                    warnings.warn(f"{MAX_COMPILED_SHAPES} shapes of the compiled decode step are built; steps of "
                                  "other batch or cache sizes run eagerly (give caches a few fixed sizes)",
                                  stacklevel=2)
                return decode_step(model, cache, tokens, positions, counts)
            per_shape[shape] = compiled()
        return per_shape[shape](model, cache, tokens, positions, counts)

    step.warned = False

    return step


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt (stops after EOS, EOS included)
    prompt_tokens: list[int]
    prefill_s: float
    decode_s: float  # decode steps after warm-up (compilation excluded)
    decode_tokens: int  # tokens produced in the timed decode steps, all rows
    compile_s: float = 0.0
    cache_bytes: int = 0
    fp16_cache_bytes: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return sum(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    cache: StaticCacheBase,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: Optional[int | list[int]] = None,
    pad_token_id: int = 0,
    step_fn=decode_step,
    warmup_steps: int = 0,
    seed: Optional[int] = None,
) -> GenerationResult:
    """Up to max_new_tokens per prompt with a static cache; the first warmup_steps are not timed."""
    check_generation_args(prompts, max_new_tokens, batch_size=cache.batch_size, max_seq_len=cache.max_seq_len)
    cache.reset()
    result = generation_loop(
        lambda input_ids, counts: prefill(model, cache, input_ids, counts),
        lambda tokens, positions: step_fn(model, cache, tokens, positions),
        prompts, max_new_tokens=max_new_tokens, device=model.device, sampling=sampling,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, warmup_steps=warmup_steps, seed=seed,
    )
    result.cache_bytes = cache.nbytes()
    result.fp16_cache_bytes = cache.fp16_nbytes()  # same capacity, unquantized fp16
    return result


def check_generation_args(prompts: list[list[int]], max_new_tokens: int, *, batch_size: int, max_seq_len: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompts) != batch_size:
        raise ValueError(f"the cache was built for batch_size={batch_size}, got {len(prompts)} prompts")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the cache's "
            f"max_seq_len={max_seq_len}; build a larger cache"
        )


def check_finite(logits: torch.Tensor, where: str) -> torch.Tensor:
    """Refuse NaN or Inf logits (argmax of NaN is 0); the loop syncs every step anyway (its EOS check)."""
    if not bool(torch.isfinite(logits).all()):
        rows = (~torch.isfinite(logits)).any(dim=-1).nonzero().flatten().tolist()
        raise FloatingPointError(
            f"the model produced non-finite logits (NaN or Inf) at {where}, row(s) {rows}: the weights "
            "(--model), the --dtype (float16 overflow?) or the inputs hold non-finite values")
    return logits


def generation_loop(
    prefill_fn,
    step_fn,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    device: torch.device,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: Optional[int | list[int]] = None,
    pad_token_id: int = 0,
    warmup_steps: int = 0,
    seed: Optional[int] = None,
) -> GenerationResult:
    """The token loop of `generate` and of exported programs: prefill_fn and step_fn give logits [B, V]."""
    device = torch.device(device)
    if seed is not None:
        torch.manual_seed(seed)
    B = len(prompts)
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((B, longest), pad_token_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        input_ids[b, : len(p)] = torch.tensor(p, device=device)
    counts = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    eos = torch.tensor(eos_token_id if isinstance(eos_token_id, list) else
                       ([] if eos_token_id is None else [eos_token_id]), device=device)

    _sync(device)
    start = time.perf_counter()
    token = sample(check_finite(prefill_fn(input_ids, counts), "the prompt"), sampling)
    _sync(device)
    prefill_s = time.perf_counter() - start

    positions = counts.clone()
    generated = [token]
    done = torch.isin(token, eos)
    decode_s = compile_s = 0.0
    timed_steps = 0
    for step in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        start = time.perf_counter()
        token = sample(check_finite(step_fn(token, positions), f"decode step {step + 1}"), sampling)
        positions += 1
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        _sync(device)
        elapsed = time.perf_counter() - start
        if step < warmup_steps:
            compile_s += elapsed
        else:
            decode_s += elapsed
            timed_steps += 1
        generated.append(token)
        done |= torch.isin(token, eos)

    rows = torch.stack(generated, dim=1).tolist()
    eos_set = set(eos.tolist())
    tokens = []
    for row in rows:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), len(row))
        tokens.append(row[:cut])
    return GenerationResult(
        tokens=tokens,
        prompt_tokens=[len(p) for p in prompts],
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_tokens=timed_steps * B,
        compile_s=compile_s,
    )
