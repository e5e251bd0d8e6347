"""KIVI Llama on the embedded default model: HF integration, static generation, compile, CLI."""

import json
import sys

import pytest
import torch

from kivi_models import SamplingConfig, compile_decode_step, generate, load_model, make_cache, patch_model
from kivi_cli.main import main
from kivi_ops import KIVIConfig, Step

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def loaded():
    hf_model, tokenizer = load_model()
    kivi_model, _ = load_model()
    patch_model(kivi_model)
    return hf_model, kivi_model, tokenizer


def run(model, tokenizer, prompts, *, method="kivi", config=None, max_new_tokens=16, **kwargs):
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    cache = make_cache(model, method=method, batch_size=len(ids),
                       max_seq_len=max(map(len, ids)) + max_new_tokens, kivi_config=config)
    return generate(model, ids, max_new_tokens=max_new_tokens, cache=cache, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.eos_token_id, **kwargs)


def hf_greedy(model, tokenizer, prompt, max_new_tokens=16, **kwargs):
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_residual_covering_everything_matches_fp_and_unpatched_hf(loaded):
    hf_model, kivi_model, tok = loaded
    reference = hf_greedy(hf_model, tok, PROMPT)
    fp = run(kivi_model, tok, [PROMPT], method="fp").tokens[0]
    lossless = run(kivi_model, tok, [PROMPT], config=KIVIConfig(residual_length=128)).tokens[0]
    assert fp == reference[: len(fp)]
    assert lossless == fp


def test_kivi2_defaults_answer_paris(loaded):
    _, kivi_model, tok = loaded
    # A tiny window so most of the short context really is 2-bit.
    for config in (KIVIConfig(), KIVIConfig(group_size=8, residual_length=8)):
        text = tok.decode(run(kivi_model, tok, [PROMPT], config=config, max_new_tokens=6).tokens[0])
        assert "Paris" in text, (config, text)


def test_batch_of_different_lengths_gives_each_prompt_its_own_tokens(loaded):
    _, kivi_model, tok = loaded
    prompts = [PROMPT, "def fibonacci(n):", "Water boils at a temperature of"]
    config = KIVIConfig(group_size=8, residual_length=8)  # quantization active within the short run
    batched = run(kivi_model, tok, prompts, config=config, max_new_tokens=12)
    for prompt, tokens in zip(prompts, batched.tokens):
        assert tokens == run(kivi_model, tok, [prompt], config=config, max_new_tokens=12).tokens[0]


# A cold compile of its own cache shape (40 s of `make test`): make test-slow. The fast suite's compiled
# generate() is test_hf_generate_compiles_one_graph_for_every_decode_step; its lossless equality with
# transformers, test_residual_covering_everything_matches_fp_and_unpatched_hf (the library loop) and the
# beam-search tests (generate(), eager steps).
@pytest.mark.slow
def test_hf_generate_with_kivi_cache(loaded):
    hf_model, kivi_model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    cache = make_cache(kivi_model, method="kivi", batch_size=1, max_seq_len=64, kivi_config=KIVIConfig(residual_length=128))
    out = kivi_model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert out[0, ids.shape[1]:].tolist() == hf_greedy(hf_model, tok, PROMPT, 12)
    # Length from the cache's length tensors (prompt + 11 appended decode tokens), not keys.any().
    assert cache.get_seq_length() == ids.shape[1] + 11


BATCH = [PROMPT, "def fibonacci(n):", "Water boils at a temperature of about"]


def hf_generate_left_padded(model, tok, prompts, *, method, config, **kwargs):
    """transformers' generate() on a left-padded batch with our cache: the new tokens per row.
    Eager decode steps unless disable_compile=False is passed (one compile per cache shape would
    cost each test seconds; test_hf_generate_compiles_one_graph_for_every_decode_step covers it)."""
    kwargs.setdefault("disable_compile", True)
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    cache = make_cache(model, method=method, batch_size=len(prompts), max_seq_len=64, kivi_config=config)
    out = model.generate(**batch, past_key_values=cache, pad_token_id=tok.eos_token_id, **kwargs)
    return out[:, batch["input_ids"].shape[1]:].tolist(), cache


