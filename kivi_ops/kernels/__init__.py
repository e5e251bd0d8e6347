"""The implementations of the cache ops, one file per family; kivi_ops/implementations.py names each
(the table the ops run), kivi_ops/dispatch.py picks which runs."""
