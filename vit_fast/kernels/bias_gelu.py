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
comes from ``_utils.next_seed`` once per call as a 1-element int64 tensor on the device (so
``torch.manual_seed``, activation checkpointing and CUDA-graph replays handle it as any device draw;
torch.compile traces the draw, no graph break), is read by the kernels through a pointer, and is saved
for backward. ``p == 0`` or
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
aot_specs lists every launch (the report's presets, every flag combination) for
``vit-fast report``, which compiles each for sm_80 / sm_90 and prints its registers and spills.
Inputs whose last dimension is not contiguous are copied once (documented "copy at most");
row strides are passed to the kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning
from ._aot import LAUNCH_DEFAULT_STAGES, TRITON_DTYPE_NAMES, AotSpec, divisible_args, kernel_signature
from ._join import prepare_join, residual_join_bwd, residual_join_fwd, rows_per_sample, stores_dx
from ._math import gelu_fwd_bwd
from ._rows import (
    RowTile,
    as_rows,
    bind_sum_partials,
    check_param,
    check_rows_input,
    num_partials,
    param_grad_dtype,
    sum_partials_block_n,
    sum_partials_spec,
)
from ._tuning import KernelLaunch, bucket
from ._utils import (
    cast_to,
    cdiv,
    check_kernel_device,
    first_order_only,
    kernel_op,
    next_power_of_2,
    run_op,
    unit_stride,
)


# -------------------------------------------------------------------------------------- jit kernels
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
    y, _ = gelu_fwd_bwd(h, APPROX_TANH)
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
        _, dgelu = gelu_fwd_bwd(h, APPROX_TANH)
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
    SEED, p,  # dropout: -> the Philox seed (int64 on the device) and the probability (read with HAS_DROPOUT)
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
    out = residual_join_fwd(res, x, bias, gamma, scale, SEED, rows[:, None] * N + cols[None, :], p,
                            HAS_BIAS, HAS_GAMMA, HAS_SCALE, HAS_DROPOUT)
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_dropout_add_bwd_kernel(
    DX, PARTIAL,  # (M, N) grad of x (only with STORE_DX); (K, G, N) fp32 partials: [dbias][, dgamma]
    DOUT, X, BIAS, GAMMA, SCALE,
    stride_dom, stride_xm, stride_dxm,
    M, N, G, tokens_per_sample, SEED, p,
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
        dx, dgamma_term = residual_join_bwd(g, x, bias, gamma, scale, SEED, rows[:, None] * N + cols[None, :], p,
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


# ------------------------------------------------------------------------------------------ configs
def tile_config(n: int, arch: int = 80) -> RowTile:
    """The tile of the elementwise row-tile kernels: 2048-element tiles at
    most 256 columns wide (ViT widths 768..16384 are multiples of 256, 1408 of 128), 8 elements
    per thread, so the Philox draw and the GELU derivative stay in registers (``vit-fast report``
    checks it for sm_80 / sm_90). The same table serves both architectures."""
    block_n = min(256, next_power_of_2(n))
    block_m = max(1, 2048 // block_n)
    return RowTile(block_m, block_n, max(1, block_m * block_n // 256))


# Measured on the H200 (docs/measured/nvidia-h200-2026-11-27.md), ViT-B/16's fc1 (50432 x 3072 bf16): 32 x 128 on
# 8 warps with 16 programs per SM took 0.505 ms, the forward's 8 x 256 tile 1.42 ms. The row loop's loads are not
# pipelined, so taller steps and more resident programs are what hide their latency.
BWD_PROGRAMS_PER_SM = 16


def bwd_tile_config(n: int, arch: int = 80) -> RowTile:
    """The tile of the bias_gelu backward (the row loop that also sums dbias): 4096-element steps at most
    128 columns wide, 16 elements per thread on 8 warps."""
    block_n = min(128, next_power_of_2(n))
    return RowTile(max(1, 4096 // block_n), block_n, 8)


def dropout_add_bwd_tile(n: int, arch: int = 80, gamma: bool = False, dropout: bool = False) -> RowTile:
    """The bias_dropout_add backward's tile: the row-tile kernels' own, with half its rows where LayerScale and
    dropout meet (the Philox draw beside the dgamma term spills 8 B/thread on sm_80 with triton 3.6 at 8 rows)."""
    tile = tile_config(n, arch)
    return RowTile(max(1, tile.block_m // 2), tile.block_n, tile.num_warps) if gamma and dropout else tile


# ------------------------------------------------------------ validation and launchers (custom ops)
def _gelu_fwd_plan(x: torch.Tensor, has_bias: bool, approximate: str) -> _tuning.LaunchPlan:
    m, n = x.shape
    stride = x.stride(0)

    def bind(cfg: RowTile):
        kernel = KernelLaunch(_bias_gelu_fwd_kernel, (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)),
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_BIAS=has_bias,
                              APPROX_TANH=approximate == "tanh", num_warps=cfg.num_warps)

        def launch(y, x, bias):
            kernel(y, x, bias, stride, n, m, n)
        return launch
    key = (bucket(m), n, str(x.dtype), has_bias, approximate)
    return _tuning.LaunchPlan("bias_gelu_fwd", key, _tuning.row_candidates(tile_config(n)), bind)


_GELU_FWD_PLANS = _tuning.LaunchPlans(_gelu_fwd_plan)


@kernel_op("vit_fast::bias_gelu_fwd")
def bias_gelu_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
    """x: (M, N) with contiguous columns. Returns GELU(x + bias) (M, N) in x.dtype."""
    m, n = x.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    plan = _GELU_FWD_PLANS.get((x.shape, x.stride(0), x.dtype, None if bias is None else bias.dtype, approximate,
                                x.device), x, bias is not None, approximate)

    def launch(cfg: RowTile) -> None:
        plan.bind(cfg)(y, x, bias)
    launch(plan.choose(x.device, launch))
    return y


@bias_gelu_fwd.register_fake
def _(x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gelu_bwd_plan(dy: torch.Tensor, x: torch.Tensor, bias_dtype: Optional[torch.dtype],
                   approximate: str) -> _tuning.LaunchPlan:
    """``bias_dtype``: the bias's (its gradient's) dtype, None without a bias."""
    m, n = x.shape
    has_bias, device = bias_dtype is not None, x.device
    strides = (dy.stride(0), x.stride(0), n)  # dy, x, dx

    def bind(cfg: RowTile):
        col_tiles = cdiv(n, cfg.block_n)
        g = num_partials(cdiv(m, cfg.block_m), col_tiles, device, per_sm=BWD_PROGRAMS_PER_SM)
        kernel = KernelLaunch(_bias_gelu_bwd_kernel, (g, col_tiles), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              HAS_BIAS=has_bias, APPROX_TANH=approximate == "tanh", num_warps=cfg.num_warps)
        summed = bind_sum_partials(1, g, n, bias_dtype, device) if has_bias else None

        def launch(dx, dy, x, bias) -> Optional[torch.Tensor]:
            """dx, and with a bias its column sums (N,) in the bias's dtype, else None."""
            partial = torch.empty((1, g, n), device=device, dtype=torch.float32) if has_bias else None
            kernel(dx, partial, dy, x, bias, *strides, m, n, g)
            return summed(partial)[0] if has_bias else None
        return launch
    key = (bucket(m), n, str(dy.dtype), str(x.dtype), has_bias, approximate)
    return _tuning.LaunchPlan("bias_gelu_bwd", key, _tuning.row_candidates(bwd_tile_config(n), grow=False), bind)


_GELU_BWD_PLANS = _tuning.LaunchPlans(_gelu_bwd_plan)


@kernel_op("vit_fast::bias_gelu_bwd")
def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                  approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: (M, N). Returns dx (M, N) in x.dtype and dbias (N,) in bias.dtype (empty without bias)."""
    m, n = x.shape
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype)
    has_bias = bias is not None
    if m == 0:
        return dx, (torch.zeros_like(bias) if has_bias else x.new_empty(0))
    bias_dtype = bias.dtype if has_bias else None
    plan = _GELU_BWD_PLANS.get((x.shape, x.stride(0), x.dtype, dy.stride(0), dy.dtype, bias_dtype, approximate,
                                x.device), dy, x, bias_dtype, approximate)

    def launch(cfg: RowTile) -> Optional[torch.Tensor]:
        return plan.bind(cfg)(dx, dy, x, bias)
    dbias = launch(plan.choose(x.device, launch))
    return dx, (dbias if has_bias else x.new_empty(0))


@bias_gelu_bwd.register_fake
def _(dy, x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format), (
        torch.empty_like(bias) if bias is not None else x.new_empty(0))


def _join_flags(bias, gamma, sample_scale, p: float) -> dict:
    return dict(HAS_BIAS=bias is not None, HAS_GAMMA=gamma is not None, HAS_SCALE=sample_scale is not None,
                HAS_DROPOUT=p > 0)


def _join_layout(x, bias, gamma, sample_scale, p: float) -> tuple:
    """What a bias_dropout_add plan depends on besides its other tensors' layouts."""
    return (x.shape, x.stride(0), x.dtype, x.device, None if bias is None else bias.dtype,
            None if gamma is None else gamma.dtype, None if sample_scale is None else sample_scale.shape[0], p > 0)


def _add_fwd_plan(x, residual, bias, gamma, sample_scale, p: float) -> _tuning.LaunchPlan:
    m, n = x.shape
    tokens = rows_per_sample("bias_dropout_add_fwd", m, sample_scale)
    flags = _join_flags(bias, gamma, sample_scale, p)
    strides = (x.stride(0), residual.stride(0), n)  # x, residual, out

    def bind(cfg: RowTile):
        kernel = KernelLaunch(_bias_dropout_add_fwd_kernel, (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)),
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **flags)

        def launch(out, x, bias, residual, gamma, sample_scale, seed, p):
            kernel(out, x, bias, residual, gamma, sample_scale, *strides, m, n, tokens, seed, p)
        return launch
    key = (bucket(m), n, str(x.dtype), str(residual.dtype), *flags.values())
    return _tuning.LaunchPlan("bias_dropout_add_fwd", key, _tuning.row_candidates(tile_config(n)), bind)


_ADD_FWD_PLANS = _tuning.LaunchPlans(_add_fwd_plan)


@kernel_op("vit_fast::bias_dropout_add_fwd")
def bias_dropout_add_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                         gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor],
                         p: float, seed: Optional[torch.Tensor]) -> torch.Tensor:
    """x, residual: (..., N) of one shape; sample_scale (B,) with B dividing the rows M. p > 0 draws
    dropout with seed (a 1-element int64 tensor on the device from ``next_seed``; None without dropout). The
    output is allocated in x's shape, not viewed from a rows tensor (FSDP2 warns on a block returning
    a view)."""
    shape, n = x.shape, x.shape[-1]
    x, residual = as_rows(x, n), as_rows(residual, n)
    m = x.shape[0]
    full = torch.empty(shape, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    out = full.view(m, n)
    if m == 0:
        return full
    plan = _ADD_FWD_PLANS.get((_join_layout(x, bias, gamma, sample_scale, p), residual.dtype, residual.stride(0)),
                              x, residual, bias, gamma, sample_scale, p)

    def launch(cfg: RowTile) -> None:
        plan.bind(cfg)(out, x, bias, residual, gamma, sample_scale, seed, p)
    launch(plan.choose(x.device, launch))
    return full


@bias_dropout_add_fwd.register_fake
def _(x, bias, residual, gamma, sample_scale, p, seed):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


def _add_bwd_plan(dout, x, bias, gamma, sample_scale, p: float, store_dx: bool) -> _tuning.LaunchPlan:
    m, n = x.shape
    device = x.device
    params = [t for t in (bias, gamma) if t is not None]
    param_dtype = param_grad_dtype(params)
    tokens = rows_per_sample("bias_dropout_add_bwd", m, sample_scale)
    flags = dict(_join_flags(bias, gamma, sample_scale, p), STORE_DX=store_dx)
    strides = (dout.stride(0), x.stride(0), n if store_dx else 0)  # dout, x, dx

    def bind(cfg: RowTile):
        col_tiles = cdiv(n, cfg.block_n)
        g = num_partials(cdiv(m, cfg.block_m), col_tiles, device)
        kernel = KernelLaunch(_bias_dropout_add_bwd_kernel, (g, col_tiles), BLOCK_M=cfg.block_m,
                              BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **flags)
        summed = bind_sum_partials(len(params), g, n, param_dtype, device) if params else None

        def launch(dx, dout, x, bias, gamma, sample_scale, seed, p) -> torch.Tensor:
            partial = torch.empty((len(params), g, n), device=device, dtype=torch.float32)
            kernel(dx, partial, dout, x, bias, gamma, sample_scale, *strides, m, n, g, tokens, seed, p)
            return summed(partial) if params else partial.new_empty((0, n))
        return launch
    key = (bucket(m), n, str(dout.dtype), str(x.dtype), *flags.values())
    static = dropout_add_bwd_tile(n, gamma=gamma is not None, dropout=p > 0)
    return _tuning.LaunchPlan("bias_dropout_add_bwd", key, _tuning.row_candidates(static, grow=False), bind)


_ADD_BWD_PLANS = _tuning.LaunchPlans(_add_bwd_plan)


@kernel_op("vit_fast::bias_dropout_add_bwd")
def bias_dropout_add_bwd(dout: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                         gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor],
                         p: float, seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """dout: (M, N). Returns (dx or an empty tensor when dx is dout itself, (K, N) param grads
    [dbias][, dgamma] in the parameters' dtype (fp32 if they differ))."""
    m, n = x.shape
    store_dx = stores_dx(p, gamma, sample_scale, dout.dtype, x.dtype)
    dx = torch.empty((m, n) if store_dx else (0,), device=x.device, dtype=x.dtype)
    params = [t for t in (bias, gamma) if t is not None]
    if m == 0 or (not params and not store_dx):
        return dx, torch.zeros((len(params), n), device=x.device, dtype=param_grad_dtype(params))
    plan = _ADD_BWD_PLANS.get((_join_layout(x, bias, gamma, sample_scale, p), dout.dtype, dout.stride(0)),
                              dout, x, bias, gamma, sample_scale, p, store_dx)

    def launch(cfg: RowTile) -> torch.Tensor:
        return plan.bind(cfg)(dx, dout, x, bias, gamma, sample_scale, seed, p)
    return dx, launch(plan.choose(x.device, launch))


@bias_dropout_add_bwd.register_fake
def _(dout, x, bias, gamma, sample_scale, p, seed):
    store_dx = stores_dx(p, gamma, sample_scale, dout.dtype, x.dtype)
    params = [t for t in (bias, gamma) if t is not None]
    param_dtype = param_grad_dtype(params)
    return (x.new_empty(x.shape if store_dx else (0,)), x.new_empty((len(params), x.shape[1]), dtype=param_dtype))


# ----------------------------------------------------------------------------------------- autograd
class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        shape, n = x.shape, x.shape[-1]
        x2 = as_rows(x, n)
        ctx.save_for_backward(x2, bias)
        ctx.approximate, ctx.shape = approximate, shape
        return run_op(bias_gelu_fwd, x2, bias, approximate).view(shape)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, dbias = run_op(bias_gelu_bwd, as_rows(dy, x2.shape[1]), x2, bias, ctx.approximate)
        return dx.view(ctx.shape), (dbias if bias is not None else None), None


class BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, gamma, sample_scale, p, seed):
        x2 = as_rows(x, x.shape[-1])
        ctx.save_for_backward(x2, bias, gamma, sample_scale, seed)
        ctx.p, ctx.shape, ctx.res_dtype = p, x.shape, residual.dtype
        ctx.store_dx = stores_dx(p, gamma, sample_scale, torch.promote_types(x.dtype, residual.dtype), x.dtype)
        # x2 in x's shape: a view of x (or of the one copy as_rows made), so the op copies nothing again
        return run_op(bias_dropout_add_fwd, x2.view(x.shape), bias, residual, gamma, sample_scale, p, seed)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dout):
        x2, bias, gamma, sample_scale, seed = ctx.saved_tensors
        dout2 = as_rows(dout, x2.shape[1])
        dx, dparams = run_op(bias_dropout_add_bwd, dout2, x2, bias, gamma, sample_scale, ctx.p, seed)
        dx = dx.view(ctx.shape) if ctx.store_dx else dout
        dbias, dgamma = join_param_grads(dparams, bias, gamma)
        return dx, dbias, dout.to(ctx.res_dtype), dgamma, None, None, None


def join_param_grads(dparams: torch.Tensor, bias: Optional[torch.Tensor],
                     gamma: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dbias, dgamma) from ``bias_dropout_add_bwd``'s rows, each in its parameter's dtype (None where absent)."""
    grads = dparams.unbind(0)  # a tuple (Tensor.__iter__ costs a few microseconds of Python more)
    dbias = cast_to(grads[0], bias.dtype) if bias is not None else None
    return dbias, (cast_to(grads[-1], gamma.dtype) if gamma is not None else None)


# --------------------------------------------------------------------------------------- functional
def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "none") -> torch.Tensor:
    """GELU(x + bias) over the last dim of x (..., N); bias (N,) or None. See the module docstring."""
    n = check_rows_input("bias_gelu", x)
    check_param("bias_gelu", "bias", bias, n)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: expected approximate 'none' or 'tanh', got {approximate!r}")
    check_kernel_device("bias_gelu", x, bias)
    return BiasGeluFunction.apply(x, unit_stride(bias), approximate)


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool, *, gamma: Optional[torch.Tensor] = None,
                     sample_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """residual + sample_scale[b] * gamma * dropout(x + bias, p, training); see the module docstring.

    x, residual: (B, ..., N); bias, gamma: (N,) or None; sample_scale: (B,) fp32 or None.
    """
    check_rows_input("bias_dropout_add", x)
    p, seed = prepare_join("bias_dropout_add", x, residual, bias, gamma, sample_scale, p, training)
    bias, gamma, sample_scale = map(unit_stride, (bias, gamma, sample_scale))
    return BiasDropoutAddFunction.apply(x, bias, residual, gamma, sample_scale, p, seed)


# ---------------------------------------------------------------------------------------- reference
def bias_gelu_ref(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "none") -> torch.Tensor:
    """Pure-PyTorch reference (math in fp32 for half inputs, result in x.dtype)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute) + bias.to(compute) if bias is not None else x.to(compute)
    return F.gelu(h, approximate=approximate).to(x.dtype)


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


# ------------------------------------------------------------------------------ ahead-of-time specs
def aot_specs(tokens: int = 197, width: int = 768, mlp_hidden: int = 3072, dtype: torch.dtype = torch.bfloat16,
              arch: int = 80, param_dtype: torch.dtype = torch.float32, **_) -> list[AotSpec]:
    """Every launch this module makes for a ViT block: bias_gelu at mlp_hidden (both GELU forms),
    bias_dropout_add at width with every combination of LayerScale / drop-path / dropout, and the
    partial-sum reduction. Activations in ``dtype``, parameters in ``param_dtype`` (autocast)."""
    act, par = "*" + TRITON_DTYPE_NAMES[dtype], "*" + TRITON_DTYPE_NAMES[param_dtype]
    types = {"Y": act, "X": act, "DX": act, "DY": act, "DOUT": act, "OUT": act, "RES": act, "BIAS": par,
             "GAMMA": par, "SCALE": "*fp32", "PARTIAL": "*fp32", "SEED": "*i64", "p": "fp32"}
    specs = []

    def add(name, fn, n, constexprs, warps, note, arg_types=None):
        signature = kernel_signature(fn, arg_types or types, constexprs)
        values = dict(N=n, stride_xm=n, stride_ym=n, stride_dym=n, stride_dom=n, stride_rm=n, stride_om=n,
                      stride_dxm=n if constexprs.get("STORE_DX", True) else 0,
                      tokens_per_sample=tokens if constexprs.get("HAS_SCALE") else 1)
        specs.append(AotSpec(name, fn, signature, constexprs, warps, LAUNCH_DEFAULT_STAGES, False, note,
                             divisible_by_16=divisible_args(signature, values)))

    fwd, bwd = tile_config(mlp_hidden, arch), bwd_tile_config(mlp_hidden, arch)
    for approx in (False, True):
        for name, fn, t in (("bias_gelu_fwd", _bias_gelu_fwd_kernel, fwd),
                            ("bias_gelu_bwd", _bias_gelu_bwd_kernel, bwd)):
            c = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_BIAS=True, APPROX_TANH=approx)
            add(name, fn, mlp_hidden, c, t.num_warps, f"N={mlp_hidden} tanh={approx}")
    tile = tile_config(width, arch)
    bm, bn, warps = tile.block_m, tile.block_n, tile.num_warps
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
                    bwd = dropout_add_bwd_tile(width, arch, gamma, drop)
                    add("bias_dropout_add_bwd", _bias_dropout_add_bwd_kernel, width,
                        dict(c, BLOCK_M=bwd.block_m, STORE_DX=gamma or scale or drop or stream is not types),
                        bwd.num_warps, note, stream)
    for n in sorted({width, mlp_hidden}):  # the reduction writes parameter grads
        specs.append(sum_partials_spec(par, sum_partials_block_n(n), f"N={n}", width=n))
    return specs
