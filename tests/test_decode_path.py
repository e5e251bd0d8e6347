"""How far a decode step travels: from `kivi generate` to the kernel, a decode step passes through
at most 7 project files (the CLI and its subcommand, the generation loop, the attention module,
the cache layer, the op, the kernel; the dispatcher decides in the layer and returns before the
op runs: it was on the stack, and the limit 8, until the op's kernel stopped choosing again). Measured, not declared: a profile hook records the project
frames on the stack when a cache kernel starts."""

import sys
from pathlib import Path

from kivi_cli.main import main

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
KERNEL_DIR = ROOT + "kivi_ops/kernels/"
MAX_FILES = 7


def project_stack(frame) -> list[tuple[str, str]]:
    """(file relative to the repository, function) of each project frame, outermost first."""
    chain = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(ROOT) and "/.venv/" not in path and "/tests/" not in path:
            chain.append((path[len(ROOT):], frame.f_code.co_name))
        frame = frame.f_back
    return chain[::-1]


def test_a_decode_step_crosses_at_most_seven_project_files():
    stacks = []  # the project stack at each entry to a kernel module's public function

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(KERNEL_DIR) and not code.co_name.startswith("_"):
            stack = project_stack(frame)
            if any(fn == "decode_step" for _, fn in stack) and not any(
                    path.startswith("kivi_ops/kernels/") for path, _ in stack[:-1]):
                stacks.append(stack)

    sys.setprofile(hook)
    try:
        assert main(["generate", "--prompt", "Hello", "--max-new-tokens", "2", "--method", "kivi"]) == 0
    finally:
        sys.setprofile(None)
    kernels = {stack[-1][1] for stack in stacks}
    assert {"append_reference", "attend_reference"} <= kernels  # eager CPU: both ops of the step
    for stack in stacks:
        files = list(dict.fromkeys(path for path, _ in stack))
        assert files[0] == "cli/main.py" and files[-1].startswith("kivi_ops/kernels/"), files
        assert len(files) <= MAX_FILES, " -> ".join(files)
