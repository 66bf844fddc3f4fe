"""LayerNorm over the last dimension, alone and fused with the pre-norm ViT block's residual join,
forward and backward.

Math, x viewed as M rows of width N, statistics in fp32:

* ``layer_norm``: ``y = (x - mean) * rstd * w + b``, ``rstd = 1 / sqrt(var + eps)`` (biased var).
* ``add_layer_norm``: ``h = residual + s[b] * gamma * dropout(x + branch_bias)`` (every factor
  optional, see ``_join.residual_join_fwd``, the @triton.jit math bias_dropout_add shares too),
  ``normed = LN(h)``; returns ``(normed, h)``. The LN is taken of h *as stored* (rounded to the
  residual dtype), exactly what an unfused ``h = h + branch; y = norm(h)`` computes, and the
  backward uses the same stored h.
* Backward per row, xhat = (h - mean) * rstd, wdy = w * dy:
  ``dh = (wdy - xhat * mean(xhat * wdy) - mean(wdy)) * rstd + d(new_residual)``;
  ``dresidual = dh``; ``dx = dh * s * gamma * mask/(1-p)`` (``residual_join_bwd``);
  ``dw = sum_rows dy * xhat``, ``db = sum_rows dy``, ``dgamma = sum_rows dh * s * dropout(x + bb)``,
  ``dbranch_bias = sum_rows dx``. Parameter grads are per-program fp32 partial rows (each
  program walks a fixed set of row tiles) summed by ``_rows.sum_partials`` in a fixed order:
  no atomics, bitwise reproducible. No gradient for sample_scale.

Dtypes: x fp32/fp16/bf16; weight, bias, branch_bias, gamma may be fp32 while x is half (autocast;
their grads come back in their own dtype). ``layer_norm`` returns x.dtype. ``add_layer_norm``
returns normed in x.dtype and h in ``promote_types(x.dtype, residual.dtype)`` (an fp32 residual
stream stays fp32). mean and rstd are saved in fp32, one per row. Dropout: seed per call from
``_utils.next_seed`` (a 1-element int64 tensor on the device, read by the kernels through a pointer,
so torch.compile traces it without a graph break and a CUDA graph redraws it per replay), saved for
backward, mask regenerated (never stored); offsets are the logical element index row * N + col (int64),
the same as ``bias_dropout_add``.

Traffic per element (s = bytes of the activation dtype, 2 for bf16; per-row stats (8 bytes per
row) and per-column parameters ignored). Launches per call in brackets:

  layer_norm       fwd: read x, write y = 2s [1]         bwd: read dy, x, write dx = 3s [2]
  add_layer_norm   fwd: read x, residual, write normed, h = 4s [1]
                   bwd: read dy, d(h), h, write dh = 4s; + write dx when dropout / gamma /
                        drop-path scale (or dtypes) make dx differ from dh (5s), + read x with
                        gamma (6s) [2]. Without a gradient flowing into h: one read less;
                        with normed unused: only the join's backward (bias_dropout_add_bwd).
The unfused eager path moves add 3s + LN 2s = 5s forward (7s with a separate bias add, 9s with
dropout), and backward 4s+ plus separate parameter-grad reductions.

Limits: N from 1 to 8192 in one tile per row (tested 64..8192, incl. 192..1664 ViT widths).
aot_specs lists every launch of the report's presets (widths 192..1280, bf16/fp16/fp32, every flag
combination); ``vit-fast report`` compiles them for sm_80 / sm_90 and prints registers and spills.
Rows wider than the presets' may spill in the join backward (32 warps cap registers at 64): correct
but slower. Any leading shape, 0 rows included; eps is a runtime argument (1e-6 timm, 1e-12 HF: no
recompile).
Inputs whose last dimension is not contiguous are copied once; row strides are passed through.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning
from ._aot import LAUNCH_DEFAULT_STAGES, TRITON_DTYPE_NAMES, AotSpec, divisible_args, kernel_signature
from ._join import prepare_join, residual_join_bwd, residual_join_fwd, rows_per_sample, stores_dx
from ._rows import (
    RowTile,
    as_rows,
    bind_sum_partials,
    check_param,
    check_rows_input,
    num_partials,
    param_grad_dtype,
)
from ._tuning import KernelLaunch, bucket
from ._utils import (
    FLOAT_DTYPES,
    cast_to,
    cdiv,
    check_kernel_device,
    first_order_only,
    gpu_arch,
    kernel_op,
    next_power_of_2,
    run_op,
    unit_stride,
)
from .bias_gelu import bias_dropout_add_bwd, bias_dropout_add_ref, join_param_grads

MAX_WIDTH = 8192  # one tile per row; beyond this the backward would spill heavily


# -------------------------------------------------------------------------------------- jit kernels
@triton.jit
def _layer_norm_fwd_kernel(
    Y, H_OUT, MEAN, RSTD,  # (M, N) normed; (M, N) new residual (HAS_RESIDUAL); (M,) fp32 stats
    X, RES, W, B, BRANCH_BIAS, GAMMA, SCALE,  # (M, N), (M, N) or None, (N,) x4, (B,) fp32 or None
    stride_xm, stride_rm, stride_ym, stride_hm,  # row strides (columns are contiguous)
    M, N, tokens_per_sample,  # rows, width; row r belongs to sample r // tokens_per_sample
    eps, SEED, p,  # runtime: LN epsilon, -> the dropout seed (int64 on the device), dropout probability
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # rows per program, padded width
    HAS_RESIDUAL: tl.constexpr, HAS_BRANCH_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    h = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(RES + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        bb = tl.load(BRANCH_BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] if HAS_BRANCH_BIAS else 0.0
        gamma = tl.load(GAMMA + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] if HAS_GAMMA else 0.0
        scale = tl.load(SCALE + rows // tokens_per_sample, mask=row_ok, other=0.0)[:, None] if HAS_SCALE else 0.0
        h = residual_join_fwd(res, h, bb, gamma, scale, SEED, rows[:, None] * N + cols[None, :], p,
                              HAS_BRANCH_BIAS, HAS_GAMMA, HAS_SCALE, HAS_DROPOUT)
        h = h.to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + rows[:, None] * stride_hm + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)  # normalise h as stored, like the unfused path (and our backward)
    mean = tl.sum(h, axis=1) / N
    centered = tl.where(mask, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    DH, DX, PARTIAL,  # (M, N) grad of h (= dx of plain LN, = dresidual); (M, N) dx if STORE_DX;
    # (K, G, N) fp32 partial column sums: dw, db[, dgamma][, dbranch_bias]
    DY, DH_OUT, H, X, W, BRANCH_BIAS, GAMMA, SCALE, MEAN, RSTD,
    stride_dym, stride_dhom, stride_hm, stride_xm, stride_dhm, stride_dxm,
    M, N, G, tokens_per_sample, SEED, p,  # G = programs = partial rows per slice
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DH_OUT: tl.constexpr,  # a gradient flows into the new residual too
    STORE_DX: tl.constexpr,  # dx differs from dh (dropout, gamma, scale or dtype)
    HAS_BRANCH_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    bb = tl.load(BRANCH_BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] if HAS_BRANCH_BIAS else 0.0
    gamma = tl.load(GAMMA + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] if HAS_GAMMA else 0.0
    acc_dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_dgamma = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_dbb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    inv_n = 1.0 / N  # one division per program, not two per row tile (fewer live values in the loop)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), G):  # a fixed set of row tiles per program
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        h = tl.load(H + rows[:, None] * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=1) * inv_n
        c2 = tl.sum(wdy, axis=1) * inv_n
        dh = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DH_OUT:
            dh += tl.load(DH_OUT + rows[:, None] * stride_dhom + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dh = tl.where(mask, dh, 0.0)
        tl.store(DH + rows[:, None] * stride_dhm + cols[None, :], dh.to(DH.dtype.element_ty), mask=mask)
        acc_dw += tl.sum(dy * xhat, axis=0)
        acc_db += tl.sum(dy, axis=0)
        if STORE_DX:
            x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32) \
                if HAS_GAMMA else 0.0
            # sample index in int32 (rows < 2^31): an int64 division is a SASS subroutine CALL, and the
            # registers saved around it went to the stack (8 B/thread) in drop-path variants
            scale = tl.load(SCALE + rows.to(tl.int32) // tokens_per_sample, mask=row_ok, other=0.0)[:, None] \
                if HAS_SCALE else 0.0
            dx, dgamma_term = residual_join_bwd(dh, x, bb, gamma, scale, SEED, rows[:, None] * N + cols[None, :], p,
                                                HAS_BRANCH_BIAS, HAS_GAMMA, HAS_SCALE, HAS_DROPOUT)
            tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_GAMMA:
                acc_dgamma += tl.sum(dgamma_term, axis=0)
            acc_dbb += tl.sum(dx, axis=0)
        else:
            acc_dbb += tl.sum(dh, axis=0)
    tl.store(PARTIAL + pid * N + cols, acc_dw, mask=col_ok)
    tl.store(PARTIAL + (G + pid) * N + cols, acc_db, mask=col_ok)
    if HAS_GAMMA:
        tl.store(PARTIAL + (2 * G + pid) * N + cols, acc_dgamma, mask=col_ok)
    if HAS_BRANCH_BIAS:
        bb_slice = 3 if HAS_GAMMA else 2
        tl.store(PARTIAL + (bb_slice * G + pid) * N + cols, acc_dbb, mask=col_ok)


# ------------------------------------------------------------------------------------------ configs
# Backward tiles that differ from the forward's (BLOCK_N -> (BLOCK_M, num_warps)): at most two rows
# and 8 elements per thread. The forward's 8-warp tiles of 4-8 rows (and 16 warps for one 2048 row)
# leave ptxas spilling one register (8 B/thread) in some flag combinations on sm_80 or sm_90.
_BWD_TILES = {256: (2, 2), 512: (2, 4), 2048: (1, 8)}
# 1024 (widths 513-1024, ViT-B's 768): one row on 8 warps, measured 3.5x faster than two rows on an NVIDIA H200
# (0.241 vs 0.853 ms at 65536 x 768 bf16; torch 2.11, triton 3.6, 2026-11-26, `vit-fast tune`,
# docs/measured/h200-2026-11-26-campaign/tune.csv). Where that tile spills 8 B/thread on sm_90 (LayerScale; a
# branch bias with an fp32 output gradient, i.e. a pure fp32 model) two rows on 8 warps stay (spill-free), and
# autotuning still tries the one-row tile. The static tile is what runs under torch.compile, CUDA-graph capture
# and VIT_FAST_AUTOTUNE=0.
_BWD_TILE_1024 = {False: (1, 8), True: (2, 8)}  # by bwd_spill_prone


def bwd_spill_prone(layer_scale: bool, branch_bias: bool, fp32_grad: bool) -> bool:
    """The backward variants whose one-row 1024-column tile spills (``vit-fast report``, sm_90)."""
    return layer_scale or (branch_bias and fp32_grad)


def ln_config(n: int, arch: int = 80, backward: bool = False, spill_prone: bool = False) -> RowTile:
    """The tile of the forward (or, with ``backward``, the backward) kernel: a
    whole padded row per tile (statistics in registers). Forward: rows stacked to 2048 elements for
    narrow widths with 8 elements per thread; single-row tiles (widths > 1024) get 4-8 elements per
    thread, up to 32 warps. Backward: ``_BWD_TILES`` where set (1024 columns: ``_BWD_TILE_1024`` by
    ``spill_prone``, see ``bwd_spill_prone``). ``vit-fast report`` compiles every entry of the report's
    presets for sm_80 and sm_90. One table for both archs; launchers and aot_specs both call this."""
    block_n = next_power_of_2(n)
    if backward and block_n == 1024:
        block_m, warps = _BWD_TILE_1024[spill_prone]
        return RowTile(block_m, block_n, warps)
    if backward and block_n in _BWD_TILES:
        block_m, warps = _BWD_TILES[block_n]
        return RowTile(block_m, block_n, warps)
    block_m = max(1, min(16, 2048 // block_n))
    if block_m > 1 or block_n < 2048:
        return RowTile(block_m, block_n, max(1, block_m * block_n // 256))
    return RowTile(1, block_n, min(32, block_n // 128))


# ------------------------------------------------------------ validation and launchers (custom ops)
class _FwdPlan(NamedTuple):
    """What ``add_layer_norm_fwd`` derives from its inputs' layout (``LaunchPlans``)."""

    out_dtype: torch.dtype
    h_shape: tuple  # (M, N), or (0,) without a residual
    h_dtype: torch.dtype
    launch: _tuning.LaunchPlan  # tuning key, candidates, a bound launch per tile


