"""Which implementation a module runs: the fused Triton kernels or the pure-PyTorch reference.

    'torch'   the reference ops (nn.Linear, F.layer_norm, SDPA, ...): runs anywhere, the test oracle.
    'triton'  the fused kernels (vit_fast.kernels); needs CUDA tensors, or CPU tensors with the
              Triton interpreter on (TRITON_INTERPRET=1 set before triton is imported). Anything
              else is a RuntimeError, never a silent fallback to the reference.
    'auto'    'triton' for CUDA tensors (and for CPU tensors under the interpreter, which is how
              the CPU test suite runs the kernels), 'torch' otherwise.

The choice is made per call from the tensor the module receives, so one model follows
``model.to(device)`` without being rebuilt.
"""
from __future__ import annotations

import torch

from vit_fast.kernels._utils import interpreter_active

BACKENDS = ("auto", "triton", "torch")


def check_backend(backend: str) -> str:
    """Validate a backend name (ValueError naming the choices)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def kernels_can_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreter_active())


def resolve_backend(requested: str, tensor: torch.Tensor) -> str:
    """'triton' or 'torch' for a module asked to run ``requested`` on ``tensor``'s device."""
    check_backend(requested)
    if requested == "torch":
        return "torch"
    if kernels_can_run_on(tensor.device):
        return "triton"
    if requested == "auto":
        return "torch"
    raise RuntimeError(
        f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before triton "
        f"is imported), got a tensor on {tensor.device}; use backend='auto' or 'torch' to run the reference "
        f"PyTorch path there")
