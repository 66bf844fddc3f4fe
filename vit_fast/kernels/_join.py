"""The residual join ``out = residual + s[b] * gamma * dropout(x + bias)`` as @triton.jit math,
shared by ``bias_gelu.bias_dropout_add`` and ``layer_norm.add_layer_norm`` so both kernels compute
the same join and, for the same seed, draw the same dropout mask (offsets are the logical element
index row * N + col), plus the host-side validation and dropout choice of a join.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._rows import check_param
from ._utils import check_float, check_kernel_device, check_shape, dropout_keep_mask, next_seed


@triton.jit
def dropout(v, SEED, offsets, p, HAS_DROPOUT: tl.constexpr):
    """Inverted dropout of v; also its backward (the same mask and scale). SEED points at the Philox seed, drawn
    on the device (kernels/_utils.next_seed: a CUDA graph's replays each read the seed drawn in them); it is
    loaded where the mask is drawn, a cached load, so no register holds it across the kernels' row loops. A
    dropped element is multiplied by 0, as torch's dropout does, so a NaN or inf in it stays NaN."""
    if HAS_DROPOUT:
        v = tl.where(dropout_keep_mask(tl.load(SEED), offsets, p), v / (1.0 - p), v * 0.0)
    return v


@triton.jit
def residual_join_fwd(residual, x, bias, gamma, scale, SEED, offsets, p,
                      HAS_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_DROPOUT: tl.constexpr):
    """residual + scale * gamma * dropout(x + bias), fp32 tiles (absent factors are not read)."""
    branch = x
    if HAS_BIAS:
        branch = branch + bias
    branch = dropout(branch, SEED, offsets, p, HAS_DROPOUT)
    if HAS_GAMMA:
        branch = branch * gamma
    if HAS_SCALE:
        branch = branch * scale
    return residual + branch


@triton.jit
def residual_join_bwd(g, x, bias, gamma, scale, SEED, offsets, p,
                      HAS_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_DROPOUT: tl.constexpr):
    """From g = d(out): (dx, dgamma term). dx = g * scale * gamma * mask/(1-p) (also d bias);
    the dgamma term g * scale * dropout(x + bias) is only computed (and x only needed) with gamma."""
    if HAS_SCALE:
        g = g * scale
    dgamma_term = g
    if HAS_GAMMA:
        branch = x
        if HAS_BIAS:
            branch = branch + bias
        dgamma_term = g * dropout(branch, SEED, offsets, p, HAS_DROPOUT)
        g = g * gamma
    return dropout(g, SEED, offsets, p, HAS_DROPOUT), dgamma_term


def stores_dx(p: float, gamma, sample_scale, grad_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """Whether a residual join's backward must write dx: not when dx is the incoming gradient."""
    return p > 0 or gamma is not None or sample_scale is not None or grad_dtype != x_dtype


def rows_per_sample(op: str, m: int, sample_scale: Optional[torch.Tensor]) -> int:
    """Rows of the (M, N) view per entry of the drop-path scale (the kernels index it as ``row // tokens``); 1
    without one. The functionals check its length (``check_sample_scale``); a direct custom-op call with a
    length that does not divide the rows is refused here rather than read out of bounds."""
    if sample_scale is None or m == 0:
        return 1
    samples = sample_scale.shape[0]
    if samples == 0 or m % samples:
        raise ValueError(f"{op}: expected sample_scale with one entry per sample ({m} rows), got {samples} entries")
    return m // samples


def check_sample_scale(op: str, sample_scale: Optional[torch.Tensor], x: torch.Tensor) -> None:
    if sample_scale is None:
        return
    check_float(op, "sample_scale", sample_scale, (torch.float32,))
    check_shape(op, "sample_scale", sample_scale, (x.shape[0],))


def prepare_join(op: str, x: torch.Tensor, residual: torch.Tensor, bias: Optional[torch.Tensor],
                 gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor], p: float, training: bool,
                 *more: Optional[torch.Tensor], bias_name: str = "bias",
                 p_name: str = "p") -> tuple[float, Optional[torch.Tensor]]:
    """Validate a residual join's inputs (x already checked) and pick its dropout: returns (p, seed),
    seed a ``next_seed(x.device)`` tensor; p = 0 and seed None (nothing drawn from torch's generator) in eval
    mode or for p = 0."""
    n = x.shape[-1]
    check_float(op, "residual", residual)
    check_shape(op, "residual", residual, tuple(x.shape))
    check_param(op, bias_name, bias, n)
    check_param(op, "gamma", gamma, n)
    check_sample_scale(op, sample_scale, x)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: expected dropout probability {p_name} in [0, 1], got {p}")
    check_kernel_device(op, x, residual, bias, gamma, sample_scale, *more)
    p = float(p) if training else 0.0
    return p, (next_seed(x.device) if p > 0 else None)