def _fwd_plan(x, residual, branch_bias, gamma, sample_scale, p, out_dtype) -> _FwdPlan:
    m, n = x.shape
    has_res = residual is not None
    y_dtype = out_dtype or x.dtype
    h_dtype = torch.promote_types(x.dtype, residual.dtype) if has_res else x.dtype
    flags = dict(HAS_RESIDUAL=has_res, HAS_BRANCH_BIAS=branch_bias is not None, HAS_GAMMA=gamma is not None,
                 HAS_SCALE=sample_scale is not None, HAS_DROPOUT=p > 0)
    tokens = rows_per_sample("add_layer_norm_fwd", m, sample_scale)
    strides = (x.stride(0), residual.stride(0) if has_res else 0, n, n if has_res else 0)  # x, residual, y, h

    def bind(cfg: RowTile):
        grid = (cdiv(m, cfg.block_m),)
        kernel = KernelLaunch(_layer_norm_fwd_kernel, grid, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              num_warps=cfg.num_warps, **flags)

        def launch(y, h, mean, rstd, x, residual, weight, bias, branch_bias, gamma, sample_scale, eps, seed, p):
            kernel(y, h, mean, rstd, x, residual, weight, bias, branch_bias, gamma, sample_scale, *strides, m, n,
                   tokens, eps, seed, p)
        return launch
    # the arch too: the in-process choices are shared by every GPU of the process
    key = (bucket(m), n, str(x.dtype), str(h_dtype), str(y_dtype), gpu_arch(x.device), *flags.values())
    return _FwdPlan(y_dtype, (m, n) if has_res else (0,), h_dtype,
                    _tuning.LaunchPlan("layer_norm_fwd", key, _tuning.row_candidates(ln_config(n)), bind))


