"""Test session setup: run the Triton kernels in the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, so this happens at the top of
the first conftest pytest loads. On a CUDA machine the same tests run the compiled kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)) if "PYTEST_XDIST_WORKER" not in os.environ else 1)


# The interpreter's bf16 gaps (tl.dot on bf16 bits, truncating fp32 -> bf16 casts) are fixed by the
# package's shims, which `vit-fast check` uses too; see vit_fast/interpreter.py for the upstream issues.
from vit_fast.kernels._utils import interpreter_active  # noqa: E402 (after TRITON_INTERPRET is set)

if interpreter_active():
    from vit_fast.tools.interpreter import install_bf16_shims

    install_bf16_shims()
