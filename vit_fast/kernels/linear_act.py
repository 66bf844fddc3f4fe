"""The MLP with its activation evaluated once per element per pass:
``linear_act(x, w1, b1, w2, activation) = act(x @ w1^T + b1) @ w2^T``.

fc1 is a Triton GEMM whose epilogue adds the bias and applies the activation (once per element); fc2,
its weight gradient and fc1's two backward GEMMs run on cuBLAS (plain torch matmuls); fc2's dgrad GEMM
is a Triton GEMM applying act' in its epilogue (once per element) and writing fp32 column-sum partials
for fc1's bias gradient (two-stage, no atomics). fc2's own bias is not part of the op (the model adds
it in its residual-join kernel). The activation is a constexpr switch (ACT): exact-erf GELU, tanh
GELU, QuickGELU x * sigmoid(1.702 x).

Shapes: x (..., C), w1 (H, C), b1 (H,) or None, w2 (N, H); result (..., N) in x.dtype. x is viewed as
M x C rows (copied once only if its last dim is strided); weights are read through their row stride.

Math, u = x w1^T + b1 (the pre-activation), h = act(u):
    u, h  = x @ w1^T (+ b1, act)       _linear_act_fwd_kernel: GEMM M x H x C; epilogue + bias, act, writes
                                       h (fc2's input) and u (backward's, skipped without grad)
    y     = h @ w2^T                   cuBLAS
    dw2   = dy^T @ h                   cuBLAS
    du    = (dy @ w2) * act'(u)        _linear_act_bwd_kernel: GEMM M x H x N; act' in the epilogue, which
                                       loads the u tile of its output tile; writes du and fp32 column sums
                                       per row tile, reduced in a fixed order by _rows.sum_partials
    db1   = sum_rows du                sum_partials (bitwise reproducible)
    dx    = du @ w1, dw1 = du^T @ x    cuBLAS

Dtypes: all fp32 (Triton dots IEEE unless torch.backends.cuda.matmul.allow_tf32, then tf32), all fp16 /
all bf16, or autocast's mix: fp16/bf16 x with fp32 weights and bias. Under the mix the weights are cast to
x's dtype once per call by torch (what autocast does; autograd casts their gradients back), and b1 stays
fp32 (read in the epilogue); db1 comes back in b1's dtype. Accumulation and all elementwise math fp32,
h and u stored in x's dtype. Other mixes raise ValueError.

Limits: any leading shape (0 rows included), C, H, N >= 1 (tiles masked; EVEN_K drops the K mask where
the reduction is a multiple of BLOCK_K, as for every ViT width). Launches: forward 1 Triton + 1 cuBLAS;
backward 1 Triton dgrad + 1 sum_partials (with b1) + up to 3 cuBLAS (dw2, dx, dw1; each skipped when
its input needs no gradient).

HBM traffic per row of M (s = bytes of x's dtype; C = width, H = hidden; weights and partials aside):
    forward   fc1: read x (C s), write h (H s) and act'(u) (H s);  fc2: read h (H s), write y (N s)
    backward  dw2: read dy, h;  dgrad: read dy, act'(u), write du;  dx: read du, write dx;  dw1: read du, x
For ViT (H = 4C, N = C): forward 14C s, backward 24C s. The removed gelu_linear path (fc1 on cuBLAS,
GELU inside fc2's operand loads) moved 10C s and 24C s but was issue-bound (a 35% tensor-core ceiling on
sm_90, 11% on sm_80: the GELU redone per output tile). Eager (cuBLAS + separate GELU and GELU backward): 18C s
and 32C s. Memory held for backward: x, h and act'(u) (eager holds x, u and h).
Configs (linear_act_config) compile for sm_80 / sm_90 with 0 spill bytes (aot_specs, `vit-fast report`);
main-loop ceiling (CONTRIBUTING.md 3b2) in the docstring of linear_act_config. On sm_90+ in 16 bits the same
tiles (and a co-resident one, ``CO_RESIDENT_TMA``) also run on persistent TMA kernels (linear_act_tma.py, a
``TmaTile``): the static choice there unless ``VIT_FAST_TMA_GEMM=0`` (measured faster on the H200), and what
``tma_only()`` forces for checks. In 16 bits the forward's autotuning also tries a co-resident pointer tile
(``CO_RESIDENT``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning, linear_act_tma
from ._aot import TRITON_DTYPE_NAMES, AotSpec, divisible_args, kernel_signature
from ._gemm import GROUP_M, GemmTile, column_halves, grouped_tile
from ._math import ACTIVATIONS, act_fwd_bwd
from ._rows import as_rows, bind_sum_partials, sum_partials_block_n, sum_partials_spec
from ._tuning import KernelLaunch
from ._utils import (
    cdiv,
    check_float,
    check_kernel_device,
    check_ndim,
    first_order_only,
    gpu_arch,
    input_precision,
    kernel_op,
    run_op,
    unit_stride,
)
from .linear_act_tma import TmaTile, tma_compatible

OP = "linear_act"


# --------------------------------------------------------------------------- kernels
@triton.jit
def _main_loop(A, B, a_rows, b_cols, stride_am, stride_bk, stride_bn, K, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc = A[a_rows, :K] @ B[:K, b_cols] in fp32, A with contiguous columns, B addressed by (stride_bk,
    stride_bn); EVEN_K: K % BLOCK_K == 0, no mask."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + offs_k[:, None] * stride_bk + b_cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _linear_act_fwd_kernel(
    H, DACT,  # (M, N) act(u) and act'(u), u = x w^T + b, x's dtype (DACT unused without STORE_DACT)
    X, W, BIAS,  # (M, K) input; (N, K) weight, x's dtype; (N,) bias or None
    stride_xm, stride_wn, stride_hm, stride_dm,  # row strides (columns contiguous)
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # output tile, reduction step
    GROUP_M: tl.constexpr,  # row tiles per group of the tile order
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask in the main loop
    HAS_BIAS: tl.constexpr, STORE_DACT: tl.constexpr, ACT: tl.constexpr,  # ACT: 0 gelu, 1 gelu_tanh, 2 quick_gelu
    INPUT_PRECISION: tl.constexpr,  # "ieee" / "tf32" (fp32 dots only)
):
    tile_m, tile_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # the main loop reads wrapped rows / columns (never stored) instead of masking them
    a_rows = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    b_cols = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N)
    # B = W^T: (BLOCK_K, BLOCK_N) tiles of W, the reduction along W's contiguous columns
    acc = _main_loop(X, W, a_rows, b_cols, stride_xm, 1, stride_wn, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                     INPUT_PRECISION)
    # epilogue, once per element, in four column quarters: fewer live registers, so that every activation's
    # 128 x 256 tile and the 4-warp co-resident tiles compile without spills
    halves = column_halves(acc, BLOCK_M, BLOCK_N)
    col0 = tile_n * BLOCK_N
    _fwd_epilogue_half(halves[0], H, DACT, BIAS, rows, col0, M, N, stride_hm, stride_dm, BLOCK_M, BLOCK_N // 2,
                       HAS_BIAS, STORE_DACT, ACT)
    _fwd_epilogue_half(halves[1], H, DACT, BIAS, rows, col0 + BLOCK_N // 2, M, N, stride_hm, stride_dm, BLOCK_M,
                       BLOCK_N // 2, HAS_BIAS, STORE_DACT, ACT)


@triton.jit
def _fwd_epilogue_half(acc, H, DACT, BIAS, rows, col0, M, N, stride_hm, stride_dm, BLOCK_M: tl.constexpr,
                       HALF_N: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_DACT: tl.constexpr, ACT: tl.constexpr):
    quarters = column_halves(acc, BLOCK_M, HALF_N)
    cols = col0 + tl.arange(0, HALF_N // 2)
    _fwd_epilogue(quarters[0], H, DACT, BIAS, rows, cols, M, N, stride_hm, stride_dm, HAS_BIAS, STORE_DACT, ACT)
    _fwd_epilogue(quarters[1], H, DACT, BIAS, rows, cols + HALF_N // 2, M, N, stride_hm, stride_dm, HAS_BIAS,
                  STORE_DACT, ACT)


@triton.jit
def _fwd_epilogue(acc, H, DACT, BIAS, rows, cols, M, N, stride_hm, stride_dm,
                  HAS_BIAS: tl.constexpr, STORE_DACT: tl.constexpr, ACT: tl.constexpr):
    """+ bias, act and act' of one fp32 accumulator tile; stores h (and act'(u))."""
    col_ok = cols < N
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    h, dact = act_fwd_bwd(acc, ACT)  # one exp serves both
    tl.store(H + rows64 * stride_hm + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
    if STORE_DACT:
        tl.store(DACT + rows64 * stride_dm + cols[None, :], dact.to(DACT.dtype.element_ty), mask=mask)


@triton.jit
def _linear_act_bwd_kernel(
    DU, PARTIAL,  # (M, K) grad of u, x's dtype; (T, K) fp32 column sums of du per row tile (HAS_BIAS)
    DY, W, DACT,  # (M, N) grad of h @ w^T; (N, K) fc2 weight; (M, K) act'(u) from the forward
    stride_dym, stride_wn, stride_dm, stride_dum,
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile of du (rows x K), step over N
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr,  # N % BLOCK_K == 0: no mask in the main loop
    HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    tile_m, tile_k = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_k * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of u (the hidden dimension)
    a_rows = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    b_cols = tl.max_contiguous(tl.multiple_of(cols % K, BLOCK_N), BLOCK_N)
    # reduction over the N outputs of fc2: B = W, (BLOCK_K, BLOCK_N) tiles along its rows
    acc = _main_loop(DY, W, a_rows, b_cols, stride_dym, stride_wn, 1, N, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N,
                     INPUT_PRECISION)
    # epilogue: one multiply by act'(u) per element
    col_ok = cols < K
    mask = (rows[:, None] < M) & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    dact = tl.load(DACT + rows64 * stride_dm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    du = tl.where(mask, acc * dact, 0.0)  # wrapped rows / columns hold duplicates: zero before the sums
    tl.store(DU + rows64 * stride_dum + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(PARTIAL + tile_m * K + cols, tl.sum(du, axis=0), mask=col_ok)


# --------------------------------------------------------------------------- config table
@dataclass(frozen=True)
class LinearActConfig:
    fwd: GemmTile  # fc1 + bias + act
    bwd: GemmTile  # fc2 dgrad * act'


def linear_act_config(dtype: torch.dtype, arch: int, precision: str | None = None) -> LinearActConfig:
    """Tiles per (dtype, arch, fp32 dot precision): a small explicit table, the static first candidate of
    autotuning (kernels/_tuning.py).

    16-bit: the shapes of Triton's tutorial GEMM, which reads a 100% main-loop ceiling and runs near
    cuBLAS: sm_90 128x256x64, 8 warps (two warpgroups of HGMMA.64x256x16), sm_80 128x256x32 8 warps,
    grouped tile order, for every activation; the fc1 epilogue runs in four column quarters to fit. The dgrad
    holds the accumulator and the act'(u) tile: sm_90 256x128x64 (HGMMA.64x128x16), sm_80 128x256x32.
    Checked by hand (CONTRIBUTING.md 3b2, bf16, C = 768, H = 3072; cuobjdump --dump-sass, loop = the backward
    branch holding the MMAs; the same count gives gelu_linear's forward 730 instructions, 35%):
        sm_90 fwd 128x256x64 w8: 128 instr/warp, 4 HGMMA.64x256x16: issue 256 vs MMA 1024
        sm_90 dgrad 256x128x64 w8: 129 instr, 8 HGMMA.64x128x16: 258 vs 1024
        sm_80 fwd 128x256x32 w8: 171 instr, 64 HMMA.16816: 342 vs 1024
        sm_80 dgrad 128x256x32 w8: 169 instr, 64 HMMA.16816: 338 vs 1024
    no MUFU in any loop: ceiling 100% everywhere; 0 spill bytes for every activation on both archs (``vit-fast
    report``, which also lists the registers). IEEE fp32 dots run on the FMA units and take small tiles; tf32
    operand tiles take twice the registers / shared memory of 16-bit ones."""
    if dtype == torch.float32 and (precision or input_precision(dtype)) == "ieee":
        tile = GemmTile(64, 64, 32, 4, 2)
        return LinearActConfig(fwd=tile, bwd=tile)
    if dtype == torch.float32:
        tile = GemmTile(128, 64, 32, 8, 3)
        return LinearActConfig(fwd=tile, bwd=tile)
    if arch >= 90:
        return LinearActConfig(fwd=GemmTile(128, 256, 64, 8, 3), bwd=GemmTile(256, 128, 64, 8, 3))
    return LinearActConfig(fwd=GemmTile(128, 256, 32, 8, 3), bwd=GemmTile(128, 256, 32, 8, 3))


# --------------------------------------------------------------------------- launchers
@kernel_op("vit_fast::linear_act_fwd")
def linear_act_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
                   store_dact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), weight (N, K) in x's dtype, both with contiguous columns; bias (N,) or None. Returns
    (h, d) = (act(u), act'(u)), u = x weight^T + bias, (M, N) in x's dtype (d empty without store_dact)."""
    m = x.shape[0]
    n = weight.shape[0]
    h = torch.empty((m, n), device=x.device, dtype=x.dtype)
    dact = torch.empty((m, n) if store_dact else (0, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return h, dact
    # read per call: torch's tf32 flag, the TMA switch's environment variable
    precision, arch, with_tma = input_precision(x.dtype), gpu_arch(x.device), linear_act_tma.enabled()
    plan = _FWD_PLANS.get((x.shape, x.stride(0), weight.shape, weight.stride(0), x.dtype, bias is None, activation,
                           store_dact, x.device, precision, arch, with_tma, tma_only.on),
                          x, weight, bias, activation, store_dact, precision, arch, with_tma)

    def launch(t: GemmTile) -> None:
        plan.bind(t)(h, dact, x, weight, bias)
    launch(plan.choose(x.device, launch))
    return h, dact


def _fwd_plan(x, weight, bias, activation: str, store_dact: bool, precision: str, arch: int,
              with_tma: bool) -> _tuning.LaunchPlan:
    m, k = x.shape
    n = weight.shape[0]
    static = linear_act_config(x.dtype, arch, precision).fwd
    # with_tma and the fp32 dot precision in the key: each changes the candidates
    key = (_tuning.bucket(m), n, k, str(x.dtype), arch, precision, activation, store_dact, with_tma)

    def bind(t: GemmTile):
        grid = (cdiv(m, t.block_m) * cdiv(n, t.block_n),)
        kernel = KernelLaunch(_linear_act_fwd_kernel, grid, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                              GROUP_M=GROUP_M, EVEN_K=k % t.block_k == 0, HAS_BIAS=bias is not None,
                              STORE_DACT=store_dact, ACT=ACTIVATIONS[activation], INPUT_PRECISION=precision,
                              num_warps=t.num_warps, num_stages=t.num_stages)

        def launch(h, dact, x, weight, bias):
            if isinstance(t, TmaTile) and tma_compatible(h, x, weight, *((dact,) if store_dact else ())):
                return linear_act_tma.launch_fwd(h, dact, x, weight, bias, activation, store_dact, t)
            kernel(h, dact, x, weight, bias, x.stride(0), weight.stride(0), h.stride(0), dact.stride(0), m, n, k)
        return launch
    return _tuning.LaunchPlan("linear_act_fwd", key,
                              _candidates(static, x.dtype, arch, tma_only.on, with_tma, co_resident=True), bind)


_FWD_PLANS = _tuning.LaunchPlans(_fwd_plan)


# inside ``with tma_only():`` every 16-bit launch (of any thread: backwards included) runs the static tile on the
# TMA kernels (where the operands allow), whatever the architecture or the autotuner would pick
tma_only = _tuning.ProcessSwitch()


# The fc1 forward's co-resident tiles (16 bits): two programs of 4 warps share an SM, so that (PREDICTED; not yet
# timed) one program's epilogue overlaps the other's MMAs. Not for the pointer dgrad, whose 4-warp tile spills.
# In ``aot_specs``.
CO_RESIDENT = {80: GemmTile(128, 128, 32, 4, 4), 90: GemmTile(128, 128, 64, 4, 3)}


def co_resident_tile(arch: int) -> GemmTile:
    return CO_RESIDENT[90 if arch >= 90 else 80]
CO_RESIDENT_TMA = TmaTile(128, 128, 64, 4, 2, programs_per_sm=2)  # both passes


@functools.lru_cache(maxsize=None)  # asked on every launch
def _candidates(static: GemmTile, dtype: torch.dtype, arch: int, only_tma: bool = False, with_tma: bool = False,
                co_resident: bool = False) -> tuple[GemmTile, ...]:
    """The static tile first; autotuning (on a GPU) may also try half the rows or one more stage, in 16 bits
    ``CO_RESIDENT[arch]`` where ``co_resident`` (the forward). With ``with_tma`` (``linear_act_tma.enabled``) on
    sm_90+ in 16 bits the static tile on the persistent TMA kernels comes first (the static choice: faster on the
    H200, linear_act_tma's docstring) and ``CO_RESIDENT_TMA`` joins the rest. ``only_tma`` (``tma_only``): the
    static tile on the TMA kernels alone, in 16 bits."""
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    if only_tma and sixteen_bit:
        return (TmaTile.of(static),)
    tiles = _tuning.tile_candidates(static, ("block_m",), stages="num_stages")
    if sixteen_bit and co_resident:
        tiles.append(co_resident_tile(arch))
    if sixteen_bit and with_tma and arch >= 90:
        tiles = [TmaTile.of(static)] + tiles + [CO_RESIDENT_TMA]
    return tuple(_tuning.unique(tiles))


@linear_act_fwd.register_fake
def _(x, weight, bias, activation, store_dact):
    n = weight.shape[0]
    return x.new_empty((x.shape[0], n)), x.new_empty((x.shape[0], n) if store_dact else (0, n))


@kernel_op("vit_fast::linear_act_bwd")
def linear_act_bwd(dy: torch.Tensor, dact: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (M, N), dact = act'(u) (M, K), weight = w2 (N, K), all x's dtype with contiguous columns.
    Returns du = (dy @ w2) * act'(u) (M, K) in dact's dtype and its column sums db (K,) in bias's dtype
    (empty without bias; bias itself is not read)."""
    m, k = dact.shape
    has_bias = bias is not None
    du = torch.empty((m, k), device=dact.device, dtype=dact.dtype)
    if m == 0:
        return du, (torch.zeros_like(bias) if has_bias else dact.new_empty(0))
    precision, arch, with_tma = input_precision(dact.dtype), gpu_arch(dact.device), linear_act_tma.enabled()
    bias_dtype = None if bias is None else bias.dtype
    plan = _BWD_PLANS.get((dact.shape, dact.stride(0), dy.stride(0), weight.shape, weight.stride(0), dact.dtype,
                           bias_dtype, dact.device, precision, arch, with_tma, tma_only.on),
                          dy, dact, weight, bias_dtype, precision, arch, with_tma)

    def launch(t: GemmTile) -> Optional[torch.Tensor]:
        return plan.bind(t)(du, dy, weight, dact)
    db = launch(plan.choose(dact.device, launch))
    return du, (db if has_bias else dact.new_empty(0))


def _bwd_plan(dy, dact, weight, bias_dtype: Optional[torch.dtype], precision: str, arch: int,
              with_tma: bool) -> _tuning.LaunchPlan:
    """The dgrad's launches; ``bias_dtype``: the bias's (its gradient's) dtype, None without a bias."""
    m, k = dact.shape
    n = weight.shape[0]
    has_bias = bias_dtype is not None
    device = dact.device
    static = linear_act_config(dact.dtype, arch, precision).bwd
    key = (_tuning.bucket(m), n, k, str(dact.dtype), arch, precision, has_bias, with_tma)

    def bind(t: GemmTile):
        row_tiles = cdiv(m, t.block_m)
        grid = (row_tiles * cdiv(k, t.block_n),)
        kernel = KernelLaunch(_linear_act_bwd_kernel, grid, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                              GROUP_M=GROUP_M, EVEN_N=n % t.block_k == 0, HAS_BIAS=has_bias,
                              INPUT_PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages)
        summed = bind_sum_partials(1, row_tiles, k, bias_dtype, device) if has_bias else None

        def launch(du, dy, weight, dact) -> Optional[torch.Tensor]:
            """du, and with a bias its column sums (K,) in the bias's dtype (per-tile fp32 partials, then
            ``sum_partials``), else None."""
            partial = torch.empty((1, row_tiles, k), device=device, dtype=torch.float32) if has_bias else None
            if isinstance(t, TmaTile) and tma_compatible(du, dy, weight, dact):
                linear_act_tma.launch_bwd(du, partial, dy, weight, dact, t)
            else:
                kernel(du, partial, dy, weight, dact, dy.stride(0), weight.stride(0), dact.stride(0), du.stride(0), m,
                       n, k)
            return summed(partial)[0] if has_bias else None
        return launch
    return _tuning.LaunchPlan("linear_act_bwd", key, _candidates(static, dact.dtype, arch, tma_only.on, with_tma),
                              bind)


_BWD_PLANS = _tuning.LaunchPlans(_bwd_plan)


def launch_fwd(h: torch.Tensor, dact: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor], activation: str, store_dact: bool, t: GemmTile) -> None:
    """The forward kernel on tile ``t`` alone (the TMA kernel for a ``TmaTile`` whose operands TMA can describe,
    else the pointer kernel on the same tile): what tests and probes compare."""
    _fwd_plan(x, weight, bias, activation, store_dact, input_precision(x.dtype), gpu_arch(x.device),
              True).bind(t)(h, dact, x, weight, bias)


def launch_bwd(du: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, dact: torch.Tensor, has_bias: bool,
               t: GemmTile) -> Optional[torch.Tensor]:
    """The dgrad kernel on tile ``t`` alone (as ``launch_fwd``); returns du's fp32 column sums (K,) with
    ``has_bias``, else None."""
    return _bwd_plan(dy, dact, weight, torch.float32 if has_bias else None, input_precision(dact.dtype),
                     gpu_arch(dact.device), True).bind(t)(du, dy, weight, dact)


@linear_act_bwd.register_fake
def _(dy, dact, weight, bias):
    return (torch.empty_like(dact, memory_format=torch.contiguous_format),
            torch.empty_like(bias) if bias is not None else dact.new_empty(0))


# --------------------------------------------------------------------------- autograd and public API
class LinearActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, activation, needs_du):
        x2 = as_rows(x, x.shape[-1])  # needs_du: a grad of x, w1 or b1 is wanted (fc2's dgrad GEMM runs)
        h, dact = run_op(linear_act_fwd, x2, w1, b1, activation, needs_du)
        y = F.linear(h, w2)  # cuBLAS
        ctx.save_for_backward(x2, w1, b1, w2, h, dact)
        ctx.shape, ctx.needs_du = x.shape, needs_du
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dy):
        x2, w1, b1, w2, h, dact = ctx.saved_tensors
        dy2 = as_rows(dy, w2.shape[0]).to(h.dtype)
        dx = dw1 = db1 = dw2 = None
        if ctx.needs_input_grad[3]:
            dw2 = dy2.t().mm(h)  # cuBLAS
        if ctx.needs_du:
            needs_db = b1 is not None and ctx.needs_input_grad[2]
            du, db = run_op(linear_act_bwd, dy2, dact, w2, b1 if needs_db else None)
            db1 = db if needs_db else None
            if ctx.needs_input_grad[0]:
                dx = du.mm(w1).view(ctx.shape)  # cuBLAS
            if ctx.needs_input_grad[1]:
                dw1 = du.t().mm(x2)  # cuBLAS
        return dx, dw1, db1, dw2, None, None


def _check_weight(name: str, w: torch.Tensor, cols: int, cols_name: str) -> None:
    check_float(OP, name, w)
    check_ndim(OP, name, w, 2)
    if w.shape[1] != cols or w.shape[0] == 0:
        raise ValueError(f"{OP}: expected {name} of shape (*, {cols}) ({cols_name}) with at least one row, "
                         f"got {tuple(w.shape)}")


def check_dtypes(x: torch.Tensor, params: list[tuple[str, Optional[torch.Tensor]]]) -> None:
    """All one dtype, or autocast's mix: fp16/bf16 x with fp32 weights and bias."""
    present = [t for _, t in params if t is not None]
    same = all(t.dtype == x.dtype for t in present)
    autocast = x.dtype in (torch.float16, torch.bfloat16) and all(t.dtype == torch.float32 for t in present)
    if not (same or autocast):
        got = ", ".join(f"{name} {t.dtype}" for name, t in [("x", x)] + params if t is not None)
        raise ValueError(f"{OP}: expected x, weights and bias of one dtype, or fp16/bf16 x with fp32 weights "
                         f"and bias (autocast); got {got}")


def linear_act(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
               activation: str = "gelu") -> torch.Tensor:
    """act(x @ w1^T + b1) @ w2^T: x (..., C), w1 (H, C), b1 (H,) or None, w2 (N, H) -> (..., N) in
    x.dtype; activation 'gelu' (exact erf), 'gelu_tanh' or 'quick_gelu'. See the module docstring."""
    check_float(OP, "x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{OP}: expected x of shape (..., C) with C >= 1, got {tuple(x.shape)}")
    _check_weight("w1", w1, x.shape[-1], "C = x.shape[-1]")
    _check_weight("w2", w2, w1.shape[0], "H = w1.shape[0]")
    if b1 is not None:
        check_float(OP, "b1", b1)
        if tuple(b1.shape) != (w1.shape[0],):
            raise ValueError(f"{OP}: expected b1 of shape ({w1.shape[0]},), got {tuple(b1.shape)}")
    check_dtypes(x, [("w1", w1), ("b1", b1), ("w2", w2)])
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: expected activation in {tuple(ACTIVATIONS)}, got {activation!r}")
    check_kernel_device(OP, x, w1, b1, w2)
    # autocast's weight copies (autograd casts the gradients back); the kernels read columns at unit stride
    w1, w2 = (w.to(x.dtype) if w.stride(-1) == 1 else w.to(x.dtype).contiguous() for w in (w1, w2))
    needs_du = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w1, b1))
    return LinearActFunction.apply(x, w1, unit_stride(b1), w2, activation, needs_du)


