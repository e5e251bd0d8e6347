"""The plugin's tests run vLLM in this process (no engine-core subprocess), on a small KV budget,
with tiny random models written once per session (no hub)."""

import gc
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the machine is shared
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


def _save(config, path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: decisive logits, stable argmax
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig

    return _save(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
                 tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from transformers import Qwen2Config

    return _save(Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                             use_sliding_window=False), tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    from transformers import Gemma3TextConfig

    return _save(Gemma3TextConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                  max_position_embeddings=1024, sliding_window=64),
                 tmp_path_factory.mktemp("gemma3"))


def make_llm(model_dir, kivi=None, **options):
    from vllm import LLM

    settings = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=512, block_size=32,
                    max_num_seqs=8, enable_prefix_caching=False)
    settings.update(options)
    return LLM(model_dir, additional_config={"kivi": kivi} if kivi else {}, **settings)


def close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy_outputs(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
