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


def _install_bf16_round_to_nearest_shim() -> None:
    """Test-only fix for a second interpreter bf16 gap, never used on a GPU.

    The interpreter's fp32 -> bf16 cast (``x.to(tl.bfloat16)``, e.g. on store) truncates the
    mantissa (cast_impl passes no rounding mode to _convert_float), while the GPU's cvt.rn.bf16.f32
    rounds to nearest even: truncation doubles the rounding error of every bf16 output. Round
    like the GPU (torch's fp32 -> bf16 conversion is RNE and keeps NaN/inf).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    cast_impl = interp.InterpreterBuilder.cast_impl

    def cast_impl_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl_rne


if os.environ.get("TRITON_INTERPRET") == "1":
    _install_bf16_dot_shim()
    _install_bf16_round_to_nearest_shim()