@pytest.mark.parametrize("method", ["kivi", pytest.param("fp", marks=pytest.mark.slow)])
def test_hf_generate_left_padded_batch_equals_each_prompt_alone(loaded, method):
    # G=8, R=8: prompts of 5, 6 and 9 tokens flush their first key groups at different steps.
    _, kivi_model, tok = loaded
    config = KIVIConfig(group_size=8, residual_length=8) if method == "kivi" else None
    batched, cache = hf_generate_left_padded(kivi_model, tok, BATCH, method=method, config=config,
                                             max_new_tokens=16, do_sample=False)
    lengths = [len(tok(p)["input_ids"]) for p in BATCH]
    # Pads never entered the cache: each row holds its prompt and 15 appended tokens.
    assert cache.lengths().tolist() == [n + 15 for n in lengths]
    for prompt, row in zip(BATCH, batched):
        alone, _ = hf_generate_left_padded(kivi_model, tok, [prompt], method=method, config=config,
                                           max_new_tokens=16, do_sample=False)
        assert row == alone[0], prompt


def test_hf_generate_left_padded_sampling_eos_and_min_new_tokens(loaded):
    _, kivi_model, tok = loaded
    config = KIVIConfig(group_size=8, residual_length=8)
    torch.manual_seed(0)
    first, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                       do_sample=True, top_k=20)
    torch.manual_seed(0)
    again, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                       do_sample=True, top_k=20)
    assert first == again and all(0 <= t < len(tok) for row in first for t in row)
    # EOS: make row 0's second greedy token the EOS; that row stops (then pads), the others go on.
    greedy, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                        do_sample=False)
    eos = greedy[0][1]
    stopped, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                         do_sample=False, eos_token_id=eos)
    assert stopped[0][:2] == greedy[0][:2] and set(stopped[0][2:]) <= {tok.eos_token_id, eos}
    assert any(stopped[i] == greedy[i] for i in (1, 2) if eos not in greedy[i])
    # min_new_tokens: the EOS cannot end a row before 6 tokens.
    held, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                      do_sample=False, eos_token_id=eos, min_new_tokens=6)
    assert eos not in held[0][:5]


@pytest.mark.parametrize("method", ["kivi", "fp"])
def test_hf_generate_beam_search_equals_unpatched_beams(loaded, method):
    # A lossless cache (the residual window covers prompt + 8 tokens) must give transformers' own
    # beams: every step's reorder_cache has to move each row's whole state, or the beams diverge.
    hf_model, kivi_model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    reference = hf_model.generate(ids, max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    config = KIVIConfig(residual_length=128) if method == "kivi" else None
    cache = make_cache(kivi_model, method=method, batch_size=3, max_seq_len=64, kivi_config=config)
    out = kivi_model.generate(ids, max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False,
                              past_key_values=cache, disable_compile=True)
    assert out.tolist() == reference.tolist()


def test_hf_generate_refuses_a_cache_with_too_few_rows_for_num_beams(loaded):
    _, kivi_model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    cache = make_cache(kivi_model, method="kivi", batch_size=1, max_seq_len=64)
    with pytest.raises(ValueError, match=r"batch_size=1 rows but the model runs 2: .*num_beams.*batch_size=2"):
        kivi_model.generate(ids, max_new_tokens=4, num_beams=2, past_key_values=cache, disable_compile=True)


def test_hf_generate_sampling_num_return_sequences_fills_the_cache_rows(loaded):
    _, kivi_model, tok = loaded
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    cache = make_cache(kivi_model, method="kivi", batch_size=2, max_seq_len=64,
                       kivi_config=KIVIConfig(group_size=8, residual_length=8))
    torch.manual_seed(0)
    out = kivi_model.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=2, past_key_values=cache,
                              pad_token_id=tok.eos_token_id, disable_compile=True)
    assert out.shape == (2, ids.shape[1] + 6) and cache.lengths().tolist() == [ids.shape[1] + 5] * 2


