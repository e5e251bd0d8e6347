"""KIVI KV-cache quantization for PyTorch: custom ops, a static quantized cache and fused attention."""

from . import ops  # noqa: F401  registers torch.ops.kivi.*
from .cache import KIVICache, StaticCacheBase, fp16_cache_nbytes
from .config import KIVIConfig
from .quantized import QuantizedTensor, fake_quantize, quantize

__all__ = ["KIVIConfig", "KIVICache", "QuantizedTensor", "quantize", "fake_quantize", "fp16_cache_nbytes"]
