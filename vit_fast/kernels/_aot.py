"""The ahead-of-time compile spec every kernel module's ``aot_specs`` returns, and the helpers that
build its signature, for the GPU-readiness report (``vit-fast report``; CONTRIBUTING.md describes how
kernels are checked without a GPU). Nothing here compiles or touches a device.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

TRITON_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64"}

# Triton's CUDA default (CUDAOptions.num_stages): what a launch that passes no num_stages compiles with.
LAUNCH_DEFAULT_STAGES = 3


@dataclass(frozen=True)
class AotSpec:
    """One kernel launch as the GPU-readiness report compiles it ahead of time.

    ``signature`` maps every kernel argument to a Triton type string ('*bf16', 'i32', 'fp32',
    'constexpr'); ``constexprs`` gives the values of the constexpr arguments.
    """

    name: str  # e.g. "layer_norm_fwd"
    fn: Callable[..., Any]  # the @triton.jit kernel
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = LAUNCH_DEFAULT_STAGES
    has_dot: bool = False  # True where the PTX should use tensor-core instructions
    note: str = field(default="")  # which shape/config this entry serves
    # Arguments a real launch specialises as multiples of 16 (aligned pointers, strides): compile
    # them with attrs={(i,): [["tt.divisibility", 16]]}, else the AOT build gets scalar, unvectorised
    # loads and reports registers/spills a real launch does not have.
    divisible_by_16: tuple[str, ...] = ()
    # Why the SASS instruction-cost model (vit_fast/tools/sass.py) does not read this kernel, '' where it does:
    # `vit-fast report` prints n/a with the reason instead of a ceiling.
    not_modelled: str = ""


def kernel_signature(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Full Triton signature of a jit kernel: 'constexpr' for the given constexprs, else types[name]
    (names missing from types are row strides / sizes: 'i32')."""
    names = inspect.signature(fn.fn).parameters
    return {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in names}


def divisible_args(signature: dict[str, str], values: dict[str, int]) -> tuple[str, ...]:
    """Arguments a real launch specialises as multiples of 16 (AotSpec.divisible_by_16): every
    pointer (torch allocations, and the model's row views of them, are 16-byte aligned) and the
    integers whose launch value in ``values`` is a multiple of 16 (row strides and widths of
    multiple-of-16 widths, and 0 for an absent tensor's stride). Integers without a value (rows M,
    programs G: they depend on the batch) are not claimed."""
    return tuple(a for a, t in signature.items()
                 if t.startswith("*") or (t == "i32" and a in values and values[a] % 16 == 0))
