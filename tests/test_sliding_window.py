"""Sliding-window layers: one cache layer per layer kind (WindowLayer for sliding-window layers, the
KIVI or fp layer for full attention), checked on tiny random Mistral, Phi-3, Qwen2, Qwen3 and Gemma 3
models over sequences longer than the window, against unpatched transformers."""

import json

import pytest
import torch
import transformers

from gguf_files import write_tiny_llama_gguf
from kivi_cli.main import main
from kivi_models import generate, make_cache, patch_model
from kivi_ops import FPCache, FPLayer, KIVICache, KIVIConfig, KIVILayer, Step, WindowLayer

WINDOW = 8
PROMPT = [5, 17, 99, 3, 42, 7, 11, 64, 2, 9, 33, 71]  # 12 tokens: the prompt itself passes the window
NEW = 16
LOSSLESS = KIVIConfig(residual_length=32)  # the fp residual covers all 28 tokens: tokens must be exact


def tiny_model(family, window=WINDOW, vocab_size=256):
    """A random model with a sliding window (None: the same weights with full attention)."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    if family == "mistral":  # every layer slides
        config = transformers.MistralConfig(num_hidden_layers=2, sliding_window=window, **common)
        cls = transformers.MistralForCausalLM
    elif family == "phi3":  # fused qkv; every layer slides
        config = transformers.Phi3Config(num_hidden_layers=2, sliding_window=window, pad_token_id=0, **common)
        cls = transformers.Phi3ForCausalLM
    elif family in ("qwen2", "qwen3"):  # layers from max_window_layers on slide
        config_cls, cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
        config = config_cls(num_hidden_layers=3, use_sliding_window=window is not None, sliding_window=window,
                            max_window_layers=1, **common)
    else:  # Gemma 3: sliding and global layers alternate, q/k norms, query_pre_attn_scalar, local/global RoPE,
        # and Gemma 3 270M's attention shape: 4 query heads, 1 KV head, head_dim 256
        common.update(num_key_value_heads=1, head_dim=256)
        config = transformers.Gemma3TextConfig(num_hidden_layers=4, sliding_window=window or 4096,
                                               sliding_window_pattern=2, query_pre_attn_scalar=24, **common)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    return cls(config).eval()


def hf_greedy(model, prompt, new=NEW):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


FAMILIES = ["mistral", "phi3", "qwen2", "qwen3", "gemma3"]
KINDS = {"mistral": ["window", "window"], "phi3": ["window", "window"], "qwen2": ["full", "window", "window"],
         "qwen3": ["full", "window", "window"], "gemma3": ["window", "full", "window", "full"]}


@pytest.mark.parametrize("method", ["kivi", "fp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_models_match_unpatched_greedy(family, method):
    reference = tiny_model(family)
    want = hf_greedy(reference, PROMPT)
    assert want != hf_greedy(tiny_model(family, window=None), PROMPT)  # the window does change the tokens
    patched = patch_model(tiny_model(family))
    cache = make_cache(patched, method=method, batch_size=1, max_seq_len=len(PROMPT) + NEW, kivi_config=LOSSLESS)
    full = KIVILayer if method == "kivi" else FPLayer
    assert [type(layer) for layer in cache.layers] == [WindowLayer if k == "window" else full for k in KINDS[family]]
    assert generate(patched, [PROMPT], max_new_tokens=NEW, cache=cache).tokens[0] == want


def test_gemma3_pre_rope_keys_match_unpatched_greedy():
    # KVQuant's pre-RoPE cache rotates its keys with the full-attention layers' RoPE table (Gemma 3
    # has a local and a global one; only full-attention layers hold KIVI layers).
    patched = patch_model(tiny_model("gemma3"))
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=len(PROMPT) + NEW,
                       kivi_config=KIVIConfig(residual_length=32, pre_rope=True))
    rotary = patched.model.rotary_emb
    assert not torch.equal(rotary.full_attention_inv_freq, rotary.sliding_attention_inv_freq)
    want = hf_greedy(tiny_model("gemma3"), PROMPT)
    assert generate(patched, [PROMPT], max_new_tokens=NEW, cache=cache).tokens[0] == want


def compiled_hf_generate(family):
    """transformers' generate() with our cache, its decode steps compiled (kivi_models.hf_generate,
    i.e. compile_decode_step, as `kivi generate --compile` runs it): the new tokens and the graphs."""
    patched = patch_model(tiny_model(family))
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=len(PROMPT) + NEW, kivi_config=LOSSLESS)
    torch.compiler.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    out = patched.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                           past_key_values=cache)
    return out[0, len(PROMPT):].tolist(), counters["stats"]["unique_graphs"]


@pytest.mark.slow  # a cold Inductor build per family; the eager window tests run in `make test`
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
def test_sliding_window_models_compiled_match_unpatched_greedy(family):
    tokens, graphs = compiled_hf_generate(family)
    assert tokens == hf_greedy(tiny_model(family), PROMPT)
    # One graph per layer kind (the regional CPU compile: a decoder layer over its cache layer);
    # every later step and layer reuses them (a recompile would add a graph).
    assert graphs == len(set(KINDS[family]))


LEFT_PADDED = [PROMPT[:5], PROMPT[3:], PROMPT]  # 5, 9 and 12 tokens, around the window of 8


def hf_generate_left_padded(patched, batch, *, compiled=False):
    """transformers' generate() on a left-padded batch with our cache, quantization active in the
    global layers (G=8, R=8): the new tokens per row, and the cache."""
    longest = max(map(len, batch))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    cache = make_cache(patched, method="kivi", batch_size=len(batch), max_seq_len=longest + NEW,
                       kivi_config=KIVIConfig(group_size=8, residual_length=8))
    out = patched.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, pad_token_id=0, disable_compile=not compiled)
    return out[:, longest:].tolist(), cache


def test_gemma3_left_padded_batch_equals_each_prompt_alone():
    patched = patch_model(tiny_model("gemma3"))
    batched, cache = hf_generate_left_padded(patched, LEFT_PADDED)
    assert cache.lengths().tolist() == [len(p) + NEW - 1 for p in LEFT_PADDED]  # pads never entered the cache
    for prompt, row in zip(LEFT_PADDED, batched):
        assert row == hf_generate_left_padded(patched, [prompt])[0][0]


@pytest.mark.slow
def test_gemma3_left_padded_batch_compiled_equals_eager():
    patched = patch_model(tiny_model("gemma3"))
    eager, _ = hf_generate_left_padded(patched, LEFT_PADDED)
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    assert hf_generate_left_padded(patched, LEFT_PADDED, compiled=True)[0] == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the decode steps ran compiled


def test_cache_bytes_per_layer_kind():
    # Gemma 3 shapes: 1 KV head, head_dim 256, window 512, fp16; a WindowLayer holds its window,
    # full-precision, whatever the sequence length; the KIVI layer grows with it.
    dims = dict(num_layers=6, batch_size=2, max_seq_len=4096, num_kv_heads=1, head_dim=256, dtype=torch.float16,
                device="meta")
    windows = [512, 512, None, 512, 512, None]
    cache = make_kivi_cache(dims, windows)
    window_layer = 2 * 2 * 1 * 512 * 256 * 2  # K and V, batch 2, 512 tokens, fp16
    assert [layer.nbytes() for layer in cache.layers if layer.is_sliding] == [window_layer] * 4
    kivi_layer = cache.layers[2].nbytes()
    assert cache.nbytes_by_kind() == {"window": 4 * window_layer, "full": 2 * kivi_layer}
    assert cache.nbytes() == 4 * window_layer + 2 * kivi_layer
    # An fp16 cache would need the window on sliding layers too (what the ratio is measured against).
    assert cache.fp16_nbytes() == 4 * window_layer + 2 * (2 * 2 * 1 * 4096 * 256 * 2)
    short = make_kivi_cache(dict(dims, max_seq_len=100), windows)  # a window wider than the cache: 100 slots
    assert short.layers[0].nbytes() == 2 * 2 * 100 * 256 * 2


def make_kivi_cache(dims, windows):
    return KIVICache(KIVIConfig(), **dims, windows=windows)


def masked_reference(keys, values, query, window, scale):
    """Attention of the last query over all keys, masked to the window (no ring)."""
    n = keys.shape[2]
    t = torch.arange(n)
    mask = (t > n - 1 - window)[None, :]  # [1 query, n keys]
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                                            enable_gqa=True)


@pytest.mark.slow  # a cold Inductor build; the eager ring is checked above
def test_window_layer_ring_matches_a_masked_full_cache_compiled():
    # Rows of different prompt lengths (Step.counts), prompts longer and shorter than the window,
    # then one-token steps through the compiled append and attend: every step equals attention over
    # all tokens so far masked to the window (fp32: the same products, summed in another order).
    torch.manual_seed(0)
    B, H, D, W = 2, 2, 16, 5
    layer = WindowLayer(window=W, batch_size=B, max_seq_len=32, num_kv_heads=H, head_dim=D)
    counts = torch.tensor([7, 3])
    k, v = torch.randn(B, H, 7, D), torch.randn(B, H, 7, D)
    layer.append(k, v, Step(counts=counts))
    history = [(k[b, :, : counts[b]], v[b, :, : counts[b]]) for b in range(B)]
    append = torch.compile(layer.append, fullgraph=True, dynamic=False)
    attend = torch.compile(layer.attend, fullgraph=True, dynamic=False)
    for _ in range(9):
        k, v, q = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, 2 * H, 1, D)
        append(k, v)
        history = [(torch.cat([hk, k[b]], dim=1), torch.cat([hv, v[b]], dim=1)) for b, (hk, hv) in enumerate(history)]
        got = attend(q, Step(), 0.25)
        for b, (hk, hv) in enumerate(history):
            want = masked_reference(hk[None], hv[None], q[b:b + 1], W, 0.25)
            torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-6)
    assert layer.lengths.tolist() == [16, 12]
    keys, _ = layer.dequantized()  # the window, oldest first
    for b, (hk, _) in enumerate(history):
        assert torch.equal(keys[b], hk[:, -W:])


def test_window_layer_refuses_a_multi_token_step_past_its_window():
    layer = WindowLayer(window=4, batch_size=1, max_seq_len=32, num_kv_heads=1, head_dim=8)
    layer.append(torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8))
    with pytest.raises(ValueError, match="3-token attention step on a sliding-window layer .window 4."):
        layer.append(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
        layer.attend(torch.randn(1, 1, 3, 8))
    with pytest.raises(ValueError, match="window must be a positive int"):
        WindowLayer(window=0, batch_size=1, max_seq_len=8, num_kv_heads=1, head_dim=8)


def test_a_cache_without_the_models_windows_is_refused():
    patched = patch_model(tiny_model("gemma3"))
    cfg = patched.config
    cache = FPCache(num_layers=cfg.num_hidden_layers, batch_size=1, max_seq_len=32, num_kv_heads=1, head_dim=256)
    with pytest.raises(ValueError, match="layer 0 attends over a sliding window of 8 tokens but its cache layer is a "
                                         "FPLayer over all tokens .*make_cache"):
        generate(patched, [PROMPT], max_new_tokens=2, cache=cache)


def test_gemma3_rows_are_independent_as_the_server_uses_them():
    # kivi serve's engine: a prompt is prefilled in a batch-1 staging cache and loaded into a free
    # row (load_row copies the window rings too); the row then decodes beside an empty row with
    # count 0, whose logits must stay finite (its ring shows nothing, SDPA must not get an
    # all-masked row). The tokens equal the prompt generated alone.
    from kivi_models.generate import decode_step, prefill

    patched = patch_model(tiny_model("gemma3"))
    config, S = KIVIConfig(group_size=8, residual_length=8), len(PROMPT) + NEW
    alone = make_cache(patched, method="kivi", batch_size=1, max_seq_len=S, kivi_config=config)
    want = generate(patched, [PROMPT], max_new_tokens=NEW, cache=alone).tokens[0]
    cache = make_cache(patched, method="kivi", batch_size=2, max_seq_len=S, kivi_config=config)
    staging = make_cache(patched, method="kivi", batch_size=1, max_seq_len=S, kivi_config=config)
    with torch.inference_mode():
        tokens = [int(prefill(patched, staging, torch.tensor([PROMPT]), torch.tensor([len(PROMPT)])).argmax())]
        cache.load_row(1, staging)
        positions = torch.tensor([0, len(PROMPT)])
        for _ in range(NEW - 1):
            logits = decode_step(patched, cache, torch.tensor([0, tokens[-1]]), positions, torch.tensor([0, 1]))
            assert torch.isfinite(logits[0]).all()
            tokens.append(int(logits[1].argmax()))
            positions[1] += 1
    assert tokens == want
    assert cache.lengths().tolist() == [0, S - 1]


def test_gemma_final_logit_softcapping_is_applied():
    # Gemma's optional final cap, tanh(logits / cap) * cap: greedy tokens cannot show it (tanh is
    # monotonic), the logits do. fp32, same weights: the patched prefill's last-token logits equal
    # transformers' to float rounding (SDPA over the same exact keys, summed in another order).
    from kivi_models.generate import prefill

    reference, patched = tiny_model("gemma3"), patch_model(tiny_model("gemma3"))
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=len(PROMPT), kivi_config=LOSSLESS)
    with torch.inference_mode():
        uncapped = reference(torch.tensor([PROMPT])).logits[:, -1]
        for model in (reference, patched):
            model.config.final_logit_softcapping = 0.1  # well below these logits' magnitudes
        want = reference(torch.tensor([PROMPT])).logits[:, -1]
        got = prefill(patched, cache, torch.tensor([PROMPT]), torch.tensor([len(PROMPT)]))
    assert (want - uncapped).abs().max() > 1e-2  # the cap does bend these logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A saved tiny Gemma 3 with the tokenizer of the test GGUF file: (directory, model, tokenizer)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("gemma3")
    write_tiny_llama_gguf(path / "tokenizer.gguf")
    tok = AutoTokenizer.from_pretrained(path, gguf_file="tokenizer.gguf")
    model = tiny_model("gemma3", vocab_size=len(tok))
    model.save_pretrained(path / "model")
    tok.save_pretrained(path / "model")
    return path / "model", model, tok


def cli_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_generate_reports_bytes_per_layer_kind(gemma3_dir, capsys):
    # `kivi generate --json` on a saved tiny Gemma 3: the tokens are transformers' own, and the
    # bytes per layer kind are exact: each sliding layer holds its 8-token window (K and V, 1 KV
    # head, head_dim 256, fp32), whatever the length.
    path, model, tok = gemma3_dir
    prompt = "the cat in the hat sat on the mat"
    report = cli_json(capsys, "generate", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "12",
                      "--residual-length", "128", "--json")
    ids = tok(prompt)["input_ids"]
    assert len(ids) > WINDOW and report["new_tokens"] > 1
    assert report["tokens"] == hf_greedy(model, ids, 12)[: report["new_tokens"]]  # the CLI stops at EOS
    kinds = report["cache_bytes_by_kind"]
    assert kinds["window"] == 2 * (2 * 1 * WINDOW * 256 * 4)
    assert kinds["full"] + kinds["window"] == report["cache_bytes"] and kinds["full"] > 0


@pytest.mark.slow  # an export and a fresh generate: about half a minute on 2 busy cores
def test_pt2_export_of_gemma3_gives_kivi_generate_tokens(gemma3_dir, tmp_path, capsys):
    # One exported program serves the prompt (exact, windowed attention at a dynamic token count)
    # and the decode steps (the rings and the KIVI layers as program state), past the window.
    path, _, _ = gemma3_dir
    prompt = "the cat in the hat sat on the mat and the dog"
    cache_flags = ["--group-size", "8", "--residual-length", "8"]  # global layers quantize within the run
    want = cli_json(capsys, "generate", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "16",
                    *cache_flags, "--json")
    assert main(["export", "--format", "pt2", "--out", str(tmp_path / "pt2"), "--model", str(path),
                 "--max-seq-len", "64", *cache_flags]) == 0
    capsys.readouterr()
    got = cli_json(capsys, "run-exported", str(tmp_path / "pt2"), "--prompt", prompt, "--max-new-tokens", "16",
                   "--json")
    assert want["prompt_tokens"] > WINDOW and got["tokens"] == want["tokens"]


def test_gemma3_pre_rope_calibration_unrotates_each_layer_with_its_own_rope():
    # kivi calibrate --pre-rope records each layer's keys and un-rotates them: with Gemma 3's local
    # and global RoPE tables, each layer's own (fp32: RoPE and its inverse round at ~1e-6).
    from kivi_models.calibrate import collect_kv_fisher

    model = tiny_model("gemma3")
    pre_rope = {}
    hooks = [layer.self_attn.k_norm.register_forward_hook(lambda m, i, out, idx=idx: pre_rope.setdefault(idx, out))
             for idx, layer in enumerate(model.model.layers)]
    activations = collect_kv_fisher(model, torch.tensor([PROMPT + PROMPT[:4]]), batch_size=1, pre_rope=True)
    for hook in hooks:
        hook.remove()
    for idx, recorded in enumerate(activations):
        torch.testing.assert_close(recorded["k"], pre_rope[idx].detach().reshape(recorded["k"].shape),
                                   rtol=1e-4, atol=1e-5)


def test_quality_table_cache_bytes_per_layer_kind():
    # `kivi eval table`'s bytes rows: fp16, exact, per layer kind; sliding layers hold their window.
    from kivi_benchmarks.quality_table import Row, cache_bytes

    patched = patch_model(tiny_model("gemma3"))
    fp = cache_bytes(patched, Row("16-bit", "baseline", "fp"), 256)
    kivi = cache_bytes(patched, Row("KIVI-2", "kivi", "kivi", kivi=KIVIConfig(residual_length=32)), 256)
    window, full = (2 * (2 * 1 * n * 256 * 2) for n in (WINDOW, 256))  # 2 layers each: K and V, 1 head, fp16
    assert fp == dict(tokens=256, full=full, window=window, total=full + window, fp16=full + window)
    assert kivi["window"] == window and kivi["fp16"] == fp["fp16"] and kivi["full"] < full / 3
    assert kivi["total"] == kivi["full"] + kivi["window"]