def act_ref(u: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "quick_gelu":
        return u * torch.sigmoid(1.702 * u)
    return F.gelu(u, approximate="tanh" if activation == "gelu_tanh" else "none")


def linear_act_ref(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                   activation: str = "gelu") -> torch.Tensor:
    """Pure-PyTorch reference computing what the kernels compute: fc1 in x's dtype with the weight cast
    to it, bias and activation in fp32 (or fp64), h cast to x's dtype, fc2 in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    u = F.linear(x, w1.to(x.dtype)).to(compute)
    u = u + b1.to(compute) if b1 is not None else u
    return F.linear(act_ref(u, activation).to(x.dtype), w2.to(x.dtype))


# --------------------------------------------------------------------------- ahead-of-time specs
def aot_specs(tokens: int = 197, width: int = 768, mlp_hidden: int = 3072, dtype: torch.dtype = torch.bfloat16,
              arch: int = 80, param_dtype: torch.dtype = torch.float32, **_) -> list[AotSpec]:
    """Every launch of one ViT MLP's linear_act (C = width, H = mlp_hidden): fc1 forward with each
    activation (training and inference), fc2's dgrad, and the db1 partial sum; fp32 with both dot
    precisions (IEEE entries run on FMA units: has_dot False); in 16 bits the forward's co-resident tile, and on
    sm_90 the static and the co-resident tiles on the TMA kernels too. Weights are in the activation dtype (the
    launcher casts them); the bias in ``param_dtype`` for 16-bit activations (autocast), else fp32."""
    param_dtype = param_dtype if dtype != torch.float32 else torch.float32
    act, par = "*" + TRITON_DTYPE_NAMES[dtype], "*" + TRITON_DTYPE_NAMES[param_dtype]
    c, hid = width, mlp_hidden
    specs = []

    def add(name, fn, tile, constexprs, types, values, tensor_cores, note):
        constexprs = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
                          HAS_BIAS=True, **constexprs)
        signature = kernel_signature(fn, types, constexprs)
        specs.append(AotSpec(name, fn, signature, constexprs, tile.num_warps, tile.num_stages, tensor_cores, note,
                             divisible_by_16=divisible_args(signature, values)))

    types = dict(H=act, DACT=act, X=act, W=act, DU=act, DY=act, BIAS=par, PARTIAL="*fp32")
    fwd_values = dict(N=hid, K=c, stride_xm=c, stride_wn=c, stride_hm=hid, stride_dm=hid)
    bwd_values = dict(N=c, K=hid, stride_dym=c, stride_wn=hid, stride_dm=hid, stride_dum=hid)
    for precision in ("ieee", "tf32") if dtype == torch.float32 else ("ieee",):
        cfg = linear_act_config(dtype, arch, precision)
        tensor_cores = dtype != torch.float32 or precision == "tf32"
        fwd = cfg.fwd
        for name, code in ACTIVATIONS.items():
            for store in (True, False):  # training / inference
                add("linear_act_fwd", _linear_act_fwd_kernel, fwd,
                    dict(ACT=code, INPUT_PRECISION=precision, EVEN_K=c % fwd.block_k == 0, STORE_DACT=store),
                    types, fwd_values, tensor_cores, f"C={c} H={hid} {name} store_dact={store}")
        add("linear_act_bwd", _linear_act_bwd_kernel, cfg.bwd,
            dict(INPUT_PRECISION=precision, EVEN_N=c % cfg.bwd.block_k == 0), types, bwd_values, tensor_cores,
            f"C={c} H={hid}")
    specs.append(sum_partials_spec(par, sum_partials_block_n(hid), f"N={hid} (db1)", width=hid))
    if dtype in (torch.float16, torch.bfloat16):  # the co-resident forward candidate
        tile = co_resident_tile(arch)
        for name, code in ACTIVATIONS.items():
            for store in (True, False):
                add("linear_act_fwd_co_resident", _linear_act_fwd_kernel, tile,
                    dict(ACT=code, INPUT_PRECISION="ieee", EVEN_K=c % tile.block_k == 0, STORE_DACT=store),
                    types, fwd_values, True, f"C={c} H={hid} {name} store_dact={store}")
    if dtype in (torch.float16, torch.bfloat16) and arch >= 90:  # the static and co-resident tiles as TMA candidates
        cfg = linear_act_config(dtype, arch)
        specs += linear_act_tma.tma_aot_specs(c, hid, dtype, param_dtype, cfg.fwd, cfg.bwd)
        specs += linear_act_tma.tma_aot_specs(c, hid, dtype, param_dtype, CO_RESIDENT_TMA, CO_RESIDENT_TMA,
                                              infix="_co_resident")
    return specs