def test_hf_generate_refuses_a_cache_of_another_model_naming_both_layouts(loaded):
    _, kivi_model, tok = loaded
    from kivi_ops import KIVICache
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    for layers, heads, head_dim in ((2, 3, 64), (30, 4, 64), (30, 3, 32)):
        other = KIVICache(KIVIConfig(), num_layers=layers, batch_size=1, max_seq_len=64, num_kv_heads=heads,
                          head_dim=head_dim)
        want = (rf"built for another model: {layers} layers of {heads} KV heads x head_dim {head_dim}, but this "
                r"model has 30 layers of 3 KV heads x head_dim 64")
        with pytest.raises(ValueError, match=want):
            kivi_model.generate(ids, max_new_tokens=2, past_key_values=other, disable_compile=True)


def test_hf_generate_resets_a_reused_cache(loaded):
    # What the docs promise for transformers 5.23 (whose generate() takes no cache_position): a
    # cache passed again starts from empty, so the second call equals a fresh cache's.
    _, kivi_model, tok = loaded
    config = KIVIConfig(group_size=8, residual_length=8)
    cache = make_cache(kivi_model, method="kivi", batch_size=1, max_seq_len=64, kivi_config=config)
    first = tok("def fibonacci(n):", return_tensors="pt")["input_ids"]
    kivi_model.generate(first, max_new_tokens=6, do_sample=False, past_key_values=cache, disable_compile=True)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    again = kivi_model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache, disable_compile=True)
    fresh = make_cache(kivi_model, method="kivi", batch_size=1, max_seq_len=64, kivi_config=config)
    alone = kivi_model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=fresh, disable_compile=True)
    assert again.tolist() == alone.tolist() and cache.lengths().tolist() == fresh.lengths().tolist()


@pytest.mark.slow  # 65 s of cold Inductor compiles; make test compiles generate() in the test below
def test_hf_generate_compiles_one_graph_for_every_decode_step(loaded):
    # Our cache is compileable: transformers' generate() runs its decode steps through the patched
    # model's compiled step (kivi_models.hf_generate). A left-padded batch gives the eager path's
    # tokens, and one graph serves every step, sampled or greedy, with no recompiles.
    _, kivi_model, tok = loaded
    config = KIVIConfig(group_size=8, residual_length=8)
    eager, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=16,
                                       do_sample=False)
    torch.compiler.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled, cache = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config,
                                              max_new_tokens=16, do_sample=False, disable_compile=False)
    assert compiled == eager
    assert cache.lengths().tolist() == [len(tok(p)["input_ids"]) + 15 for p in BATCH]  # pads never stored
    torch.manual_seed(0)
    sampled, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                         do_sample=True, top_k=20, disable_compile=False)
    torch.manual_seed(0)
    again, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                       do_sample=True, top_k=20, disable_compile=False)
    assert sampled == again
    eos = eager[0][1]  # row 0 stops at its second token; the compiled rows stop like eager ones
    stopped, _ = hf_generate_left_padded(kivi_model, tok, BATCH, method="kivi", config=config, max_new_tokens=8,
                                         do_sample=False, eos_token_id=eos, disable_compile=False)
    assert stopped[0][:2] == eager[0][:2] and set(stopped[0][2:]) <= {tok.eos_token_id, eos}
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0


