"""`python tensor_parallel_run.py MODEL TP`: greedy outputs of vLLM + KIVI-2 at tensor parallel size
TP as one line, OUTPUTS and JSON (a script: vLLM's worker processes are spawned and re-import __main__)."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
KIVI2 = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}


def main():
    from conftest import close, greedy_outputs, make_llm
    from test_kivi_engine import prompts

    model, tp = sys.argv[1], int(sys.argv[2])
    llm = make_llm(model, KIVI2, tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None)
    try:
        print("OUTPUTS", json.dumps(greedy_outputs(llm, prompts(4), 40)), flush=True)
    finally:
        close(llm)


if __name__ == "__main__":
    main()
