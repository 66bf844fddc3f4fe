"""Test session setup: run the Triton kernels in the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, so this happens at the top of
the first conftest pytest loads. On a CUDA machine the same tests run the compiled kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)) if "PYTEST_XDIST_WORKER" not in os.environ else 1)


def _install_bf16_dot_shim() -> None:
    """Test-only fix for a Triton interpreter gap, never used on a GPU.

    The interpreter holds bf16 values as uint16 bit patterns, and tl.dot on bf16 operands
    multiplies the bits (triton-lang/triton#4972, #10945; maintainers: bf16 "not supported yet").
    The GPU runs the same dot on tensor cores with bf16 operands and fp32 accumulation; widening
    the operands to fp32 here reproduces that exactly (bf16 -> fp32 is lossless). GUIDE.md 3a.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    create_dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot_bf16_as_fp32(self, a, b, d, *rest):
        return create_dot(self, widen(a), widen(b), d, *rest)

    interp.InterpreterBuilder.create_dot = create_dot_bf16_as_fp32


if os.environ.get("TRITON_INTERPRET") == "1":
    _install_bf16_dot_shim()