def test_hf_generate_compiles_past_dynamos_recompile_limit_in_one_process(monkeypatch):
    # A long-lived process (a notebook, a service) meets ever new batch sizes. Each is a compiled
    # step of its own (kivi_ops/dispatch/compile_budget.py), never a recompile of one function: under
    # fullgraph, Dynamo fails the compile past its recompile_limit (8; the 9th batch size failed).
    # Here the limit is 1, and two batch sizes each run compiled, with the eager tokens. The budget is
    # Dynamo's, whatever the backend: Dynamo's own "eager" backend spares this test two cold Inductor
    # builds (over a minute each on a busy 2-core machine); the tests above check Inductor's tokens.
    from transformers import AutoTokenizer

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, **{**options, "backend": "eager"}))

    from kivi_models.loading import default_model_dir
    from tiny_models import tiny_llama

    tok = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    model = patch_model(tiny_llama(vocab_size=len(tok)))
    config = KIVIConfig(group_size=8, residual_length=8)
    torch.compiler.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=1):
        for prompts in (BATCH[:1], BATCH[:2]):
            eager, _ = hf_generate_left_padded(model, tok, prompts, method="kivi", config=config, max_new_tokens=6,
                                               do_sample=False)
            compiled, _ = hf_generate_left_padded(model, tok, prompts, method="kivi", config=config,
                                                  max_new_tokens=6, do_sample=False, disable_compile=False)
            assert compiled == eager
    assert counters["stats"]["unique_graphs"] == 2  # both ran compiled
    # Past MAX_COMPILED_SHAPES a new shape runs eagerly (a cache sized per prompt would otherwise
    # compile on every call, without bound), with a warning, and gives the eager tokens.
    monkeypatch.setattr(sys.modules["kivi_models.generate"], "MAX_COMPILED_SHAPES", 2)
    eager, _ = hf_generate_left_padded(model, tok, BATCH, method="kivi", config=config, max_new_tokens=6,
                                       do_sample=False)
    with pytest.warns(UserWarning, match="2 shapes of the compiled decode step are built"):
        compiled, _ = hf_generate_left_padded(model, tok, BATCH, method="kivi", config=config, max_new_tokens=6,
                                              do_sample=False, disable_compile=False)
    assert compiled == eager and counters["stats"]["unique_graphs"] == 2


def test_hf_generate_refuses_pads_after_real_tokens(loaded):
    _, kivi_model, tok = loaded
    tok.padding_side = "right"
    batch = tok(BATCH[:2], return_tensors="pt", padding=True)
    cache = make_cache(kivi_model, method="kivi", batch_size=2, max_seq_len=64)
    with pytest.raises(ValueError, match="attention_mask must be left padding"):
        kivi_model.generate(**batch, max_new_tokens=4, do_sample=False, past_key_values=cache)


def test_generating_past_max_seq_len_is_a_clear_error(loaded):
    _, kivi_model, tok = loaded
    ids = tok(PROMPT)["input_ids"]
    cache = make_cache(kivi_model, method="kivi", batch_size=1, max_seq_len=len(ids) + 4)
    with pytest.raises(ValueError, match=r"exceeds the cache's max_seq_len=9"):
        generate(kivi_model, [ids], max_new_tokens=10, cache=cache)


def test_sampling_is_seeded_and_top_k_1_is_greedy(loaded):
    _, kivi_model, tok = loaded
    greedy = run(kivi_model, tok, [PROMPT], max_new_tokens=8).tokens
    top1 = run(kivi_model, tok, [PROMPT], max_new_tokens=8, sampling=SamplingConfig(temperature=1.0, top_k=1), seed=0).tokens
    assert top1 == greedy
    hot = SamplingConfig(temperature=1.5, top_p=0.95)
    a = run(kivi_model, tok, [PROMPT], max_new_tokens=8, sampling=hot, seed=3).tokens
    b = run(kivi_model, tok, [PROMPT], max_new_tokens=8, sampling=hot, seed=3).tokens
    assert a == b


