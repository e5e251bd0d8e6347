"""kivi-vllm: a KIVI 2/4-bit KV cache for vLLM's CPU backend (docs/vllm.md).

`register` is the `vllm.general_plugins` entry point, run in every vLLM process. It points
CPU_ATTN at KIVIAttentionBackend (which is vLLM's own CPU backend unless `--additional-config
'{"kivi": {...}}'` is given), checks the engine's settings when the config is built, and hooks the
model runner so that the backend knows which request each batch row is."""

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
