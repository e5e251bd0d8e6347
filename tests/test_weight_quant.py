"""torchao weight-only quantization (`--weight-quant`): what gets quantized, the byte count, KIVI +
int8 weights under torch.compile, and the errors. Small random Llama models, nothing downloaded."""

import pytest
import torch

from kivi_models import compile_decode_step, generate, make_cache, patch_model
from kivi_cli.main import main
from kivi_models.weight_quant import (WEIGHT_QUANT_MODES, apply_weight_quant, model_weight_nbytes,
                                      quantized_linear_names, tensor_nbytes)
from kivi_ops import KIVIConfig


def tiny_llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_int8_turns_linear_weights_into_torchao_tensors_and_shrinks_the_model():
    from torchao.quantization import Int8Tensor

    model = tiny_llama()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    linear_params = sum(m.weight.numel() for m in linears.values())
    rows = sum(m.out_features for m in linears.values())
    before = model_weight_nbytes(model)
    assert before == sum(p.numel() * 4 for p in model.parameters()) + sum(b.nbytes for b in model.buffers())

    assert apply_weight_quant(model, "int8") is model
    for name, m in linears.items():
        assert isinstance(m.weight, Int8Tensor), name
        assert m.weight.qdata.dtype == torch.int8 and m.weight.qdata.shape == m.weight.shape
    assert not isinstance(model.get_input_embeddings().weight, Int8Tensor)
    # Real bytes: 1 per weight + a float32 scale and an int8 zero point (stored, though symmetric)
    # per output channel, instead of 4 per weight.
    assert model_weight_nbytes(model) == before - 3 * linear_params + 5 * rows
    assert model_weight_nbytes(model) < 0.6 * before
    assert tensor_nbytes(model.lm_head.weight) == model.lm_head.weight.numel() + 5 * model.lm_head.out_features


def test_tied_lm_head_stays_unquantized_and_tied():
    model = tiny_llama(tied=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert "lm_head" not in quantized_linear_names(model)
    apply_weight_quant(model, "int8")
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one fp table, counted once
    assert type(model.lm_head.weight) is torch.nn.Parameter and model.lm_head.weight.dtype == torch.float32


@pytest.mark.slow  # a cold Inductor build; the eager int8 tests above run in `make test`
def test_int8_weights_kivi2_compiled_decode_matches_eager():
    model = patch_model(apply_weight_quant(tiny_llama(), "int8"))
    prompt = [[5, 17, 99, 3, 42, 7, 11, 250, 64, 1]]
    config = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8)  # flushes within the run

    def run(**kwargs):
        cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=40, kivi_config=config)
        return generate(model, prompt, max_new_tokens=24, cache=cache, **kwargs).tokens

    eager = run()
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run(step_fn=compile_decode_step(torch.device("cpu")), warmup_steps=1)
    assert compiled == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == 0
    # The int8 weights changed the model (else the comparison would prove nothing about them).
    fp = patch_model(tiny_llama())
    cache = make_cache(fp, method="kivi", batch_size=1, max_seq_len=40, kivi_config=config)
    with torch.inference_mode():
        logits_fp = fp(input_ids=torch.tensor(prompt), past_key_values=cache, use_cache=True).logits
        cache_q = make_cache(model, method="kivi", batch_size=1, max_seq_len=40, kivi_config=config)
        logits_q = model(input_ids=torch.tensor(prompt), past_key_values=cache_q, use_cache=True).logits
    assert 0 < (logits_fp - logits_q).abs().max() < 0.1 * logits_fp.abs().max()


def test_none_is_a_no_op():
    model = tiny_llama()
    before = model_weight_nbytes(model)
    assert apply_weight_quant(model, "none") is model
    assert type(model.lm_head.weight) is torch.nn.Parameter and model_weight_nbytes(model) == before


def test_bad_modes_give_clear_errors():
    assert WEIGHT_QUANT_MODES == ("none", "int8", "int4")
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"--weight-quant must be one of none, int8, int4; got 'int3'"):
        apply_weight_quant(model, "int3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--weight-quant int4 needs a CUDA device.*on cpu.*int8"):
            apply_weight_quant(model, "int4")
        assert type(model.lm_head.weight) is torch.nn.Parameter  # nothing half-quantized


def test_cli_rejects_int4_on_cpu_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--device", "cpu", "--weight-quant", "int4", "--model", "/nonexistent"])
    assert e.value.code == 2
    assert "--weight-quant int4 needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--weight-quant", "int3"])
    assert e.value.code == 2
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "weight-quant", "--device", "cpu", "--modes", "none,int4"])
    assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["eval", "ppl", "--corpus", "pydoc", "--device", "cpu", "--weight-quant", "int4"])
    assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
