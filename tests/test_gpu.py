"""End-to-end checks that need a CUDA GPU: the patched model on CUDA with the Triton kernels,
eager and compiled with CUDA graphs (mode="reduce-overhead"). Skipped without CUDA (CI is CPU
only); run on the lent GPU with lab/gpu_suite.sh. The kernels themselves are checked
against the reference in test_triton_kernels.py, which runs on CUDA when there is one."""

import pytest
import torch

from kivi_ops import KIVIConfig, Step
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


POOL_CFG = KIVIConfig(2, 2, group_size=8, residual_length=8, sink_tokens=1, outlier_tokens=2, outlier_spill=4,
                      outlier_skip_layers=1)
SPARSE_CFG = KIVIConfig(2, 2, group_size=8, residual_length=8, sparse_outliers=0.1)
POOL_SPARSE_CFG = KIVIConfig(2, 4, group_size=8, residual_length=16, sink_tokens=2, outlier_tokens=3, outlier_spill=3,
                             outlier_skip_layers=1, sparse_outliers=0.1)


@pytest.mark.parametrize("cfg", [POOL_CFG, SPARSE_CFG, POOL_SPARSE_CFG], ids=["sink+ott", "sparse", "sink+ott+sparse"])
def test_option_ops_on_cuda_match_the_cpu_reference(cfg):
    # Sink + OTT pools and the sparse store on CUDA (append: the Triton kernels, window by window
    # for the prefill, one launch per decode step; attention: the Triton kernels, decode
    # (triton_decode) and a causal chunk (triton_split)) vs the CPU reference op.
    from kivi_ops import KIVICache

    torch.manual_seed(0)
    B, H, D = 2, 2, 32
    caches = {dev: KIVICache(cfg, num_layers=2, batch_size=B, max_seq_len=64, num_kv_heads=H, head_dim=D,
                             device=dev) for dev in ("cpu", "cuda")}
    k, v = torch.randn(B, H, 40, D), torch.randn(B, H, 40, D)
    k[:, :, ::7] *= 0.1  # low-magnitude keys: outlier candidates
    appends = [(k[:, :, :19], v[:, :, :19], torch.tensor([19, 11]))] + [
        (k[:, :, 19 + i : 20 + i], v[:, :, 19 + i : 20 + i], None) for i in range(21)]
    for key, value, counts in appends:
        for dev, cache in caches.items():
            cache.layers[1].append(key.to(dev), value.to(dev), Step(counts=None if counts is None else counts.to(dev)))
    for name, buf in caches["cpu"].named_buffers():
        if name.startswith("layers.1."):  # layer 1 (named_buffers: layers.<i>.<buffer>)
            torch.testing.assert_close(caches["cuda"].get_buffer(name).cpu(), buf, atol=1e-5, rtol=1e-5, msg=name)
    q = torch.randn(B, 4, 1, D)
    torch.testing.assert_close(caches["cuda"].layers[1].attend(q.cuda()).cpu(), caches["cpu"].layers[1].attend(q),
                               atol=1e-5, rtol=1e-5)
    q, counts = torch.randn(B, 4, 3, D), torch.tensor([3, 2])  # the split kernel (q_len > 1), padded row
    torch.testing.assert_close(caches["cuda"].layers[1].attend(q.cuda(), Step(counts=counts.cuda())).cpu(),
                               caches["cpu"].layers[1].attend(q, Step(counts=counts)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [POOL_CFG, POOL_SPARSE_CFG], ids=["sink+ott", "sink+ott+sparse"])
def test_cuda_graph_decode_with_options_matches_eager(cfg):
    model = tiny_llama(torch.float32)
    runs = {}
    for name, step in (("eager", None), ("graphs", compile_decode_step(torch.device("cuda")))):
        torch.compiler.reset()
        cache = make_cache(model, method="kivi", batch_size=2, max_seq_len=64, kivi_config=cfg)
        kwargs = dict(step_fn=step, warmup_steps=2) if step else {}
        runs[name] = generate(model, PROMPTS, max_new_tokens=30, cache=cache, **kwargs).tokens
        assert (cache.layers[1].tensors().pool_pos[..., cfg.sink_tokens:] >= 0).any()  # outliers selected
    assert runs["graphs"] == runs["eager"]


def test_compiled_decode_before_any_eager_decode(monkeypatch):
    # The decode append's arrival counters, first allocated inside a compiled step, broke cudagraph
    # trees ("tensor(s) in the cudagraph pool not tracked as outputs", H200): the cache reserves
    # them when it is built. Here no eager decode step runs first in this state.
    import kivi_ops.kernels.triton.append as ta

    monkeypatch.setattr(ta, "_ARRIVALS", {})
    model = tiny_llama(torch.float16)
    torch.compiler.reset()
    cache = make_cache(model, method="kivi", batch_size=2, max_seq_len=64,
                       kivi_config=KIVIConfig(2, 2, group_size=8, residual_length=8))
    assert ta._ARRIVALS  # reserved by the cache
    result = generate(model, PROMPTS, max_new_tokens=30, cache=cache,
                      step_fn=compile_decode_step(torch.device("cuda")), warmup_steps=2)
    assert len(result.tokens[0]) == 30
