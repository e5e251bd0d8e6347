"""KIVI for Hugging Face Llama-family models: patched attention, static caches, generation, CLI."""

import logging


class _DropKnownImportNoise(logging.Filter):
    """Drop only torchao's "CUDA extensions cannot load" and torch's pytree deprecation log lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") and "torchao" in message
                    or "is an Enum subclass and is now natively supported" in message)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_DropKnownImportNoise())

from kivi_ops import FPCache, KIVICache, Step

from .attention import KIVIAttention, patch_model
from .generate import GenerationResult, SamplingConfig, compile_decode_step, decode_step, generate, make_cache
from .loading import load_model

__all__ = [
    "KIVIAttention", "patch_model", "FPCache", "KIVICache", "Step", "load_model", "make_cache", "generate",
    "GenerationResult", "SamplingConfig", "decode_step", "compile_decode_step",
]
