"""A residual window that covers every sequence quantizes nothing: vLLM + KIVI must then equal stock
vLLM fp32 (CPU_ATTN, which the plugin leaves untouched without the config), token for token. The
same two engines give vLLM's own KV capacity count at one VLLM_CPU_KVCACHE_SPACE, which holds the
KIVI window pools too."""

import torch

from conftest import close, greedy_outputs, make_llm
from kivi_ops import KIVIConfig
from kivi_ops.cache.byte_pages import page_bytes
from test_kivi_engine import prompts

WHOLE = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 512}  # = max_model_len


def _run(model_dir, kivi):
    llm = make_llm(model_dir, kivi)
    try:
        impl = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.model.layers[0].self_attn.attn.impl
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        return greedy_outputs(llm, prompts(4), 32), blocks, type(impl).__name__, getattr(impl, "kivi", None)
    finally:
        close(llm)


def test_whole_window_equals_stock_fp32_and_capacity(tiny_llama):
    stock, stock_blocks, _, stock_kivi = _run(tiny_llama, None)
    kivi, kivi_blocks, _, active = _run(tiny_llama, WHOLE)
    assert stock_kivi is None and active == KIVIConfig(**WHOLE)
    assert kivi == stock
    # Bytes per block per layer: fp32 K and V (2 kv heads, head_dim 64) vs the KIVI-2 page.
    fp = 32 * 2 * 2 * 64 * 4
    assert stock_blocks * 32 * 2 * 2 * 64 * 4 * 2 <= 2**30 < (stock_blocks + 1) * fp * 2
    quantized = page_bytes(KIVIConfig(**WHOLE), 2, 32, 64, torch.float32)
    assert quantized * 8 == fp
    # The KIVI worker's window pools (8 slots x 2 layers x 2 heads x R x D, K and V) come out of the 1 GiB.
    windows = 2 * 2 * 8 * 2 * WHOLE["residual_length"] * 64 * 4
    assert kivi_blocks == (2**30 - windows) // (2 * quantized)