def test_cli_json(capsys):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("text", "tokens", "prompt_tokens", "new_tokens", "decode_tokens_per_s", "cache_bytes",
                "fp16_cache_bytes", "config"):
        assert key in report
    assert "Paris" in report["text"] and len(report["tokens"]) == report["new_tokens"] <= 5
    assert report["config"]["kivi"] == KIVIConfig().to_record()


def test_cli_batch_file_json(tmp_path, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text(f"{PROMPT}\nWater boils at\n")
    assert main(["generate", "--batch-file", str(batch), "--max-new-tokens", "4", "--json", "--method", "fp"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["tokens"]) == 2 and isinstance(report["tokens"][0], list)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate"], "one of the arguments --prompt --prompt-file --batch-file is required"),
        (["generate", "--prompt", "x", "--k-bits", "5"], "invalid choice: 5"),
        (["generate", "--prompt", "x", "--residual-length", "100"], "--residual-length must be a positive multiple"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "must be a positive integer"),
        (["generate", "--prompt", "x", "--method", "int8"], "invalid choice: 'int8'"),
        (["generate", "--prompt", "x", "--top-p", "2"], r"--top-p must be in \(0, 1\]"),
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "cannot read --prompt-file"),
        (["generate", "--prompt", "x", "--device", "cuda"] if not torch.cuda.is_available() else ["nope"],
         "no CUDA device is available" if not torch.cuda.is_available() else "invalid choice"),
    ],
)
def test_cli_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    assert __import__("re").search(message, err), err


def test_cli_missing_model_directory(capsys):
    # a usage error (exit 2), as a missing .gguf is (issue 43)
    assert main(["generate", "--prompt", "x", "--model", "/nonexistent/model"]) == 2
    assert "--model must be" in (err := capsys.readouterr().err) and "(nothing is downloaded)" in err


def tiny_model(model_type):
    """A small random model of each supported family, built from its config (nothing downloaded)."""
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[model_type]
    extra = {}
    if model_type == "llama3_rope":  # Llama 3.x: frequency-dependent RoPE scaling
        extra["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64)
    config = cls_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                        **extra)
    if model_type in ("mistral", "phi3"):
        config.sliding_window = None  # full attention (sliding windows: tests/test_sliding_window.py)
    if model_type == "phi3":
        config.pad_token_id = 0  # Phi3Config's default pad id (32000) lies outside the tiny vocabulary
    torch.manual_seed(0)
    return cls_model(config).eval()


