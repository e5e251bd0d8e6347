"""Static-shape forms of the cache ops that torch.compile and torch.export trace (the CPU's compiled path)."""
