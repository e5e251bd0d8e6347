"""The cache layers (quantized, fp, sliding window; static and paged) and the caches made of them."""
