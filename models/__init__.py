"""KIVI for Hugging Face Llama-family models: patched attention, static caches, generation, CLI."""

from .attention import KIVIAttention, patch_model
from .fp_cache import FPCache
from .generate import GenerationResult, SamplingConfig, compile_decode_step, decode_step, generate, make_cache
from .hf_cache import KIVIHFCache
from .loading import load_model

__all__ = [
    "KIVIAttention", "patch_model", "FPCache", "KIVIHFCache", "load_model", "make_cache", "generate",
    "GenerationResult", "SamplingConfig", "decode_step", "compile_decode_step",
]
