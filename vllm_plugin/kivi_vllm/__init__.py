"""kivi-vllm: a KIVI 2/4-bit KV cache for vLLM's CPU backend (docs/vllm.md).

`register` is the `vllm.general_plugins` entry point, run in every vLLM process. It points
CPU_ATTN at KIVIAttentionBackend (which is vLLM's own CPU backend unless `--additional-config
'{"kivi": {...}}'` is given), checks the engine's settings when the config is built, and hooks the
model runner so that the backend knows which request each batch row is, and the scheduler for
prefix caching (prefix_tails.py)."""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.kivi_vllm")  # under vLLM's logger: its handlers and format
_DONE = False


def register() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cpu():
        return  # the GPU path needs its own backend (docs/vllm.md)
    register_backend(AttentionBackendEnum.CPU_ATTN, "kivi_vllm.backend.KIVIAttentionBackend")
    _hook_config_check(type(current_platform))
    _hook_runner()
    _hook_kv_memory()
    _hook_prefix_hits()


def _hook_config_check(platform_cls) -> None:
    original = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        from .options import check_engine, kivi_options

        config = kivi_options(vllm_config)
        if config is not None:
            for note in check_engine(vllm_config, config):
                log.warning("KIVI: %s", note)
            log.info("KIVI cache: %s", config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def _hook_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .windows import SLOTS

    original = GPUModelRunner._update_states

    def _update_states(self, scheduler_output):
        result = original(self, scheduler_output)
        SLOTS.on_update(self, scheduler_output)
        return result

    GPUModelRunner._update_states = _update_states


def _hook_kv_memory() -> None:
    """The window pools live outside vLLM's blocks: their bytes come out of the KV memory the worker
    reports (VLLM_CPU_KVCACHE_SPACE holds blocks and windows together)."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    original = CPUWorker.determine_available_memory

    def determine_available_memory(self):
        from .options import kivi_options, window_pool_bytes

        available = original(self)
        config = kivi_options(self.vllm_config)
        if config is None:
            return available
        windows = window_pool_bytes(self.vllm_config, config)
        if windows >= available:
            raise ValueError(f"the KIVI window pools need {windows / 2**20:.1f} MiB (--max-num-seqs x layers x KV "
                             f"heads x residual_length x head_dim x 2) of the {available / 2**20:.1f} MiB KV memory: "
                             "raise VLLM_CPU_KVCACHE_SPACE or lower --max-num-seqs / residual_length")
        log.info("KIVI: %.1f MiB of the KV memory hold the full-precision windows", windows / 2**20)
        return available - windows

    CPUWorker.determine_available_memory = determine_available_memory


def _hook_prefix_hits() -> None:
    """Prefix caching over KIVI blocks (prefix_tails.py), in the scheduler: vLLM's hit is cut back to
    the longest prompt boundary whose window copy this process holds (a shared block without its
    window would change the answer), and prefill chunks end at multiples of prefix_chunk (or at the
    prefill's end), so the cache at a boundary is a function of the tokens before it, whichever
    request wrote it. The chunk end uses vLLM's own hook for Mamba's aligned prefill states."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.scheduler import Scheduler

    from .options import kivi_options, prefix_settings
    from .prefix_tails import TAILS

    original = Scheduler.__init__

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        if kivi_options(vllm_config) is None or not vllm_config.cache_config.enable_prefix_caching:
            return
        chunk, _ = prefix_settings(vllm_config)
        block = vllm_config.cache_config.block_size
        manager = self.kv_cache_manager
        lookup = manager.get_computed_blocks
        if not TAILS.chunk:
            log.warning("KIVI: the worker runs in another process than the scheduler: no prefix-cache hits")

        def get_computed_blocks(request):
            blocks, hit, boundary = lookup(request)
            if not hit:
                return blocks, hit, boundary
            keep = TAILS.longest_hit(request.all_token_ids, hit, [b.block_id for b in blocks.blocks[0]], block)
            if keep == hit:
                return blocks, hit, boundary
            return KVCacheBlocks(tuple(list(g[:len(g) * keep // hit]) for g in blocks.blocks)), keep, 0

        def end_chunks_at_boundaries(request, num_new_tokens, num_new_local_computed_tokens=0,
                                     num_external_computed_tokens=0):
            start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
            end = start + num_new_tokens
            if end >= max(request.num_prompt_tokens, request.num_tokens - 1):  # the prefill's last chunk
                return num_new_tokens
            return max(end // chunk * chunk - start, 0)  # 0: it waits for a budget that reaches a boundary

        manager.get_computed_blocks = get_computed_blocks
        self.need_mamba_block_aligned_split = True
        self._mamba_block_aligned_split = end_chunks_at_boundaries

    Scheduler.__init__ = __init__
