"""Fixes for two Triton-interpreter bf16 gaps, so CPU runs of the kernels compute what the GPU computes.

Installed by the kernels themselves the first time one runs in the interpreter (``_utils.check_kernel_device``),
so a user's CPU run of a bf16 kernel is right without asking; never used on a GPU, and a no-op unless
TRITON_INTERPRET=1.

1. tl.dot on bf16 operands: the interpreter holds bf16 values as uint16 bit patterns and multiplies the
   bits (triton-lang/triton#4972, #10945; maintainers: bf16 "not supported yet"). The GPU runs the dot on
   tensor cores with bf16 operands and fp32 accumulation; widening the operands to fp32 reproduces that
   exactly (bf16 -> fp32 is lossless). CONTRIBUTING.md 3a.
2. fp32 -> bf16 casts (``x.to(tl.bfloat16)``, e.g. on store) truncate the mantissa in the interpreter
   (cast_impl passes no rounding mode), while the GPU's cvt.rn.bf16.f32 rounds to nearest even:
   truncation doubles the rounding error of every bf16 output. Round like the GPU (torch's fp32 -> bf16
   conversion is RNE and keeps NaN/inf).
3. ``int()`` of a scalar tensor (``range(tl.program_id(0), n, step)``, tensor indices): triton <= 3.6 calls
   ``int()`` on the one-element 1-D array that holds the scalar, which numpy >= 2.4 refuses ("only
   0-dimensional arrays can be converted to Python scalars"); triton 3.8 squeezes first. Do what 3.8 does,
   so the interpreter runs with every numpy the installed triton accepts. Not a bf16 gap: it lives in
   vit_fast/_compat.py, and the kernels install it themselves whenever they run in the interpreter.
"""
from __future__ import annotations

import torch

from vit_fast._compat import install_interpreter_numpy_fix

_installed = False


def install_bf16_shims() -> bool:
    """Patch the interpreter (once): the fixes 1-3 above; returns whether the shims are active."""
    global _installed
    from vit_fast.kernels._utils import interpreter_active

    if not interpreter_active():
        return False
    if _installed:
        return True
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    create_dot, cast_impl = interp.InterpreterBuilder.create_dot, interp.InterpreterBuilder.cast_impl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot_bf16_as_fp32(self, a, b, d, *rest):
        return create_dot(self, widen(a), widen(b), d, *rest)

    def cast_impl_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    install_numpy_fix()
    interp.InterpreterBuilder.create_dot = create_dot_bf16_as_fp32
    interp.InterpreterBuilder.cast_impl = cast_impl_rne
    _installed = True
    return True


def install_numpy_fix() -> bool:
    """Fix 3 above alone (``vit_fast._compat.install_interpreter_numpy_fix``); returns whether it is active."""
    return install_interpreter_numpy_fix()