FAMILIES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_llama_family_models_match_unpatched_greedy(model_type):
    reference_model = tiny_model(model_type)
    patched = patch_model(tiny_model(model_type))
    prompt = [[5, 17, 99, 3, 42, 7]]
    with torch.inference_mode():
        want = reference_model.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=18, kivi_config=KIVIConfig(residual_length=32))
    got = generate(patched, prompt, max_new_tokens=12, cache=cache)
    assert got.tokens[0] == want[0, 6:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_through_compiled_hf_generate_matches_unpatched_greedy(model_type):
    # transformers' generate() compiles the decode steps with our cache (kivi_models.hf_generate):
    # every family's decoder layer compiles, and the tokens are transformers' own.
    reference_model = tiny_model(model_type)
    patched = patch_model(tiny_model(model_type))
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7]])
    want = reference_model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=18, kivi_config=KIVIConfig(residual_length=32))
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    got = patched.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, past_key_values=cache)
    assert got[0, 6:].tolist() == want[0, 6:].tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_llama3_rope_scaling_with_pre_rope_keys_matches_unpatched_greedy():
    # KVQuant's pre-RoPE cache rotates keys itself, from the model's (llama3-scaled) frequencies.
    reference_model = tiny_model("llama3_rope")
    patched = patch_model(tiny_model("llama3_rope"))
    prompt = [[5, 17, 99, 3, 42, 7]]
    with torch.inference_mode():
        want = reference_model.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=18,
                       kivi_config=KIVIConfig(residual_length=32, pre_rope=True))
    assert generate(patched, prompt, max_new_tokens=12, cache=cache).tokens[0] == want[0, 6:].tolist()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_quantized_cache_holds_each_family_within_half_a_step(model_type):
    # After a 24-token prompt (exact prefill attention, so both caches receive the same keys and
    # values), every dequantized value of the 2-bit cache is within half a quantization step of
    # the fp cache's: step = group range / 3. A key group spans G tokens of one channel and a value
    # group G channels of one token; the range over all the row's tokens of a channel (keys) or all
    # channels of a token (values) bounds each group's range, so half of it / 3 bounds the error.
    patched = patch_model(tiny_model(model_type))
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7, 11, 64, 2, 9, 33, 71, 8, 15, 27, 90, 4, 6, 120, 55, 13, 19, 77, 31]])
    caches = {m: make_cache(patched, method=m, batch_size=1, max_seq_len=32,
                            kivi_config=KIVIConfig(group_size=8, residual_length=8)) for m in ("kivi", "fp")}
    with torch.inference_mode():
        for cache in caches.values():
            patched(input_ids=prompt, past_key_values=cache, use_cache=True)
    for layer in range(patched.config.num_hidden_layers):
        (kq, vq), (k, v) = (caches[m].layers[layer].dequantized() for m in ("kivi", "fp"))
        key_bound = (k.amax(dim=2, keepdim=True) - k.amin(dim=2, keepdim=True)) / 3 / 2
        value_bound = (v.amax(dim=3, keepdim=True) - v.amin(dim=3, keepdim=True)) / 3 / 2
        assert ((kq - k).abs() <= key_bound + 1e-5).all() and ((vq - v).abs() <= value_bound + 1e-5).all()
        assert not torch.equal(kq, k)  # quantization did happen


def test_gemma2_is_refused_naming_what_is_missing():
    import transformers

    config = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="'gemma2' is not supported .*soft-capping .attn_logit_softcapping."):
        patch_model(transformers.Gemma2ForCausalLM(config))
    # Soft-capping in another family's config (Gemma 3 has the option) is refused by name too.
    config = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0: attention-logit soft-capping"):
        patch_model(transformers.Gemma3ForCausalLM(config))


