"""The implementations of the cache ops, one file per family; kivi_ops/dispatch.py picks which runs."""
