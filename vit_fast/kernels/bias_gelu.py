"""Fused bias + GELU and fused bias + dropout + residual join (the MLP's fc1 epilogue and the
proj / fc2 outputs joining the residual stream), forward and backward.

Math, over the last dimension (width N) of x viewed as M rows, ``h = x + bias``:

* ``bias_gelu``: ``y = GELU(h)``; exact ``0.5 h (1 + erf(h / sqrt 2))`` or ``approximate='tanh'``
  ``0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))``. Backward recomputes h from the saved x and
  bias (the output is not saved): ``dx = dy * GELU'(h)``, ``dbias = sum_rows dx``.
* ``bias_dropout_add``: ``out = residual + s[b] * gamma * dropout(h)`` with inverted dropout
  (kept elements scaled by 1/(1-p)), optional LayerScale ``gamma`` (N,) and optional per-sample
  drop-path scale ``s`` (B,) fp32 (0 or 1/keep_prob), ``b = row // tokens_per_sample`` with x
  of shape (B, ..., N). Backward: ``dresidual = dout`` (returned as is, no kernel),
  ``dx = dout * s * gamma * mask / (1-p)``, ``dbias = sum_rows dx``,
  ``dgamma = sum_rows dout * s * dropout(h)``. No gradient for ``s``.

The residual-join math is the @triton.jit pair ``residual_join_fwd`` / ``residual_join_bwd``,
shared with ``layer_norm.add_layer_norm`` so both kernels compute the same join (and, for the
same seed, the same dropout mask: offsets are the logical element index row * N + col).

Dropout: the keep-mask is drawn in-kernel by ``_utils.dropout_keep_mask(seed, offset, p)``
(Philox via tl.rand) and never stored; backward regenerates it from the same seed. The seed
comes from ``_utils.next_seed()`` once per call as a 1-element CPU tensor (torch's CPU generator,
so ``torch.manual_seed`` and activation checkpointing replay it; torch.compile traces the draw, no
graph break), is read as an int only inside the custom ops, and is saved for backward. ``p == 0`` or
``training=False`` compiles the kernel without the draw (constexpr HAS_DROPOUT).

Dtypes: x fp32/fp16/bf16; bias / gamma may be fp32 while x is half (autocast), grads then come
back in the parameter's dtype. All math in fp32; outputs cast on store. ``bias_gelu`` returns
x.dtype; ``bias_dropout_add`` returns ``promote_types(x.dtype, residual.dtype)``.

Traffic per element of x (s = bytes of x's dtype, 2 for bf16; per-column parameters and the
fp32 partial-sum buffers are O(N * programs) and ignored). Launches per call in brackets:

  bias_gelu          fwd: read x, write y = 2s [1]     bwd: read x, dy, write dx = 3s [2]
  bias_dropout_add   fwd: read x, residual, write out = 3s [1]
                     bwd: plain (no dropout/gamma/scale): read dout = 1s (dx is dout) [2];
                          with dropout or scale: read dout, write dx = 2s [2];
                          with gamma: + read x = 3s [2]
                     (the plain join with bias=None launches nothing in backward.)
The two backward launches are the row-tile kernel and ``sum_partials`` (deterministic column
sums of the per-program fp32 partials; no atomics). Eager PyTorch for bias_gelu moves
add (3s) + gelu (2s) = 5s forward and 6s+ backward.

Limits: widths 1..16384 tested 64..16384 (5120 = ViT-H); any leading shape, 0 rows included.
Compiled for sm_80 / sm_90 (aot_specs with the launch's 16-divisibility, the report's presets,
every flag combination): 28-106 registers, no spills.
Inputs whose last dimension is not contiguous are copied once (documented "copy at most");
row strides are passed to the kernels.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning
from ._tuning import bucket
from ._utils import (
    LAUNCH_DEFAULT_STAGES,
    TRITON_DTYPE_NAMES,
    AotSpec,
    check_float,
    check_kernel_device,
    check_shape,
    dropout_keep_mask,
    next_power_of_2,
    next_seed,
    seed_value,
    unit_stride,
)

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # jit globals must be constexpr
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# --------------------------------------------------------------------------- shared jit helpers
@triton.jit
def _tanh(u):
    # tanh from exp (saturates to +-1 without overflow trouble: exp(+inf) -> 1 - 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _gelu_fwd_bwd(h, APPROX_TANH: tl.constexpr):
    """(GELU(h), GELU'(h)) in fp32."""
    if APPROX_TANH:
        t = _tanh((h + 0.044715 * h * h * h) * _SQRT_2_OVER_PI)  # tensor first: constexpr * tensor breaks the interpreter
        y = 0.5 * h * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * h * h)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(h * _SQRT1_2))
        y = h * cdf
        dy = cdf + h * tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
    return y, dy