_FWD_PLANS = _tuning.LaunchPlans(_fwd_plan)


@kernel_op("vit_fast::add_layer_norm_fwd")
def add_layer_norm_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor,
                       branch_bias: Optional[torch.Tensor], gamma: Optional[torch.Tensor],
                       sample_scale: Optional[torch.Tensor], eps: float, p: float,
                       seed: Optional[torch.Tensor], out_dtype: Optional[torch.dtype] = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: (M, N) with contiguous columns; seed: a ``next_seed`` tensor (None without
    dropout). Returns (normed in ``out_dtype`` or x.dtype, h, mean, rstd); without a residual h is an
    empty placeholder (the plain LayerNorm)."""
    plan = _FWD_PLANS.get((x.shape, x.stride(0), x.dtype, None if residual is None else (residual.dtype,
                           residual.stride(0)), out_dtype, branch_bias is None, gamma is None,
                           None if sample_scale is None else sample_scale.shape[0], p > 0, x.device),
                          x, residual, branch_bias, gamma, sample_scale, p, out_dtype)
    m, n = x.shape
    dev = x.device
    y = torch.empty((m, n), device=dev, dtype=plan.out_dtype)
    h = torch.empty(plan.h_shape, device=dev, dtype=plan.h_dtype)
    mean = torch.empty((m,), device=dev, dtype=torch.float32)
    rstd = torch.empty((m,), device=dev, dtype=torch.float32)
    if m == 0:
        return y, h, mean, rstd

    launches = plan.launch

    def launch(cfg: RowTile) -> None:
        launches.bind(cfg)(y, h, mean, rstd, x, residual, weight, bias, branch_bias, gamma, sample_scale, eps, seed, p)
    launch(launches.choose(dev, launch))
    return y, h, mean, rstd


@add_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, branch_bias, gamma, sample_scale, eps, p, seed, out_dtype=None):
    m, n = x.shape
    h_shape = (m, n) if residual is not None else (0,)
    h_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    stats = x.new_empty((m,), dtype=torch.float32)
    return x.new_empty((m, n), dtype=out_dtype or x.dtype), x.new_empty(h_shape, dtype=h_dtype), stats, \
        torch.empty_like(stats)


class _BwdPlan(NamedTuple):
    """What ``add_layer_norm_bwd`` derives from its inputs' layout (``LaunchPlans``)."""

    dx_shape: tuple  # (M, N), or (0,) when dx is dh
    params: int  # parameter gradients summed over rows: w, b, gamma?, branch_bias?
    grad_dtype: torch.dtype  # theirs
    launch: _tuning.LaunchPlan  # tuning key, candidates, a bound launch per tile (the partial sums' included)


