"""End-to-end checks that need a CUDA GPU: the patched model on CUDA with the Triton kernels,
eager and compiled with CUDA graphs (mode="reduce-overhead"). Skipped without CUDA (CI is CPU
only); run on the lent GPU with benchmarks/gpu_suite.sh. The kernels themselves are checked
against the reference in test_triton_kernels.py, which runs on CUDA when there is one."""

import pytest
import torch

from kivi_ops import KIVIConfig
from kivi_models import compile_decode_step, generate, make_cache, patch_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_llama(dtype):
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    return patch_model(transformers.LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval())


PROMPTS = [[5, 17, 99, 3, 42, 7, 300, 12, 8, 77], [9, 250, 31]]


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    # TF32 would round fp32 matmuls to 10-bit mantissas differently in eager and compiled code.
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_kivi_with_residual_covering_everything_equals_fp_cache_on_cuda():
    # R >= every sequence length: nothing is quantized, so KIVI attention is exact attention.
    model = tiny_llama(torch.float32)
    tokens = {}
    for method in ("fp", "kivi"):
        cache = make_cache(model, method=method, batch_size=2, max_seq_len=64, kivi_config=KIVIConfig(residual_length=64))
        tokens[method] = generate(model, PROMPTS, max_new_tokens=20, cache=cache).tokens
    assert tokens["kivi"] == tokens["fp"]


@pytest.mark.parametrize("method", ["kivi", "fp"])
def test_cuda_graph_decode_matches_eager(method):
    # KIVI-2 with G=R=8: the 30 decode steps flush and quantize windows inside the CUDA graph.
    model = tiny_llama(torch.float32)
    cfg = KIVIConfig(2, 2, group_size=8, residual_length=8)
    runs = {}
    for name, step in (("eager", None), ("graphs", compile_decode_step(torch.device("cuda")))):
        torch.compiler.reset()
        cache = make_cache(model, method=method, batch_size=2, max_seq_len=64, kivi_config=cfg)
        kwargs = dict(step_fn=step, warmup_steps=2) if step else {}
        runs[name] = generate(model, PROMPTS, max_new_tokens=30, cache=cache, **kwargs).tokens
    assert runs["graphs"] == runs["eager"]