@triton.jit
def _dropout(v, seed, offsets, p, HAS_DROPOUT: tl.constexpr):
    """Inverted dropout of v; also its backward (the same mask and scale)."""
    if HAS_DROPOUT:
        v = tl.where(dropout_keep_mask(seed, offsets, p), v / (1.0 - p), 0.0)
    return v


@triton.jit
def residual_join_fwd(residual, x, bias, gamma, scale, seed, offsets, p,
                      HAS_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_DROPOUT: tl.constexpr):
    """residual + scale * gamma * dropout(x + bias), fp32 tiles (absent factors are not read)."""
    branch = x
    if HAS_BIAS:
        branch = branch + bias
    branch = _dropout(branch, seed, offsets, p, HAS_DROPOUT)
    if HAS_GAMMA:
        branch = branch * gamma
    if HAS_SCALE:
        branch = branch * scale
    return residual + branch


@triton.jit
def residual_join_bwd(g, x, bias, gamma, scale, seed, offsets, p,
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
        dgamma_term = g * _dropout(branch, seed, offsets, p, HAS_DROPOUT)
        g = g * gamma
    return _dropout(g, seed, offsets, p, HAS_DROPOUT), dgamma_term


@triton.jit
def _sum_partials_kernel(
    OUT,  # (K, N) column sums, in the parameters' dtype
    PARTIAL,  # (K, G, N) fp32 per-program partial sums, contiguous
    G, N,  # programs that wrote partials, width
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):  # fixed order: bitwise reproducible
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g[:, None] < G) & (cols[None, :] < N)
        tile = tl.load(PARTIAL + (k * G + g[:, None]).to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(OUT + k * N + cols, acc.to(OUT.dtype.element_ty), mask=cols < N)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _bias_gelu_fwd_kernel(
    Y,  # (M, N) output
    X, BIAS,  # (M, N) pre-activation without bias; (N,) bias or None
    stride_xm, stride_ym,  # row strides (columns are contiguous)
    M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    h = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y, _ = _gelu_fwd_bwd(h, APPROX_TANH)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DX, PARTIAL,  # (M, N) grad of x; (1, G, N) fp32 partial column sums of dx (for dbias)
    DY, X, BIAS,
    stride_dym, stride_xm, stride_dxm,
    M, N, G,  # G = programs along the rows = partial rows
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
):
    pid_g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] if HAS_BIAS else 0.0
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(pid_g, tl.cdiv(M, BLOCK_M), G):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        h = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32) + bias
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, dgelu = _gelu_fwd_bwd(h, APPROX_TANH)
        dx = tl.where(mask, dy * dgelu, 0.0)
        tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        acc += tl.sum(dx, axis=0)
    if HAS_BIAS:
        tl.store(PARTIAL + pid_g * N + cols, acc, mask=cols < N)


