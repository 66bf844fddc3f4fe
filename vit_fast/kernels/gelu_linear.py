"""GELU fused into the MLP's second Linear: ``gelu_linear(h, bias, weight) = GELU(h + bias) @ weight^T``,
forward and backward, without ever writing the 4C-wide activation g = GELU(h + bias) or its gradient.

Shapes: h (..., K) is fc1's output *without* its bias (K = mlp_hidden), bias (K,) or None is fc1's
bias, weight (N, K) is fc2's weight (N = width); the result is (..., N) in h.dtype. fc2's own bias
is not part of the op (the model adds it in its residual-join kernel). h is viewed as M x K rows
(copied once only if its last dim is strided); weight is read through its row stride.

Math, u = h + bias, g = GELU(u) (exact erf form, or approximate='tanh'):
    y     = g @ W^T                   _gelu_linear_fwd_kernel: GEMM M x N x K; GELU applied to each h tile
                                      as it is loaded (fp32, + bias, GELU, cast to the dot dtype)
    dh    = (dy @ W) * GELU'(u)       _gelu_linear_dh_kernel: GEMM M x K x N; GELU' in the epilogue,
                                      which loads the h tile of the output tile
    dbias = sum_rows dh               the dh epilogue writes fp32 column sums per row tile, reduced in a
                                      fixed order by _rows.sum_partials (no atomics)
    dW    = dy^T @ g                  _gelu_linear_dw_kernel: GEMM N x K over the rows, g recomputed from h
                                      as the operand is loaded. One program per output tile; when there are
                                      too few output tiles to fill a GPU (ViT-Ti: 192 x 768) the rows are
                                      split in S chunks writing fp32 partials (S, N, K), summed by
                                      sum_partials. S depends only on the shape: bitwise reproducible.

Dtypes: (a) all fp32: fp32 dots, IEEE unless torch.backends.cuda.matmul.allow_tf32 (then tf32);
(b) all fp16 / all bf16; (c) autocast: h fp16/bf16 with an fp32 weight and (optional) fp32 bias:
weight tiles are cast to h's dtype in registers (what autocast's weight copy holds, never written).
Dot operands are h's dtype (tensor cores for fp16/bf16), accumulation fp32, all elementwise math fp32,
cast on store. y and dh come back in h.dtype; dbias and dW in the parameters' dtype, from the fp32
accumulators. Other mixes raise ValueError.

Limits: any leading shape (0 rows included), any K, N >= 1 (tiles are masked; ViT widths are multiples
of 16); offsets of h / dy / dh rows in int64. Launches: forward 1; backward 3 (dh, dbias sum, dW) or 4
when dW is split (+ its partial sum); a weight that needs no gradient (frozen) skips the dW launch.

HBM traffic (each distinct address once per launch, as vit_fast.tools.traffic counts it; tile re-reads of
h, dy and W across programs hit L2). s = bytes of h's dtype, w = bytes of the parameters' dtype;
M rows, K = mlp_hidden, N = width, T = ceil(M / BLOCK_M) row tiles of the dh kernel:
    forward  read h (M K s), W (N K w), bias; write y (M N s)
    dh       read dy (M N s), h (M K s), W (N K w), bias; write dh (M K s), dbias partials (T K 4)
    dbias    read T K 4, write K w
    dW       read dy (M N s), h (M K s), bias; write dW (N K w)   [split: write S N K 4, + read S N K 4, write N K w]
Per row and MLP, K = 4C, N = C: forward 5C s, backward 14C s (+ weights). The unfused path (bias_gelu
between two cuBLAS GEMMs: 13C s forward, 22C s backward) also writes g and reads it back twice (fwd GEMM,
dW GEMM) and writes dg and reads it back: 16C s more per row, and it keeps g (4C s per row) alive for
backward, which this op does not.
aot_specs lists every table entry (both GELU forms, split and not, bf16 / fp16 with fp32 or own-dtype
parameters, fp32 IEEE and tf32); ``vit-fast report`` compiles each for sm_80 / sm_90 and prints its
registers, spills, shared memory and tensor-core use (16-bit tiles: mma on sm_80, wgmma on sm_90).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning
from ._aot import TRITON_DTYPE_NAMES, AotSpec, divisible_args, kernel_signature
from ._math import gelu_fwd_bwd
from ._rows import as_rows, sum_partials, sum_partials_spec
from ._tuning import bucket
from ._utils import check_float, check_kernel_device, check_ndim, gpu_arch, input_precision, unit_stride

OP = "gelu_linear"


# -------------------------------------------------------------------------------------- jit kernels
@triton.jit
def _grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of program pid, GROUP_M row tiles at a time sharing column tiles (L2 reuse)."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _gelu_linear_fwd_kernel(
    Y,  # (M, N) output, h's dtype
    H, BIAS, W,  # (M, K) fc1 output without bias; (K,) bias or None; (N, K) weight (cast to h's dtype)
    stride_hm, stride_wn, stride_ym,  # row strides (columns contiguous)
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # output tile, reduction step
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" / "tf32" (fp32 dots only)
):
    tile_m, tile_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = H + rows.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = W + cols[None, :] * stride_wn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) tile of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        u = tl.load(h_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(BIAS + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g, _ = gelu_fwd_bwd(u, APPROX_TANH)  # padded k columns: GELU(0) = 0
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(g.to(H.dtype.element_ty), w.to(H.dtype.element_ty), acc, input_precision=INPUT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _gelu_linear_dh_kernel(
    DH, PARTIAL,  # (M, K) grad of h, h's dtype; (T, K) fp32 column sums of dh per row tile (dbias)
    DY, H, BIAS, W,  # (M, N) grad of y, h's dtype; (M, K); (K,) or None; (N, K)
    stride_dym, stride_hm, stride_wn, stride_dhm,
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile of dh (rows x K), step over N
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    tile_m, tile_k = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_k * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of h (the K dimension)
    offs_n = tl.arange(0, BLOCK_K)  # reduction over the N outputs
    row_ok, col_ok = rows < M, cols < K
    dy_ptrs = DY + rows.to(tl.int64)[:, None] * stride_dym + offs_n[None, :]
    w_ptrs = W + offs_n[:, None] * stride_wn + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_K):
        n_ok = n0 + offs_n < N
        dy = tl.load(dy_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(dy.to(H.dtype.element_ty), w.to(H.dtype.element_ty), acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wn
    # epilogue: GELU'(h + bias) from the h tile of this output tile
    mask = row_ok[:, None] & col_ok[None, :]
    u = tl.load(H + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    _, dgelu = gelu_fwd_bwd(u, APPROX_TANH)
    dh = tl.where(mask, acc * dgelu, 0.0)
    tl.store(DH + rows.to(tl.int64)[:, None] * stride_dhm + cols[None, :], dh.to(DH.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(PARTIAL + tile_m * K + cols, tl.sum(dh, axis=0), mask=col_ok)


@triton.jit
def _gelu_linear_dw_kernel(
    DW,  # (N, K) grad of the weight, parameter dtype; SPLIT: (S, N, K) fp32 partials, contiguous
    DY, H, BIAS,  # (M, N) grad of y; (M, K); (K,) or None
    stride_dym, stride_hm, stride_dwn,
    M, N, K, rows_per_split,  # program_id(1) = s sums rows [s * rows_per_split, (s + 1) * rows_per_split)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile of dW (N x K), step over rows
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    tile_n, tile_k = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    outs = tile_n * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of dW (the N outputs)
    cols = tile_k * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of dW (the K inputs)
    out_ok, col_ok = outs < N, cols < K
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    row_start = split * rows_per_split
    row_end = tl.minimum(M, row_start + rows_per_split)
    offs_r = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_K):  # fixed order: bitwise reproducible
        r = (r0 + offs_r).to(tl.int64)
        r_ok = r < row_end
        dy_t = tl.load(DY + r[None, :] * stride_dym + outs[:, None], mask=out_ok[:, None] & r_ok[None, :], other=0.0)
        u = tl.load(H + r[:, None] * stride_hm + cols[None, :], mask=r_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += bias
        g, _ = gelu_fwd_bwd(u, APPROX_TANH)  # padded rows meet zero columns of dy^T
        acc = tl.dot(dy_t.to(H.dtype.element_ty), g.to(H.dtype.element_ty), acc, input_precision=INPUT_PRECISION)
    mask = out_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.store(DW + (split * N + outs.to(tl.int64))[:, None] * K + cols[None, :], acc, mask=mask)
    else:
        tl.store(DW + outs[:, None] * stride_dwn + cols[None, :], acc.to(DW.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class GemmTile:
    block_m: int  # output tile rows (dW: rows of dW = N outputs)
    block_n: int  # output tile columns
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GeluLinearConfig:
    fwd: GemmTile
    dh: GemmTile
    dw: GemmTile


GROUP_M = 8
DW_TARGET_PROGRAMS = 256  # about two waves on an A100 (108 SMs) / H100 (132 SMs)
DW_MIN_ROWS_PER_SPLIT = 1024  # a split's fp32 partial tile (N K 4 bytes) costs less than its rows' reads


def gelu_linear_config(dtype: torch.dtype, arch: int, precision: str | None = None) -> GeluLinearConfig:
    """Tiles per (dtype, arch, fp32 dot precision): a small explicit table, no autotuning.

    The forward and dW kernels recompute GELU on an operand once per output tile along the other
    dimension (fwd: per BLOCK_N columns of y, dW: per BLOCK_M rows of W), so sm_90 takes those
    tiles 256 wide; sm_80's register file only fits 128 without spills. The dh kernel's epilogue
    holds the accumulator and the h tile at once, hence its narrower tile. IEEE fp32 dots run on the
    FMA units and take small tiles. ``vit-fast report`` compiles every entry for sm_80 and sm_90
    and prints its registers and spills."""
    if dtype == torch.float32 and (precision or input_precision(dtype)) == "ieee":
        tile = GemmTile(64, 64, 32, 4, 2)  # dW's transposed dy operand spills at BLOCK_K = 32
        return GeluLinearConfig(fwd=tile, dh=tile, dw=GemmTile(64, 64, 16, 4, 2))
    if dtype == torch.float32:  # tf32: fp32 operand tiles take twice the registers / shared memory of 16-bit ones
        tile = GemmTile(128, 64, 32, 8, 3)
        return GeluLinearConfig(fwd=tile, dh=tile, dw=tile)
    if arch >= 90:
        return GeluLinearConfig(fwd=GemmTile(128, 256, 32, 8, 3), dh=GemmTile(128, 64, 64, 8, 4),
                                dw=GemmTile(256, 128, 32, 8, 4))
    return GeluLinearConfig(fwd=GemmTile(128, 128, 32, 8, 3), dh=GemmTile(128, 64, 64, 8, 3),
                            dw=GemmTile(128, 128, 32, 8, 4))


def dw_splits(rows: int, out_tiles: int, block_rows: int) -> tuple[int, int]:
    """(S, rows_per_split) of the dW kernel: split the rows only when the output tiles alone give
    fewer than DW_TARGET_PROGRAMS programs, and never below DW_MIN_ROWS_PER_SPLIT rows per split.
    A function of the shape alone (no device query), so results are reproducible."""
    want = min(triton.cdiv(DW_TARGET_PROGRAMS, out_tiles), triton.cdiv(rows, DW_MIN_ROWS_PER_SPLIT))
    return _split_rows(rows, max(1, want), block_rows)


def _split_rows(rows: int, splits: int, block_rows: int) -> tuple[int, int]:
    """Chunks of whole row steps; drops splits that would be empty."""
    steps = triton.cdiv(max(rows, 1), block_rows)
    per_split = triton.cdiv(steps, max(1, min(splits, steps))) * block_rows
    return triton.cdiv(max(rows, 1), per_split), per_split


# ------------------------------------------------------------ validation and launchers (custom ops)
@torch.library.custom_op("vit_fast::gelu_linear_fwd", mutates_args=())
def gelu_linear_fwd(h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                    approximate: str) -> torch.Tensor:
    """h: (M, K) with contiguous columns; weight (N, K) with contiguous columns. Returns (M, N) in h.dtype."""
    m, k = h.shape
    n = weight.shape[0]
    y = torch.empty((m, n), device=h.device, dtype=h.dtype)
    if m == 0:
        return y
    precision, arch = input_precision(h.dtype), gpu_arch(h.device)

    def launch(t: GemmTile) -> None:
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
        _gelu_linear_fwd_kernel[grid](
            y, h, bias, weight, h.stride(0), weight.stride(0), y.stride(0), m, n, k,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=GROUP_M, HAS_BIAS=bias is not None,
            APPROX_TANH=approximate == "tanh", INPUT_PRECISION=precision, num_warps=t.num_warps,
            num_stages=t.num_stages)
    key = (bucket(m), n, k, str(h.dtype), arch, precision, bias is not None, approximate)
    launch(_tuning.choose("gelu_linear_fwd", key, _candidates(gelu_linear_config(h.dtype, arch, precision).fwd),
                          launch, h.device))
    return y


def _candidates(t: GemmTile) -> list[GemmTile]:
    return _tuning.tile_candidates(t, ("block_m",), stages="num_stages")  # sm_80 bf16 fwd 128x64: 8 B spills


@gelu_linear_fwd.register_fake
def _(h, bias, weight, approximate):
    return h.new_empty((h.shape[0], weight.shape[0]))


@torch.library.custom_op("vit_fast::gelu_linear_bwd", mutates_args=())
def gelu_linear_bwd(dy: torch.Tensor, h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                    approximate: str, dw_split: int, needs_dw: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy: (M, N), h: (M, K), both h's dtype with contiguous columns. Returns dh (M, K) in h.dtype,
    dbias (K,) in bias.dtype (empty without bias), dW (N, K) in weight.dtype (empty, and its kernel not
    launched, with needs_dw False: a frozen weight). ``dw_split`` 0 picks the dW row split from the
    shape (dw_splits); > 0 asks for that many (tests)."""
    m, k = h.shape
    n = weight.shape[0]
    has_bias = bias is not None
    dh = torch.empty((m, k), device=h.device, dtype=h.dtype)
    if m == 0:
        return dh, (torch.zeros_like(bias) if has_bias else h.new_empty(0)), _no_or_zero_dw(weight, needs_dw)
    precision, arch = input_precision(h.dtype), gpu_arch(h.device)
    cfg = gelu_linear_config(h.dtype, arch, precision)
    common = dict(GROUP_M=GROUP_M, HAS_BIAS=has_bias, APPROX_TANH=approximate == "tanh", INPUT_PRECISION=precision)
    key = (bucket(m), n, k, str(h.dtype), arch, precision, has_bias, approximate)

    def launch_dh(t: GemmTile) -> torch.Tensor:
        row_tiles = triton.cdiv(m, t.block_m)
        partial = torch.empty((1, row_tiles, k), device=h.device, dtype=torch.float32) if has_bias else None
        _gelu_linear_dh_kernel[(row_tiles * triton.cdiv(k, t.block_n),)](
            dh, partial, dy, h, bias, weight, dy.stride(0), h.stride(0), weight.stride(0), dh.stride(0), m, n, k,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
            **common)
        return sum_partials(partial, bias.dtype)[0] if has_bias else h.new_empty(0)
    dbias = launch_dh(_tuning.choose("gelu_linear_dh", key, _candidates(cfg.dh), launch_dh, h.device))
    if not needs_dw:
        return dh, dbias, weight.new_empty(0)

    def launch_dw(t: GemmTile) -> torch.Tensor:
        out_tiles = triton.cdiv(n, t.block_m) * triton.cdiv(k, t.block_n)
        splits, rows_per_split = (_split_rows(m, dw_split, t.block_k) if dw_split > 0
                                  else dw_splits(m, out_tiles, t.block_k))
        if splits > 1:
            dw = torch.empty((splits, n, k), device=h.device, dtype=torch.float32)
        else:
            dw = torch.empty((n, k), device=h.device, dtype=weight.dtype)
        _gelu_linear_dw_kernel[(out_tiles, splits)](
            dw, dy, h, bias, dy.stride(0), h.stride(0), dw.stride(-2), m, n, k, rows_per_split,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT=splits > 1, num_warps=t.num_warps,
            num_stages=t.num_stages, **common)
        return sum_partials(dw.view(1, splits, n * k), weight.dtype).view(n, k) if splits > 1 else dw
    return dh, dbias, launch_dw(_tuning.choose("gelu_linear_dw", key + (dw_split,), _candidates(cfg.dw), launch_dw,
                                               h.device))


