"""Without CUDA, Triton kernels in these tests run under the interpreter on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports infer8.attention.triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
