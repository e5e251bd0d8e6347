"""KIVI KV-cache quantization for PyTorch: custom ops, a static quantized cache and fused attention."""

from . import ops  # noqa: F401  registers torch.ops.kivi.*
from .cache.static import FPCache, KIVICache, StaticCacheBase, cache_capacity, fp16_cache_nbytes
from .config import KIVIConfig
from .cache.fp_layer import FPLayer
from .cache.layer import CacheLayer, KIVILayer
from .cache.paged import PagedKIVICache, PagedKIVILayer, pages_needed
from .ops.quantized import QuantizedTensor, fake_quantize, quantize
from .cache.step import Step
from .cache.window_layer import WindowLayer

__all__ = ["KIVIConfig", "KIVICache", "FPCache", "StaticCacheBase", "CacheLayer", "KIVILayer", "FPLayer", "WindowLayer",
           "PagedKIVICache", "PagedKIVILayer", "pages_needed", "Step", "QuantizedTensor", "quantize", "fake_quantize", "fp16_cache_nbytes", "cache_capacity"]
