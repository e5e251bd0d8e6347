"""Without CUDA, Triton kernels run in the interpreter; it must be enabled before any kernel module
is imported, whichever test module imports one first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