@gelu_linear_bwd.register_fake
def _(dy, h, bias, weight, approximate, dw_split, needs_dw=True):
    return (torch.empty_like(h, memory_format=torch.contiguous_format),
            torch.empty_like(bias) if bias is not None else h.new_empty(0),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if needs_dw else weight.new_empty(0))


def _no_or_zero_dw(weight: torch.Tensor, needs_dw: bool) -> torch.Tensor:
    return torch.zeros_like(weight, memory_format=torch.contiguous_format) if needs_dw else weight.new_empty(0)


def check_dtypes(op: str, h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor) -> None:
    """All one dtype, or autocast's mix: fp16/bf16 h with fp32 weight (and fp32 bias)."""
    params = [t for t in (weight, bias) if t is not None]
    same = all(t.dtype == h.dtype for t in params)
    autocast = h.dtype in (torch.float16, torch.bfloat16) and all(t.dtype == torch.float32 for t in params)
    if not (same or autocast):
        got = ", ".join(f"{name} {t.dtype}" for name, t in (("h", h), ("weight", weight), ("bias", bias))
                        if t is not None)
        raise ValueError(f"{op}: expected h, weight and bias of one dtype, or fp16/bf16 h with fp32 weight "
                         f"and bias (autocast); got {got}")


# ----------------------------------------------------------------------------------------- autograd
class GeluLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, weight, approximate):
        h2 = as_rows(h, h.shape[-1])
        ctx.save_for_backward(h2, bias, weight)
        ctx.approximate, ctx.shape = approximate, h.shape
        return gelu_linear_fwd(h2, bias, weight, approximate).view(*h.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        h2, bias, weight = ctx.saved_tensors
        dy2 = as_rows(dy, weight.shape[0]).to(h2.dtype)
        needs_dw = ctx.needs_input_grad[2]  # a frozen fc2 weight (e.g. LoRA): skip the dW GEMM
        dh, dbias, dw = gelu_linear_bwd(dy2, h2, bias, weight, ctx.approximate, 0, needs_dw)
        return dh.view(ctx.shape), (dbias if bias is not None else None), (dw if needs_dw else None), None


# --------------------------------------------------------------------------------------- functional
def gelu_linear(h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                approximate: str = "none") -> torch.Tensor:
    """GELU(h + bias) @ weight^T: h (..., K), bias (K,) or None, weight (N, K) -> (..., N) in h.dtype.
    See the module docstring."""
    check_float(OP, "h", h)
    check_float(OP, "weight", weight)
    check_ndim(OP, "weight", weight, 2)
    if h.dim() < 1 or h.shape[-1] != weight.shape[1] or 0 in weight.shape:
        raise ValueError(f"{OP}: expected weight of shape (N, K) with N, K >= 1 and h (..., K); "
                         f"got weight {tuple(weight.shape)} and h {tuple(h.shape)}")
    if bias is not None:
        check_float(OP, "bias", bias)
        if tuple(bias.shape) != (h.shape[-1],):
            raise ValueError(f"{OP}: expected bias of shape ({h.shape[-1]},), got {tuple(bias.shape)}")
    check_dtypes(OP, h, bias, weight)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{OP}: expected approximate 'none' or 'tanh', got {approximate!r}")
    check_kernel_device(OP, h, bias, weight)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()  # kernels read columns at unit stride
    return GeluLinearFunction.apply(h, unit_stride(bias), weight, approximate)


# ---------------------------------------------------------------------------------------- reference
def gelu_linear_ref(h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor,
                    approximate: str = "none") -> torch.Tensor:
    """Pure-PyTorch reference computing what the kernels compute: GELU in fp32 (or fp64), g and the
    weight cast to h's dtype (autocast's copies), the Linear in h's dtype."""
    compute = torch.promote_types(h.dtype, torch.float32)
    u = h.to(compute) + bias.to(compute) if bias is not None else h.to(compute)
    return F.linear(F.gelu(u, approximate=approximate).to(h.dtype), weight.to(h.dtype))


# ------------------------------------------------------------------------------ ahead-of-time specs
def aot_specs(tokens: int = 197, width: int = 768, mlp_hidden: int = 3072, dtype: torch.dtype = torch.bfloat16,
              arch: int = 80, param_dtype: torch.dtype = torch.float32, **_) -> list[AotSpec]:
    """Every launch of one ViT MLP's gelu_linear (N = width, K = mlp_hidden): forward, dh and dW
    (split and not) with both GELU forms, and the partial-sum reduction; fp32 with both dot
    precisions (IEEE entries run on FMA units: has_dot False). Parameters in ``param_dtype`` for
    16-bit activations (autocast), else fp32."""
    param_dtype = param_dtype if dtype != torch.float32 else torch.float32
    act, par = "*" + TRITON_DTYPE_NAMES[dtype], "*" + TRITON_DTYPE_NAMES[param_dtype]
    n, k = width, mlp_hidden
    values = dict(N=n, K=k, stride_hm=k, stride_wn=k, stride_ym=n, stride_dym=n, stride_dhm=k, stride_dwn=k,
                  rows_per_split=DW_MIN_ROWS_PER_SPLIT)
    specs = []

    def add(name, fn, tile, constexprs, types, tensor_cores, note):
        constexprs = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
                          HAS_BIAS=True, **constexprs)
        signature = kernel_signature(fn, types, constexprs)
        specs.append(AotSpec(name, fn, signature, constexprs, tile.num_warps, tile.num_stages, tensor_cores, note,
                             divisible_by_16=divisible_args(signature, values)))

    types = dict(Y=act, H=act, DY=act, DH=act, BIAS=par, W=par, DW=par, PARTIAL="*fp32")
    for precision in ("ieee", "tf32") if dtype == torch.float32 else ("ieee",):
        cfg = gelu_linear_config(dtype, arch, precision)
        tensor_cores = dtype != torch.float32 or precision == "tf32"
        for approx in (False, True):
            c = dict(APPROX_TANH=approx, INPUT_PRECISION=precision)
            note = f"N={n} K={k} tanh={approx}"
            add("gelu_linear_fwd", _gelu_linear_fwd_kernel, cfg.fwd, c, types, tensor_cores, note)
            add("gelu_linear_dh", _gelu_linear_dh_kernel, cfg.dh, c, types, tensor_cores, note)
            for split in (False, True):
                add("gelu_linear_dw", _gelu_linear_dw_kernel, cfg.dw, dict(c, SPLIT=split),
                    dict(types, DW="*fp32") if split else types, tensor_cores, f"{note} split={split}")
    specs.append(sum_partials_spec(par, 256, f"N={k} (dbias) and N*K (split dW)", width=k))
    return specs
