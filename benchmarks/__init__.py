"""Quality (`kivi eval`) and performance (`kivi bench`) harnesses; installed as `kivi_benchmarks`."""
