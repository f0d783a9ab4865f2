"""The Triton modules as these tests need them: compiled on CUDA, interpreted on CPU.

Triton reads TRITON_INTERPRET when a kernel is defined, so without CUDA it is set before the
first import, and modules imported earlier without it are reloaded in dependency order
(helpers first, so the reloaded kernels call interpreted helpers).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
_ORDER = (
    "infer8.attention.triton.write",
    "infer8.attention.triton.tail",
    "infer8.attention.triton.tail_write",
    "infer8.attention.triton.tiles",
    "infer8.attention.triton.decode",
    "infer8.attention.triton.prefill",
    "infer8.attention.triton.launch",
    "infer8.attention.triton.backend",
    "infer8.worker.cuda_graphs",
)


def load() -> dict[str, ModuleType]:
    """Return the modules of _ORDER by short name, interpreted where there is no GPU."""
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    modules = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in _ORDER}
    if not HAS_CUDA and not modules["launch"].is_interpreted():
        modules = {short: importlib.reload(m) for short, m in modules.items()}
    return modules