def _bwd_plan(dy, dh_out, h, x, weight, bias, branch_bias, gamma, sample_scale, p, store_dx, arch) -> _BwdPlan:
    m, n = h.shape
    dev = h.device
    params = [t for t in (weight, bias, gamma, branch_bias) if t is not None]
    grad_dtype = param_grad_dtype(params)
    flags = dict(HAS_DH_OUT=dh_out is not None, STORE_DX=store_dx, HAS_BRANCH_BIAS=branch_bias is not None,
                 HAS_GAMMA=gamma is not None, HAS_SCALE=sample_scale is not None, HAS_DROPOUT=p > 0)
    spill_prone = bwd_spill_prone(gamma is not None, branch_bias is not None, dy.dtype == torch.float32)
    tile = ln_config(n, arch, backward=True, spill_prone=spill_prone)
    tokens = rows_per_sample("add_layer_norm_bwd", m, sample_scale)
    # dy, d(h), h, x, dh, dx
    strides = (dy.stride(0), dh_out.stride(0) if dh_out is not None else 0, h.stride(0), x.stride(0), n,
               n if store_dx else 0)

    def bind(cfg: RowTile):
        g = num_partials(cdiv(m, cfg.block_m), 1, dev)  # programs along the rows = rows of the partial buffer
        kernel = KernelLaunch(_layer_norm_bwd_kernel, (g,), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              num_warps=cfg.num_warps, **flags)
        summed = bind_sum_partials(len(params), g, n, grad_dtype, dev)

        def launch(dh, dx, dy, dh_out, h, x, weight, branch_bias, gamma, sample_scale, mean, rstd, seed, p):
            partial = torch.empty((len(params), g, n), device=dev, dtype=torch.float32)
            kernel(dh, dx, partial, dy, dh_out, h, x, weight, branch_bias, gamma, sample_scale, mean, rstd, *strides,
                   m, n, g, tokens, seed, p)
            return summed(partial)
        return launch
    key = (bucket(m), n, str(dy.dtype), str(h.dtype), str(x.dtype), len(params), arch, *flags.values())
    return _BwdPlan((m, n) if store_dx else (0,), len(params), grad_dtype,
                    _tuning.LaunchPlan("layer_norm_bwd", key, _tuning.row_candidates(tile, grow=False), bind))


