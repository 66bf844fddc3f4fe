"""Per-dtype error bounds (CONTRIBUTING.md 4), shared by the test suite and ``vit-fast check``.

Errors are measured against a float64 reference: relative norm error ||out - ref|| / ||ref|| and max abs
error. Low-precision results must also hold the flash-attention rule: at most 2x the error of eager
PyTorch run in the same dtype, plus a small slack for results eager gets exactly right.
"""
from __future__ import annotations

import torch

# Relative-norm bounds from the guide. "dot" is for ops with a matmul inside (fp32 via ieee dot).
BOUNDS = {
    ("elementwise", torch.float32): 1e-6,
    ("dot", torch.float32): 1e-5,
    ("elementwise", torch.float16): 1e-3,
    ("dot", torch.float16): 1e-3,
    ("elementwise", torch.bfloat16): 1e-2,
    ("dot", torch.bfloat16): 1e-2,
}

# The "+ small atol" of the 2x-eager rule.
EAGER_SLACK = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def bound(dtype: torch.dtype, kind: str = "elementwise") -> float:
    return BOUNDS[(kind, dtype)]


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative norm error, max abs error) of out against ref, both computed in float64.
    Positions where the reference is not finite are left out; NaN in out elsewhere gives NaN."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref64)
    diff = (out64 - ref64)[finite]
    denom = ref64[finite].norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    return rel, max_abs
