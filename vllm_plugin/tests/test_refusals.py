"""What the KIVI backend cannot serve is refused when the engine's config is built (or the model's
layers are), with a message naming it; nothing falls back to a 16-bit cache."""

import pytest

from conftest import make_llm

KIVI2 = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 128}


def _config(model_dir, kivi, **options):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=512,
                block_size=32, additional_config={} if kivi is None else {"kivi": kivi})
    args.update(options)
    return EngineArgs(**args).create_engine_config()


@pytest.mark.parametrize("kivi, options, message", [
    (KIVI2, {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 cannot be combined"),
    ({**KIVI2, "k_bits": 3}, {}, "k_bits must be one of (2, 4)"),
    ({**KIVI2, "v_bits": 8}, {}, "v_bits must be one of (2, 4)"),
    ({**KIVI2, "sink_tokens": 4}, {}, "unknown or unsupported keys ['sink_tokens']"),
    ({**KIVI2, "residual_length": 100}, {}, "residual_length must be a positive multiple of group_size=32"),
    ({**KIVI2, "group_size": 64}, {}, "--block-size 32 must be a multiple of the KIVI group_size=64"),
    ([2, 2], {}, '"kivi" must be an object'),
    ({**KIVI2, "prefix_chunk": 48}, {}, "prefix_chunk=48 must be a multiple of --block-size 32"),
    ({**KIVI2, "prefix_cache_mib": 0}, {}, "prefix_cache_mib must be a positive int, got 0"),
    ({**KIVI2, "prefix_chunk": 128}, {"max_num_batched_tokens": 96, "enable_prefix_caching": True},
     "--max-num-batched-tokens 96 is below the KIVI prefix_chunk (128 tokens)"),
])
def test_bad_settings_are_refused(tiny_llama, kivi, options, message):
    with pytest.raises(Exception) as info:
        _config(tiny_llama, kivi, **options)
    assert message in str(info.value)


def test_prefix_caching_stays_on(tiny_llama):
    config = _config(tiny_llama, KIVI2, enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True


def test_without_kivi_nothing_changes(tiny_llama):
    config = _config(tiny_llama, None, enable_prefix_caching=True, kv_cache_dtype="auto")
    assert config.cache_config.enable_prefix_caching is True and "kivi" not in config.additional_config


def test_sliding_window_model_is_refused(tiny_gemma3):
    with pytest.raises(Exception) as info:
        make_llm(tiny_gemma3, KIVI2)
    assert "the KIVI cache does not support sliding-window attention" in str(info.value)


def test_kv_connectors_are_refused(tiny_llama):
    from kivi_vllm.options import check_engine, kivi_options

    config = _config(tiny_llama, KIVI2)
    config.kv_transfer_config = object()  # any connector: a request could resume mid-sequence
    with pytest.raises(ValueError, match="does not support KV connectors"):
        check_engine(config, kivi_options(config))