_BWD_PLANS = _tuning.LaunchPlans(_bwd_plan)


@kernel_op("vit_fast::add_layer_norm_bwd")
def add_layer_norm_bwd(dy: torch.Tensor, dh_out: Optional[torch.Tensor], h: torch.Tensor, x: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor, branch_bias: Optional[torch.Tensor],
                       gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor], mean: torch.Tensor,
                       rstd: torch.Tensor, p: float, seed: Optional[torch.Tensor],
                       store_dx: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (M, N). h: the normalised rows (x itself for plain LN). Returns (dh in h.dtype, dx in
    x.dtype or an empty placeholder when dx is dh, (K, N) grads of [w, b, gamma?, branch_bias?])."""
    dev = h.device
    arch = gpu_arch(dev)
    plan = _BWD_PLANS.get((h.shape, h.dtype, h.stride(0), dy.dtype, dy.stride(0),
                           None if dh_out is None else dh_out.stride(0), x.dtype, x.stride(0), weight.dtype,
                           bias.dtype, None if gamma is None else gamma.dtype,
                           None if branch_bias is None else branch_bias.dtype,
                           None if sample_scale is None else sample_scale.shape[0], p > 0, store_dx, dev, arch),
                          dy, dh_out, h, x, weight, bias, branch_bias, gamma, sample_scale, p, store_dx, arch)
    m, n = h.shape
    dh = torch.empty((m, n), device=dev, dtype=h.dtype)
    dx = torch.empty(plan.dx_shape, device=dev, dtype=x.dtype)
    if m == 0:
        return dh, dx, torch.zeros((plan.params, n), device=dev, dtype=plan.grad_dtype)

    launches = plan.launch

    def launch(cfg: RowTile) -> torch.Tensor:
        return launches.bind(cfg)(dh, dx, dy, dh_out, h, x, weight, branch_bias, gamma, sample_scale, mean, rstd,
                                  seed, p)
    return dh, dx, launch(launches.choose(dev, launch))


@add_layer_norm_bwd.register_fake
def _(dy, dh_out, h, x, weight, bias, branch_bias, gamma, sample_scale, mean, rstd, p, seed, store_dx):
    params = [t for t in (weight, bias, gamma, branch_bias) if t is not None]
    return (torch.empty_like(h, memory_format=torch.contiguous_format), x.new_empty(x.shape if store_dx else (0,)),
            h.new_empty((len(params), h.shape[1]), dtype=param_grad_dtype(params)))


def _check_ln_inputs(op: str, x, weight, bias, eps) -> int:
    n = check_rows_input(op, x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            raise ValueError(f"{op}: expected {name} as a tensor of shape ({n},), got None")
        check_param(op, name, t, n)
    if n > MAX_WIDTH:
        raise ValueError(f"{op}: expected a hidden size of at most {MAX_WIDTH}, got {n}")
    if not eps > 0:
        raise ValueError(f"{op}: expected eps > 0, got {eps}")
    return n


def _check_out_dtype(name: str, out_dtype: Optional[torch.dtype]) -> None:
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected out_dtype to be one of {FLOAT_DTYPES} or None, got {out_dtype}")


# ----------------------------------------------------------------------------------------- autograd
def ln_param_grads(dparams: torch.Tensor, weight, bias, gamma, branch_bias) -> tuple:
    """(dweight, dbias, dgamma, dbranch_bias) from ``add_layer_norm_bwd``'s rows, each in its parameter's dtype
    (None for an absent parameter)."""
    grads = dparams.unbind(0)  # a tuple (Tensor.__iter__ costs a few microseconds of Python more)
    dweight, dbias = cast_to(grads[0], weight.dtype), cast_to(grads[1], bias.dtype)
    dgamma = cast_to(grads[2], gamma.dtype) if gamma is not None else None
    return dweight, dbias, dgamma, (cast_to(grads[-1], branch_bias.dtype) if branch_bias is not None else None)


class AddLayerNormFunction(torch.autograd.Function):
    """(normed, h) = add_layer_norm(...); with residual None it is the plain LayerNorm (returns normed,
    or with ``return_input`` (normed, x): x's gradient from its other uses joins dx in the kernel)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, branch_bias, gamma, sample_scale, eps, p, seed, out_dtype=None,
                return_input=False):
        shape, n = x.shape, x.shape[-1]
        x2 = as_rows(x, n)
        res2 = as_rows(residual, n) if residual is not None else None
        y, h, mean, rstd = run_op(add_layer_norm_fwd, x2, res2, weight, bias, branch_bias, gamma, sample_scale,
                                  eps, p, seed, out_dtype)
        ctx.has_res = residual is not None
        ctx.res_dtype = residual.dtype if ctx.has_res else None
        ctx.store_dx = ctx.has_res and stores_dx(p, gamma, sample_scale, h.dtype, x.dtype)
        ctx.p, ctx.shape = p, shape
        ctx.set_materialize_grads(False)  # no zero-filled d(h) read when h gets no gradient
        ctx.save_for_backward(h if ctx.has_res else x2, x2, weight, bias, branch_bias, gamma, sample_scale, mean, rstd,
                              seed)
        if not ctx.has_res:
            return (y.view(shape), x) if return_input else y.view(shape)
        return y.view(shape), h.view(shape)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dy, dh_out=None):
        h, x2, weight, bias, branch_bias, gamma, sample_scale, mean, rstd, seed = ctx.saved_tensors
        n = h.shape[1]
        dh_out2 = as_rows(dh_out, n) if dh_out is not None else None
        if dy is None and not ctx.has_res:  # normed of a plain LN unused: x's gradient is dh_out alone
            return dh_out, None, None, None, None, None, None, None, None, None, None, None
        if dy is None:  # normed unused: only the join's backward (no LN pass over zeros)
            return AddLayerNormFunction._join_backward(ctx, dh_out2, x2, branch_bias, gamma, sample_scale, seed)
        dy2 = as_rows(dy, n)
        dh, dx, dparams = run_op(add_layer_norm_bwd, dy2, dh_out2, h, x2, weight, bias, branch_bias, gamma,
                                 sample_scale, mean, rstd, ctx.p, seed, ctx.store_dx)
        dh = dh.view(ctx.shape)
        dweight, dbias, dgamma, dbranch = ln_param_grads(dparams, weight, bias, gamma, branch_bias)
        if not ctx.has_res:
            return dh, None, dweight, dbias, None, None, None, None, None, None, None, None
        dx = dx.view(ctx.shape) if ctx.store_dx else dh
        return dx, cast_to(dh, ctx.res_dtype), dweight, dbias, dbranch, dgamma, None, None, None, None, None, None


    @staticmethod
    def _join_backward(ctx, dh2, x2, branch_bias, gamma, sample_scale, seed):
        dx, dparams = run_op(bias_dropout_add_bwd, dh2, x2, branch_bias, gamma, sample_scale, ctx.p, seed)
        dbranch, dgamma = join_param_grads(dparams, branch_bias, gamma)
        dh = dh2.view(ctx.shape)
        dx = dx.view(ctx.shape) if ctx.store_dx else dh
        return dx, cast_to(dh, ctx.res_dtype), None, None, dbranch, dgamma, None, None, None, None, None, None