# All in `make test-slow` (a cold Inductor build each): `make test` compiles the library's step in
# test_serve.py's server, and traces it with Dynamo in test_quiet_compile.py.
@pytest.mark.parametrize("method,regional", [
    pytest.param("kivi", None, marks=pytest.mark.slow),  # CPU default: one decoder layer compiled, run for all 30
    # FPCache's compiled step (its re-inplaced append) also runs in test_serve_paged's fp case
    pytest.param("fp", None, marks=pytest.mark.slow),
    pytest.param("kivi", False, marks=pytest.mark.slow),  # the whole step as one graph
    pytest.param("fp", False, marks=pytest.mark.slow),
    pytest.param("kivi-ott", None, marks=pytest.mark.slow),  # OTT's flush policy and outlier pool
])
def test_compiled_cpu_decode_is_one_inductor_graph_and_matches_eager(loaded, method, regional):
    # One compile per cache kind checks everything a compiled step promises:
    # - tokens equal eager decoding, across key flushes and value quantization;
    # - one graph for every step and, compiled regionally, for every layer (positions are
    #   tensors and each layer passes its LayerCache, not an index: no recompiles);
    # - on CPU a KIVICache's step runs its decomposed forms (kivi_ops/dispatch/__init__.py), which Inductor
    #   fuses, while the eager prefill runs the custom ops; FPCache's append is re-inplaced;
    # - no cache-sized buffer is allocated per step (that would be a copy of the cache).
    from torch._inductor.utils import run_and_get_code

    _, kivi_model, tok = loaded
    if regional is False:
        # The whole step as one graph: Inductor's cold build of the embedded model's 30 layers took
        # ten minutes of `make test-slow`; two layers of a random Llama make the same one graph.
        from tiny_models import tiny_llama
        kivi_model = patch_model(tiny_llama(vocab_size=len(tok), hidden_size=64, intermediate_size=128))
    prompts = [PROMPT, "def fibonacci(n):"]
    config = KIVIConfig(group_size=8, residual_length=8)  # key flushes and value quantization within the run
    if method == "kivi-ott":  # groups of 8 quantized every 8 steps, 3 tokens always exact, OTT steps
        # (a pool in every layer: layers with and without one would be two compiled graphs; a spill
        # pool of 4, so the 7-slot pool, rebuilt each step, is not mistaken below for a cache-sized copy)
        method, config = "kivi", KIVIConfig(group_size=8, residual_length=3, outlier_tokens=3, outlier_skip_layers=0,
                                            outlier_spill=4, flush_policy="ott")
    new_tokens = 20
    eager = run(kivi_model, tok, prompts, method=method, config=config, max_new_tokens=new_tokens)
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    step, codes = compile_decode_step(torch.device("cpu"), regional=regional), []

    def step_fn(*args):
        if codes:
            return step(*args)
        out, code = run_and_get_code(step, *args)
        codes.extend(code)
        return out

    ids = [tok(p)["input_ids"] for p in prompts]
    cache = make_cache(kivi_model, method=method, batch_size=2, max_seq_len=max(map(len, ids)) + new_tokens,
                       kivi_config=config)
    compiled = generate(kivi_model, ids, max_new_tokens=new_tokens, cache=cache, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.eos_token_id, step_fn=step_fn, warmup_steps=1)
    assert compiled.tokens == eager.tokens
    assert compiled.decode_tokens > 0  # the run did decode past the warm-up step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == 0
    code = "\n".join(codes)
    assert "torch.ops.kivi" not in code  # no opaque custom op left in the compiled step
    S = cache.max_seq_len
    for buf in cache.buffers():
        if buf.dim() == 4 and buf.shape[2] >= S:
            assert f"empty_strided_cpu({tuple(buf.shape)}" not in code, buf.shape
    assert not any("forward" in vars(layer) for layer in kivi_model.model.layers)  # the regions are gone again


def test_fp_cache_append_with_counts_matches_scatter_reference():
    from kivi_models import FPCache

    cache = FPCache(num_layers=1, batch_size=2, max_seq_len=8, num_kv_heads=2, head_dim=4)
    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    cache.layers[0].append(k, v, Step(counts=torch.tensor([3, 1])))
    k2, v2 = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    torch.compile(cache.layers[0].append, fullgraph=True)(k2, v2)
    assert cache.lengths().tolist() == [4, 2]
    want_k = torch.zeros(2, 2, 9, 4)
    want_k[0, :, :3], want_k[0, :, 3] = k[0], k2[0, :, 0]
    want_k[1, :, :1], want_k[1, :, 1] = k[1, :, :1], k2[1, :, 0]
    layer = cache.layers[0]
    torch.testing.assert_close(layer.k[:, :, :8], want_k[:, :, :8], rtol=0, atol=0)
    assert torch.equal(layer.v[0, :, 3], v2[0, :, 0]) and torch.equal(layer.v[1, :, 1], v2[1, :, 0])


def test_compiled_cpu_decode_step_past_capacity_raises_before_writing():
    # The decomposed append compiled on CPU cannot raise; the step checks the room before it runs.
    patched = patch_model(tiny_model("llama"))
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=6, kivi_config=KIVIConfig(residual_length=32))
    for layer in range(cache.num_layers):
        cache.layers[layer].lengths.fill_(6)
    before = [b.clone() for b in cache.buffers()]
    step = compile_decode_step(torch.device("cpu"))
    with pytest.raises(ValueError, match="cache is full: sequence 0 holds 6 tokens"):
        step(patched, cache, torch.tensor([5]), torch.tensor([6]))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers()))