@triton.jit
def _bias_dropout_add_fwd_kernel(
    OUT,  # (M, N) residual + s * gamma * dropout(x + bias)
    X, BIAS, RES, GAMMA, SCALE,  # (M, N), (N,) or None, (M, N), (N,) or None, (B,) fp32 or None
    stride_xm, stride_rm, stride_om,
    M, N, tokens_per_sample,  # row r belongs to sample r // tokens_per_sample
    seed, p,  # dropout seed (int) and probability (only read with HAS_DROPOUT)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    res = tl.load(RES + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] if HAS_BIAS else 0.0
    gamma = tl.load(GAMMA + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] if HAS_GAMMA else 0.0
    scale = tl.load(SCALE + rows // tokens_per_sample, mask=rows < M, other=0.0)[:, None] if HAS_SCALE else 0.0
    out = residual_join_fwd(res, x, bias, gamma, scale, seed, rows[:, None] * N + cols[None, :], p,
                            HAS_BIAS, HAS_GAMMA, HAS_SCALE, HAS_DROPOUT)
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_dropout_add_bwd_kernel(
    DX, PARTIAL,  # (M, N) grad of x (only with STORE_DX); (K, G, N) fp32 partials: [dbias][, dgamma]
    DOUT, X, BIAS, GAMMA, SCALE,
    stride_dom, stride_xm, stride_dxm,
    M, N, G, tokens_per_sample, seed, p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_DX: tl.constexpr,  # False when dx is dout itself (no dropout, gamma or scale)
):
    pid_g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] if HAS_BIAS else 0.0
    gamma = tl.load(GAMMA + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] if HAS_GAMMA else 0.0
    acc_dbias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_dgamma = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(pid_g, tl.cdiv(M, BLOCK_M), G):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        g = tl.load(DOUT + rows[:, None] * stride_dom + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32) \
            if HAS_GAMMA else 0.0
        scale = tl.load(SCALE + rows // tokens_per_sample, mask=rows < M, other=0.0)[:, None] if HAS_SCALE else 0.0
        dx, dgamma_term = residual_join_bwd(g, x, bias, gamma, scale, seed, rows[:, None] * N + cols[None, :], p,
                                            HAS_BIAS, HAS_GAMMA, HAS_SCALE, HAS_DROPOUT)
        if STORE_DX:
            tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        acc_dbias += tl.sum(dx, axis=0)
        if HAS_GAMMA:
            acc_dgamma += tl.sum(dgamma_term, axis=0)
    if HAS_BIAS:
        tl.store(PARTIAL + pid_g * N + cols, acc_dbias, mask=cols < N)
    if HAS_GAMMA:
        gamma_row = pid_g + G if HAS_BIAS else pid_g  # the dgamma slice follows the dbias slice
        tl.store(PARTIAL + gamma_row * N + cols, acc_dgamma, mask=cols < N)


# --------------------------------------------------------------------------- configs and launchers
def tile_config(n: int, arch: int = 80) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the elementwise row-tile kernels: 2048-element tiles at
    most 256 columns wide (ViT widths 768..16384 are multiples of 256, 1408 of 128), 8 elements
    per thread: the Philox draw and the GELU derivative stay under ~100 registers, no spills
    (aot_specs compiled for sm_80 / sm_90). The same table serves both architectures."""
    block_n = min(256, next_power_of_2(n))
    block_m = max(1, 2048 // block_n)
    return block_m, block_n, max(1, block_m * block_n // 256)


def num_partials(row_tiles: int, col_tiles: int, device: torch.device) -> int:
    """Programs along the rows of a backward launch (= rows of the fp32 partial buffer): about
    four programs per SM over the whole grid. Fixed per device and shape, so reproducible."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # interpreter: a few partials so the multi-program reduction is exercised
        target = 3 * col_tiles
    return max(1, min(row_tiles, triton.cdiv(target, col_tiles)))


def sum_partials(partial: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(K, G, N) fp32 -> (K, N) column sums over G in a fixed order, in out_dtype. One launch."""
    k, g, n = partial.shape
    out = torch.empty((k, n), device=partial.device, dtype=out_dtype)
    block_n = min(256, next_power_of_2(n))
    _sum_partials_kernel[(k, triton.cdiv(n, block_n))](out, partial, g, n, BLOCK_G=16, BLOCK_N=block_n, num_warps=4)
    return out


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(M, N) view with contiguous columns; copies only when the last dim is strided (or stride 0)."""
    rows = t.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def param_grad_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """dtype the partial-sum reduction writes: the parameters' own when they agree, else fp32."""
    return params[0].dtype if params and all(t.dtype == params[0].dtype for t in params) else torch.float32


def stores_dx(p: float, gamma, sample_scale, grad_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """Whether a residual join's backward must write dx: not when dx is the incoming gradient."""
    return p > 0 or gamma is not None or sample_scale is not None or grad_dtype != x_dtype


@torch.library.custom_op("vit_fast::bias_gelu_fwd", mutates_args=())
def bias_gelu_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
    """x: (M, N) with contiguous columns. Returns GELU(x + bias) (M, N) in x.dtype."""
    m, n = x.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    def launch(cfg: tuple[int, int, int]) -> None:
        block_m, block_n, warps = cfg
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _bias_gelu_fwd_kernel[grid](y, x, bias, x.stride(0), y.stride(0), m, n, BLOCK_M=block_m, BLOCK_N=block_n,
                                    HAS_BIAS=bias is not None, APPROX_TANH=approximate == "tanh", num_warps=warps)
    key = (bucket(m), n, str(x.dtype), bias is not None, approximate)
    launch(_tuning.choose("bias_gelu_fwd", key, _tuning.row_candidates(*tile_config(n)), launch, x.device))
    return y


@bias_gelu_fwd.register_fake
def _(x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("vit_fast::bias_gelu_bwd", mutates_args=())
def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                  approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: (M, N). Returns dx (M, N) in x.dtype and dbias (N,) in bias.dtype (empty without bias)."""
    m, n = x.shape
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype)
    has_bias = bias is not None
    if m == 0:
        return dx, (torch.zeros_like(bias) if has_bias else x.new_empty(0))
    def launch(cfg: tuple[int, int, int]) -> torch.Tensor:
        block_m, block_n, warps = cfg
        col_tiles = triton.cdiv(n, block_n)
        g = num_partials(triton.cdiv(m, block_m), col_tiles, x.device)
        partial = torch.empty((1, g, n), device=x.device, dtype=torch.float32) if has_bias else None
        _bias_gelu_bwd_kernel[(g, col_tiles)](dx, partial, dy, x, bias, dy.stride(0), x.stride(0), dx.stride(0), m, n,
                                              g, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=has_bias,
                                              APPROX_TANH=approximate == "tanh", num_warps=warps)
        return sum_partials(partial, bias.dtype)[0] if has_bias else x.new_empty(0)
    key = (bucket(m), n, str(dy.dtype), str(x.dtype), has_bias, approximate)
    candidates = _tuning.row_candidates(*tile_config(n), grow=False)
    return dx, launch(_tuning.choose("bias_gelu_bwd", key, candidates, launch, x.device))


@bias_gelu_bwd.register_fake
def _(dy, x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format), (
        torch.empty_like(bias) if bias is not None else x.new_empty(0))


@torch.library.custom_op("vit_fast::bias_dropout_add_fwd", mutates_args=())
def bias_dropout_add_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                         gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor],
                         p: float, seed: Optional[torch.Tensor]) -> torch.Tensor:
    """x, residual: (..., N) of one shape; sample_scale (B,) with B dividing the rows M. p > 0 draws
    dropout with seed (a 1-element int64 CPU tensor from ``next_seed``; None without dropout). The
    output is allocated in x's shape, not viewed from a rows tensor (FSDP2 warns on a block returning
    a view)."""
    shape, n = x.shape, x.shape[-1]
    x, residual = as_rows(x, n), as_rows(residual, n)
    m = x.shape[0]
    full = torch.empty(shape, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    out = full.view(m, n)
    if m == 0:
        return full
    tokens = m // sample_scale.shape[0] if sample_scale is not None else 1
    flags = dict(HAS_BIAS=bias is not None, HAS_GAMMA=gamma is not None, HAS_SCALE=sample_scale is not None,
                 HAS_DROPOUT=p > 0)

    def launch(cfg: tuple[int, int, int]) -> None:
        block_m, block_n, warps = cfg
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _bias_dropout_add_fwd_kernel[grid](
            out, x, bias, residual, gamma, sample_scale, x.stride(0), residual.stride(0), out.stride(0), m, n, tokens,
            seed_value(seed), p, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **flags)
    key = (bucket(m), n, str(x.dtype), str(residual.dtype), *flags.values())
    launch(_tuning.choose("bias_dropout_add_fwd", key, _tuning.row_candidates(*tile_config(n)), launch, x.device))
    return full


@bias_dropout_add_fwd.register_fake
def _(x, bias, residual, gamma, sample_scale, p, seed):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


@torch.library.custom_op("vit_fast::bias_dropout_add_bwd", mutates_args=())
def bias_dropout_add_bwd(dout: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                         gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor],
                         p: float, seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """dout: (M, N). Returns (dx or an empty tensor when dx is dout itself, (K, N) param grads
    [dbias][, dgamma] in the parameters' dtype (fp32 if they differ))."""
    m, n = x.shape
    store_dx = stores_dx(p, gamma, sample_scale, dout.dtype, x.dtype)
    dx = torch.empty((m, n) if store_dx else (0,), device=x.device, dtype=x.dtype)
    params = [t for t in (bias, gamma) if t is not None]
    param_dtype = param_grad_dtype(params)
    if m == 0 or (not params and not store_dx):
        return dx, torch.zeros((len(params), n), device=x.device, dtype=param_dtype)
    tokens = m // sample_scale.shape[0] if sample_scale is not None else 1
    flags = dict(HAS_BIAS=bias is not None, HAS_GAMMA=gamma is not None, HAS_SCALE=sample_scale is not None,
                 HAS_DROPOUT=p > 0, STORE_DX=store_dx)

    def launch(cfg: tuple[int, int, int]) -> torch.Tensor:
        block_m, block_n, warps = cfg
        col_tiles = triton.cdiv(n, block_n)
        g = num_partials(triton.cdiv(m, block_m), col_tiles, x.device)
        partial = torch.empty((len(params), g, n), device=x.device, dtype=torch.float32)
        _bias_dropout_add_bwd_kernel[(g, col_tiles)](
            dx, partial, dout, x, bias, gamma, sample_scale, dout.stride(0), x.stride(0),
            dx.stride(0) if store_dx else 0, m, n, g, tokens, seed_value(seed), p, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps, **flags)
        return sum_partials(partial, param_dtype) if params else partial.new_empty((0, n))
    key = (bucket(m), n, str(dout.dtype), str(x.dtype), *flags.values())
    candidates = _tuning.row_candidates(*tile_config(n), grow=False)
    return dx, launch(_tuning.choose("bias_dropout_add_bwd", key, candidates, launch, x.device))


@bias_dropout_add_bwd.register_fake
def _(dout, x, bias, gamma, sample_scale, p, seed):
    store_dx = stores_dx(p, gamma, sample_scale, dout.dtype, x.dtype)
    params = [t for t in (bias, gamma) if t is not None]
    param_dtype = param_grad_dtype(params)
    return (x.new_empty(x.shape if store_dx else (0,)), x.new_empty((len(params), x.shape[1]), dtype=param_dtype))


# --------------------------------------------------------------------------- autograd and public API
class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        shape, n = x.shape, x.shape[-1]
        x2 = as_rows(x, n)
        ctx.save_for_backward(x2, bias)
        ctx.approximate, ctx.shape = approximate, shape
        return bias_gelu_fwd(x2, bias, approximate).view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, dbias = bias_gelu_bwd(as_rows(dy, x2.shape[1]), x2, bias, ctx.approximate)
        return dx.view(ctx.shape), (dbias if bias is not None else None), None


class BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, gamma, sample_scale, p, seed):
        x2 = as_rows(x, x.shape[-1])
        ctx.save_for_backward(x2, bias, gamma, sample_scale, seed)
        ctx.p, ctx.shape, ctx.res_dtype = p, x.shape, residual.dtype
        ctx.store_dx = stores_dx(p, gamma, sample_scale, torch.promote_types(x.dtype, residual.dtype), x.dtype)
        # x2 in x's shape: a view of x (or of the one copy as_rows made), so the op copies nothing again
        return bias_dropout_add_fwd(x2.view(x.shape), bias, residual, gamma, sample_scale, p, seed)

    @staticmethod
    def backward(ctx, dout):
        x2, bias, gamma, sample_scale, seed = ctx.saved_tensors
        dout2 = as_rows(dout, x2.shape[1])
        dx, dparams = bias_dropout_add_bwd(dout2, x2, bias, gamma, sample_scale, ctx.p, seed)
        dx = dx.view(ctx.shape) if ctx.store_dx else dout
        grads = iter(dparams)
        dbias = next(grads).to(bias.dtype) if bias is not None else None
        dgamma = next(grads).to(gamma.dtype) if gamma is not None else None
        return dx, dbias, dout.to(ctx.res_dtype), dgamma, None, None, None


def _check_rows_input(op: str, x: torch.Tensor) -> int:
    check_float(op, "x", x)
    if x.dim() < 2:
        raise ValueError(f"{op}: expected x with at least 2 dims (..., N), got shape {tuple(x.shape)}")
    return x.shape[-1]


def _check_param(op: str, name: str, t: Optional[torch.Tensor], n: int) -> None:
    if t is not None:
        check_float(op, name, t)
        check_shape(op, name, t, (n,))


def _check_sample_scale(op: str, sample_scale: Optional[torch.Tensor], x: torch.Tensor) -> None:
    if sample_scale is None:
        return
    check_float(op, "sample_scale", sample_scale, (torch.float32,))
    check_shape(op, "sample_scale", sample_scale, (x.shape[0],))


def prepare_join(op: str, x: torch.Tensor, residual: torch.Tensor, bias: Optional[torch.Tensor],
                 gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor], p: float, training: bool,
                 *more: Optional[torch.Tensor], bias_name: str = "bias",
                 p_name: str = "p") -> tuple[float, Optional[torch.Tensor]]:
    """Validate a residual join's inputs (x already checked) and pick its dropout: returns (p, seed),
    seed a ``next_seed()`` tensor; p = 0 and seed None (nothing drawn from torch's generator) in eval
    mode or for p = 0."""
    n = x.shape[-1]
    check_float(op, "residual", residual)
    check_shape(op, "residual", residual, tuple(x.shape))
    _check_param(op, bias_name, bias, n)
    _check_param(op, "gamma", gamma, n)
    _check_sample_scale(op, sample_scale, x)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: expected dropout probability {p_name} in [0, 1], got {p}")
    check_kernel_device(op, x, residual, bias, gamma, sample_scale, *more)
    p = float(p) if training else 0.0
    return p, (next_seed() if p > 0 else None)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "none") -> torch.Tensor:
    """GELU(x + bias) over the last dim of x (..., N); bias (N,) or None. See the module docstring."""
    n = _check_rows_input("bias_gelu", x)
    _check_param("bias_gelu", "bias", bias, n)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: expected approximate 'none' or 'tanh', got {approximate!r}")
    check_kernel_device("bias_gelu", x, bias)
    return BiasGeluFunction.apply(x, unit_stride(bias), approximate)


def bias_gelu_ref(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "none") -> torch.Tensor:
    """Pure-PyTorch reference (math in fp32 for half inputs, result in x.dtype)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute) + bias.to(compute) if bias is not None else x.to(compute)
    return F.gelu(h, approximate=approximate).to(x.dtype)


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool, *, gamma: Optional[torch.Tensor] = None,
                     sample_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """residual + sample_scale[b] * gamma * dropout(x + bias, p, training); see the module docstring.

    x, residual: (B, ..., N); bias, gamma: (N,) or None; sample_scale: (B,) fp32 or None.
    """
    _check_rows_input("bias_dropout_add", x)
    p, seed = prepare_join("bias_dropout_add", x, residual, bias, gamma, sample_scale, p, training)
    bias, gamma, sample_scale = map(unit_stride, (bias, gamma, sample_scale))
    return BiasDropoutAddFunction.apply(x, bias, residual, gamma, sample_scale, p, seed)


def bias_dropout_add_ref(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                         training: bool, *, gamma: Optional[torch.Tensor] = None,
                         sample_scale: Optional[torch.Tensor] = None,
                         keep_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference. ``keep_mask`` (bool, x's shape) replaces F.dropout's own draw, so a test can
    apply the kernel's mask; without it F.dropout draws from torch's generator."""
    branch = x + bias if bias is not None else x
    if training and p > 0:
        branch = F.dropout(branch, p, True) if keep_mask is None else branch * keep_mask / (1.0 - p)
    if gamma is not None:
        branch = branch * gamma
    if sample_scale is not None:
        branch = branch * sample_scale.view(-1, *([1] * (x.dim() - 1))).to(branch.dtype)
    return residual + branch


# --------------------------------------------------------------------------- ahead-of-time specs
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


def aot_specs(tokens: int = 197, width: int = 768, mlp_hidden: int = 3072, dtype: torch.dtype = torch.bfloat16,
              arch: int = 80, param_dtype: torch.dtype = torch.float32, **_) -> list[AotSpec]:
    """Every launch this module makes for a ViT block: bias_gelu at mlp_hidden (both GELU forms),
    bias_dropout_add at width with every combination of LayerScale / drop-path / dropout, and the
    partial-sum reduction. Activations in ``dtype``, parameters in ``param_dtype`` (autocast)."""
    act, par = "*" + TRITON_DTYPE_NAMES[dtype], "*" + TRITON_DTYPE_NAMES[param_dtype]
    types = {"Y": act, "X": act, "DX": act, "DY": act, "DOUT": act, "OUT": act, "RES": act, "BIAS": par,
             "GAMMA": par, "SCALE": "*fp32", "PARTIAL": "*fp32", "seed": "i32", "p": "fp32"}
    specs = []

    def add(name, fn, n, constexprs, warps, note, arg_types=None):
        signature = kernel_signature(fn, arg_types or types, constexprs)
        values = dict(N=n, stride_xm=n, stride_ym=n, stride_dym=n, stride_dom=n, stride_rm=n, stride_om=n,
                      stride_dxm=n if constexprs.get("STORE_DX", True) else 0,
                      tokens_per_sample=tokens if constexprs.get("HAS_SCALE") else 1)
        specs.append(AotSpec(name, fn, signature, constexprs, warps, LAUNCH_DEFAULT_STAGES, False, note,
                             divisible_by_16=divisible_args(signature, values)))

    bm, bn, warps = tile_config(mlp_hidden, arch)
    for approx in (False, True):
        c = dict(BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=True, APPROX_TANH=approx)
        add("bias_gelu_fwd", _bias_gelu_fwd_kernel, mlp_hidden, c, warps, f"N={mlp_hidden} tanh={approx}")
        add("bias_gelu_bwd", _bias_gelu_bwd_kernel, mlp_hidden, c, warps, f"N={mlp_hidden} tanh={approx}")
    bm, bn, warps = tile_config(width, arch)
    # the residual stream in the activation dtype, and (16-bit only) fp32 under autocast as in timm
    streams = [types] if dtype == torch.float32 else [types, dict(types, OUT="*fp32", RES="*fp32", DOUT="*fp32")]
    for stream in streams:
        for gamma in (False, True):
            for scale in (False, True):
                for drop in (False, True):
                    c = dict(BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=True, HAS_GAMMA=gamma, HAS_SCALE=scale, HAS_DROPOUT=drop)
                    note = f"N={width} gamma={gamma} drop_path={scale} dropout={drop}"
                    note += " fp32 stream" if stream is not types else ""
                    add("bias_dropout_add_fwd", _bias_dropout_add_fwd_kernel, width, c, warps, note, stream)
                    add("bias_dropout_add_bwd", _bias_dropout_add_bwd_kernel, width,
                        dict(c, STORE_DX=gamma or scale or drop or stream is not types), warps, note, stream)
    types = dict(types, OUT=par)  # the reduction writes parameter grads
    for n in sorted({width, mlp_hidden}):
        add("sum_partials", _sum_partials_kernel, n, dict(BLOCK_G=16, BLOCK_N=min(256, next_power_of_2(n))), 4,
            f"N={n}")
    return specs