# --------------------------------------------------------------------------------------- functional
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """LayerNorm over the last dim of x (..., N); weight, bias (N,). Output in ``out_dtype`` (default
    x.dtype): an fp32 stream feeding a GEMM under autocast gets its bf16 operand straight from the
    kernel, the same values as LayerNorm in fp32 and autocast's cast, without the fp32 output and the
    cast (and their backward counterparts) in memory."""
    _check_ln_inputs("layer_norm", x, weight, bias, eps)
    check_kernel_device("layer_norm", x, weight, bias)
    _check_out_dtype("layer_norm", out_dtype)
    weight, bias = unit_stride(weight), unit_stride(bias)
    return AddLayerNormFunction.apply(x, None, weight, bias, None, None, None, float(eps), 0.0, None, out_dtype)


def layer_norm_and_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6,
                         out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x, ...), x): the start of a pre-norm residual stream, x also its first residual. The
    gradient reaching x through the stream is added to the LayerNorm's dx inside the backward kernel,
    where autograd would sum the two in a separate add (3 more passes over an fp32 stream)."""
    _check_ln_inputs("layer_norm", x, weight, bias, eps)
    check_kernel_device("layer_norm", x, weight, bias)
    _check_out_dtype("layer_norm_and_input", out_dtype)
    weight, bias = unit_stride(weight), unit_stride(bias)
    return AddLayerNormFunction.apply(x, None, weight, bias, None, None, None, float(eps), 0.0, None, out_dtype, True)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float = 1e-6, *, branch_bias: Optional[torch.Tensor] = None,
                   gamma: Optional[torch.Tensor] = None, sample_scale: Optional[torch.Tensor] = None,
                   dropout_p: float = 0.0, training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(LN(h), h) with h = residual + sample_scale[b] * gamma * dropout(x + branch_bias).

    x, residual: (B, ..., N); weight, bias, branch_bias, gamma: (N,); sample_scale: (B,) fp32
    (drop-path: 0 or 1/keep_prob per sample). See the module docstring for dtypes and traffic.
    """
    _check_ln_inputs("add_layer_norm", x, weight, bias, eps)
    p, seed = prepare_join("add_layer_norm", x, residual, branch_bias, gamma, sample_scale, dropout_p, training,
                           weight, bias, bias_name="branch_bias", p_name="dropout_p")
    weight, bias, branch_bias, gamma, sample_scale = map(unit_stride, (weight, bias, branch_bias, gamma, sample_scale))
    return AddLayerNormFunction.apply(x, residual, weight, bias, branch_bias, gamma, sample_scale, float(eps), p, seed)


