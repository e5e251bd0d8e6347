"""The implementations of the cache ops, one folder per family (reference, decomposed, triton, cuda);
kivi_ops/dispatch/implementations.py names each (the table the ops run), kivi_ops/dispatch/ picks which runs."""
