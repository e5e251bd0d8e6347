"""torchao weight-only int8 / int4 quantization of the decoder's Linear layers (docs/deploy.md). A
tied lm_head stays float: quantizing it would keep the float embedding too and break the tie."""

from __future__ import annotations

import warnings

import torch

WEIGHT_QUANT_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (128, 64, 32)  # tinygemm's group sizes, preferred order (in_features must be a multiple)


def check_weight_quant(mode: str, device) -> None:
    """Raise ValueError unless `mode` can run on `device` (callable before the model is loaded)."""
    device = torch.device(device)
    if mode not in WEIGHT_QUANT_MODES:
        raise ValueError(f"--weight-quant must be one of {', '.join(WEIGHT_QUANT_MODES)}; got {mode!r}")
    if mode == "int4":
        if device.type != "cuda":
            raise ValueError(
                f"--weight-quant int4 needs a CUDA device (torchao's int4 weight-only kernel, tinygemm, is "
                f"CUDA-only); the model is on {device.type}. On CPU use --weight-quant int8 (or none); "
                f"allowed: {', '.join(WEIGHT_QUANT_MODES)}"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ValueError(f"--weight-quant int4 needs a CUDA GPU of compute capability >= 8.0 (tinygemm); "
                             f"this one is {major}.{minor}. Use --weight-quant int8")


def quantized_linear_names(model) -> list[str]:
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not (tied and m is out_emb)]


def apply_weight_quant(model, mode: str):
    """Quantize `model`'s Linear weights in place ("none": untouched); returns the model."""
    device = next(model.parameters()).device
    check_weight_quant(mode, device)
    if mode == "none":
        return model
    if getattr(model, "kivi_weight_quant", "none") != "none":
        raise ValueError(f"the model's weights are already quantized ({model.kivi_weight_quant}); load it again")
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    # torch.compile's warning that it cannot cache torchao's tensors only skips a cache: noise.
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching")

    names = set(quantized_linear_names(model))
    # set_inductor_config=False: torchao's default flips process-wide Inductor settings, which would
    # change how an unquantized model compiled beside it does. int4's packing needs no mslk package.
    if mode == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        linears = [m for n, m in model.named_modules() if n in names]
        group = next((g for g in INT4_GROUP_SIZES if all(m.in_features % g == 0 for m in linears)), None)
        if group is None:
            raise ValueError(f"--weight-quant int4: no group size in {INT4_GROUP_SIZES} divides every Linear's "
                             f"in_features ({sorted({m.in_features for m in linears})})")
        for m in linears:  # tinygemm packs bfloat16 weights only
            m.weight.data = m.weight.data.to(torch.bfloat16)
            if m.bias is not None:
                m.bias.data = m.bias.data.to(torch.bfloat16)
        config = Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d",
                                      set_inductor_config=False)
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in names)
    model.kivi_weight_quant = mode  # for reporting
    return model


def tensor_nbytes(t: torch.Tensor) -> int:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):  # tensor parallelism (parallel.py): this rank's shard
        return tensor_nbytes(t.to_local())
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(inner) for inner in (getattr(t, n) for n in names) if inner is not None)
    return t.numel() * t.element_size()


def model_weight_nbytes(model) -> int:
    """Bytes of the model's parameters and buffers (tied ones once, quantized ones as packed)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_nbytes(t)
    return total