# ---------------------------------------------------------------------------------------- reference
def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Reference: F.layer_norm in fp32 (fp64 stays fp64), result in x.dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return F.layer_norm(x.to(compute), x.shape[-1:], weight.to(compute), bias.to(compute), eps).to(x.dtype)


def add_layer_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float = 1e-6, *, branch_bias: Optional[torch.Tensor] = None,
                       gamma: Optional[torch.Tensor] = None, sample_scale: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0, training: bool = False,
                       keep_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the unfused join then F.layer_norm of h as stored. ``keep_mask`` (bool, x's
    shape) replaces F.dropout's draw so a test can apply the kernel's own mask."""
    h = bias_dropout_add_ref(x, branch_bias, residual, dropout_p, training, gamma=gamma, sample_scale=sample_scale,
                             keep_mask=keep_mask)
    return layer_norm_ref(h, weight, bias, eps).to(x.dtype), h


# ------------------------------------------------------------------------------ ahead-of-time specs
def aot_specs(tokens: int = 197, width: int = 768, mlp_hidden: int = 3072, dtype: torch.dtype = torch.bfloat16,
              arch: int = 80, param_dtype: torch.dtype = torch.float32, **_) -> list[AotSpec]:
    """Every LayerNorm launch for a ViT of this width: plain LN (final norm / first norm) and the
    residual-join LN with every combination of branch bias, LayerScale, drop-path and dropout,
    forward and backward (with and without a gradient into h), with a 16-bit and an fp32 stream. The
    partial-sum reduction is listed by ``bias_gelu.aot_specs``."""
    act, par = "*" + TRITON_DTYPE_NAMES[dtype], "*" + TRITON_DTYPE_NAMES[param_dtype]
    types = {name: act for name in ("Y", "H_OUT", "X", "RES", "DH", "DX", "DY", "DH_OUT", "H")}
    types.update({name: par for name in ("W", "B", "BRANCH_BIAS", "GAMMA")})
    types.update({"MEAN": "*fp32", "RSTD": "*fp32", "SCALE": "*fp32", "PARTIAL": "*fp32", "eps": "fp32",
                  "SEED": "*i64", "p": "fp32"})
    fwd_tile = ln_config(width, arch)
    block_m, block_n, warps = fwd_tile.block_m, fwd_tile.block_n, fwd_tile.num_warps
    specs = []
    variants = [(False, False, False, False, False)] + [
        (True, bb, gamma, scale, drop) for bb in (False, True) for gamma in (False, True)
        for scale in (False, True) for drop in (False, True)]
    for res, bb, gamma, scale, drop in variants:
        flags = dict(HAS_BRANCH_BIAS=bb, HAS_GAMMA=gamma, HAS_SCALE=scale, HAS_DROPOUT=drop)
        note = f"N={width} residual={res} branch_bias={bb} gamma={gamma} drop_path={scale} dropout={drop}"
        # the integer arguments the launchers pass (rows M and programs G depend on the batch)
        values = dict(N=width, stride_xm=width, stride_ym=width, stride_dym=width, stride_dhm=width,
                      stride_hm=width if res else 0, stride_rm=width if res else 0,
                      tokens_per_sample=tokens if scale else 1)
        # under autocast the stream is fp32 (residual_in_fp32) while branch, output and dy are 16-bit:
        # the residual, h and their gradients fp32 (the plain LN: x, the first norm of the stream)
        fp32_stream = ("RES", "H_OUT", "H", "DH", "DH_OUT") if res else ("X", "H_OUT", "H", "DH", "DH_OUT", "DX")
        stream_types = [types] if dtype == torch.float32 else \
            [types, dict(types, **{name: "*fp32" for name in fp32_stream})]
        for t in stream_types:
            stream = "" if t is types else " fp32 stream"
            c = dict(BLOCK_M=block_m, BLOCK_N=block_n, HAS_RESIDUAL=res, **flags)
            specs.append(_spec("layer_norm_fwd", _layer_norm_fwd_kernel, t, c, warps, note + stream, values))
            bwd_tile = ln_config(width, arch, backward=True, spill_prone=bwd_spill_prone(gamma, bb, t["DY"] == "*fp32"))
            bwd_block_m, bwd_warps = bwd_tile.block_m, bwd_tile.num_warps
            for dh_out in (False, True):  # plain LN: layer_norm_and_input adds the stream's gradient
                store_dx = res and (gamma or scale or drop or t is not types)
                c = dict(BLOCK_M=bwd_block_m, BLOCK_N=block_n, HAS_DH_OUT=dh_out, STORE_DX=store_dx, **flags)
                bwd_values = dict(values, stride_hm=width, stride_dhom=width if dh_out else 0,
                                  stride_dxm=width if store_dx else 0)
                specs.append(_spec("layer_norm_bwd", _layer_norm_bwd_kernel, t, c, bwd_warps,
                                   note + f" grad_into_h={dh_out}" + stream, bwd_values))
    return specs


def _spec(name, fn, types, constexprs, warps, note, values) -> AotSpec:
    signature = kernel_signature(fn, types, constexprs)
    return AotSpec(name, fn, signature, constexprs, warps, LAUNCH_DEFAULT_STAGES, False, note,
                   divisible_by_16=divisible_args(signature, values))
