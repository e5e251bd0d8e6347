"""The Triton kernels of the cache ops (CUDA): quantize, append, split-K and decode attention."""
