"""What a result was measured on: the one record of versions, machine and code that every JSON
result carries (`kivi bench`, `kivi eval table` and the lab's studies)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Optional

import torch


def git_revision() -> Optional[str]:
    """HEAD's sha, with "+uncommitted" when tracked files differ from it (what a result measured);
    None outside a git checkout. KIVI_GIT_SHA overrides it: the lent GPU machine receives the
    working tree with a copy of .git that can be stale, so the caller names the sha it sent."""
    if os.environ.get("KIVI_GIT_SHA"):
        return os.environ["KIVI_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+uncommitted" if dirty else "")


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def environment(device: str = "cpu", command: Optional[str] = None) -> dict:
    """Versions (torch, triton, transformers, python), the device (the GPU's name, or the CPU's),
    torch's intra-op threads, the git revision and the command (default: this `kivi` command line)."""
    return dict(
        torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
        python=platform.python_version(), machine=platform.machine(),
        device=torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine()),
        threads=torch.get_num_threads(), git_sha=git_revision(),
        command=command if command is not None else " ".join(["kivi", *sys.argv[1:]]),
    )
