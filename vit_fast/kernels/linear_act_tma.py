"""``linear_act``'s two Triton GEMMs on the Hopper recipe: TMA tensor-descriptor loads and stores, persistent
programs (``TmaTile.programs_per_sm`` per SM) stepping over output tiles in the grouped order, so the next tile's
loads are in flight while the current tile's epilogue (bias, activation, two stores) runs. Same math, epilogues and
outputs as the pointer kernels in ``linear_act.py`` (its docstring has the math and traffic); fp32 accumulation, one
program per output tile at a time in a fixed reduction order: deterministic.

Config: ``TmaTile``, a ``GemmTile`` these kernels run. On sm_90+ in fp16/bf16 linear_act's static tiles run here
(its first candidates) and ``CO_RESIDENT_TMA`` joins the autotuning candidates (``linear_act._candidates``), unless
``VIT_FAST_TMA_GEMM=0``: measured on the H200 at ViT-B/16 b256 (torch 2.11, triton 3.6, 2026-11-27), fc1 forward
0.557 ms against 0.617 on the pointer kernel's same tile and the dgrad 0.500 against 0.623, outputs bitwise the
pointer kernels' (the bias gradient's partials summed in another order: 6e-5). ``linear_act.tma_only()`` forces the
static one (checks, tests). Where the operands break TMA's rules (``tma_compatible``) the pointer kernels run the
same tile. Out-of-bounds rows and columns of a TMA load read as zero and TMA stores clip at the tensor's edge, so no
index wraps or masks are needed except for the bias and the bias-gradient partials. Warp specialisation
(``tl.range(..., warp_specialize=True)``) is left out: with triton 3.8 for sm_90 it failed to compile at 4 warps and
changed nothing at 8 (the same registers and an 8-byte spill as the unflattened loop).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._aot import TRITON_DTYPE_NAMES, AotSpec, divisible_args, kernel_signature
from ._gemm import GROUP_M, GemmTile, column_halves, grouped_tile
from ._math import ACTIVATIONS, act_fwd_bwd
from ._tuning import launcher
from ._utils import cdiv, env_switch, programs_to_fill

ENV_SWITCH = "VIT_FAST_TMA_GEMM"


def enabled() -> bool:
    """Whether linear_act runs its sm_90+ 16-bit static tiles here and times the TMA candidates (on unless
    ``VIT_FAST_TMA_GEMM`` is '0', 'false', 'off' or 'no')."""
    return env_switch(ENV_SWITCH)


# The static SASS model costs every instruction of a loop at every iteration: here the tile loop is flattened with
# the K loop, so the epilogue (bias, activation, TMA stores), run once per tile, is counted at every K step.
NOT_MODELLED = "persistent: the epilogue in the flattened tile loop runs once per tile, the model counts it per K step"

# Programs of an interpreted launch (no GPU): a few, so each steps over several tiles as on a GPU.
INTERPRETED_PROGRAMS = 3


@dataclasses.dataclass(frozen=True)
class TmaTile(GemmTile):
    """A GemmTile run by the persistent TMA kernels: the same output tile, reduction step, warps and stages, and
    how many persistent programs share each SM."""

    programs_per_sm: int = 1

    @classmethod
    def of(cls, tile: GemmTile, programs_per_sm: int = 1) -> TmaTile:
        return cls(**{**dataclasses.asdict(tile), "programs_per_sm": programs_per_sm})


# --------------------------------------------------------------------------- kernels
@triton.jit
def _linear_act_fwd_tma_kernel(
    h_desc, dact_desc,  # (M, N) act(u) and act'(u) in x's dtype, blocks (BLOCK_M, BLOCK_N // 2)
    x_desc, w_desc,  # (M, K) input, block (BLOCK_M, BLOCK_K); (N, K) weight, block (BLOCK_N, BLOCK_K)
    BIAS,  # (N,) or None
    M, N, K, programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_DACT: tl.constexpr, ACT: tl.constexpr,  # ACT: 0 gelu, 1 gelu_tanh, 2 quick_gelu
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, programs, flatten=True):
        tile_m, tile_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        row0 = tile_m * BLOCK_M
        col0 = tile_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([row0, k0])
            b = w_desc.load([col0, k0])
            acc = tl.dot(a, b.T, acc)
        # epilogues in two column halves: fewer live registers, half-size shared-memory buffers for TMA
        halves = column_halves(acc, BLOCK_M, BLOCK_N)
        _fwd_epilogue_tma(halves[0], h_desc, dact_desc, BIAS, row0, col0, N, HAS_BIAS, STORE_DACT, ACT)
        _fwd_epilogue_tma(halves[1], h_desc, dact_desc, BIAS, row0, col0 + BLOCK_N // 2, N, HAS_BIAS, STORE_DACT,
                          ACT)


@triton.jit
def _fwd_epilogue_tma(acc, h_desc, dact_desc, BIAS, row0, col0, N,
                      HAS_BIAS: tl.constexpr, STORE_DACT: tl.constexpr, ACT: tl.constexpr):
    """+ bias, act and act' of one fp32 accumulator tile at (row0, col0); TMA stores of h (and act'(u))."""
    if HAS_BIAS:
        cols = col0 + tl.arange(0, acc.shape[1])
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    h, dact = act_fwd_bwd(acc, ACT)  # one exp serves both
    h_desc.store([row0, col0], h.to(h_desc.dtype))
    if STORE_DACT:
        dact_desc.store([row0, col0], dact.to(dact_desc.dtype))


@triton.jit
def _linear_act_bwd_tma_kernel(
    du_desc,  # (M, K) grad of u, block (BLOCK_M, BLOCK_N // 2)
    PARTIAL,  # (T, K) fp32 column sums of du per row tile (HAS_BIAS)
    dy_desc, w_desc, dact_desc,  # (M, N) block (BLOCK_M, BLOCK_K); (N, K) fc2 weight, block (BLOCK_K, BLOCK_N);
    # (M, K) act'(u), block (BLOCK_M, BLOCK_N // 2)
    M, N, K, programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile of du (rows x K), step over N
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_k = tl.cdiv(K, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_k, programs, flatten=True):
        tile_m, tile_k = grouped_tile(tile, tiles_m, tiles_k, GROUP_M)
        row0 = tile_m * BLOCK_M
        col0 = tile_k * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_K):  # reduction over the N outputs of fc2, along W's rows
            acc = tl.dot(dy_desc.load([row0, n0]), w_desc.load([n0, col0]), acc)
        halves = column_halves(acc, BLOCK_M, BLOCK_N)
        _bwd_epilogue_tma(halves[0], du_desc, dact_desc, PARTIAL, tile_m, row0, col0, K, HAS_BIAS)
        _bwd_epilogue_tma(halves[1], du_desc, dact_desc, PARTIAL, tile_m, row0, col0 + BLOCK_N // 2, K, HAS_BIAS)


@triton.jit
def _bwd_epilogue_tma(acc, du_desc, dact_desc, PARTIAL, tile_m, row0, col0, K, HAS_BIAS: tl.constexpr):
    """du = acc * act'(u) of one tile at (row0, col0), its TMA store and its column sums. Rows and columns past
    the edge load as zero (dy, w2 and act'(u) alike), so they add nothing to the sums."""
    du = acc * dact_desc.load([row0, col0]).to(tl.float32)
    du_desc.store([row0, col0], du.to(du_desc.dtype))
    if HAS_BIAS:
        cols = col0 + tl.arange(0, acc.shape[1])
        tl.store(PARTIAL + tile_m * K + cols, tl.sum(du, axis=0), mask=cols < K)


# --------------------------------------------------------------------------- launchers
def tma_compatible(*tensors: torch.Tensor) -> bool:
    """What these kernels take: fp16/bf16 2-D operands on TMA's rules (16-byte aligned base, 16-byte multiple
    row stride, unit column stride) whose rows do not overlap (no stride-0 broadcast rows)."""
    return all(t.dtype in (torch.float16, torch.bfloat16) and t.data_ptr() % 16 == 0 and t.stride(1) == 1
               and t.stride(0) >= t.shape[1] and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def persistent_programs(device: torch.device, tiles: int, per_sm: int) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM of the device, never more than the tiles."""
    fill = programs_to_fill(device, per_sm) if device.type == "cuda" else INTERPRETED_PROGRAMS
    return max(1, min(fill, tiles))


def launch_fwd(h: torch.Tensor, dact: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor], activation: str, store_dact: bool, tile: TmaTile) -> None:
    """The forward kernel; arguments as ``linear_act.launch_fwd``'s, every operand tma_compatible."""
    m, k = x.shape
    n = weight.shape[0]
    half = [tile.block_m, tile.block_n // 2]
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    programs = persistent_programs(x.device, tiles, tile.programs_per_sm)
    h_desc = TensorDescriptor.from_tensor(h, half)
    launcher(_linear_act_fwd_tma_kernel, (programs,))(
        h_desc, TensorDescriptor.from_tensor(dact, half) if store_dact else h_desc,  # h_desc: never written as dact
        TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k]),
        TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]), bias, m, n, k, programs,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
        HAS_BIAS=bias is not None, STORE_DACT=store_dact, ACT=ACTIVATIONS[activation], num_warps=tile.num_warps,
        num_stages=tile.num_stages)


def launch_bwd(du: torch.Tensor, partial: Optional[torch.Tensor], dy: torch.Tensor, weight: torch.Tensor,
               dact: torch.Tensor, tile: TmaTile) -> None:
    """The dgrad kernel, writing du and (with ``partial``, (1, row tiles, K) fp32) its column sums per row tile;
    operands as ``linear_act.launch_bwd``'s, every one tma_compatible."""
    m, k = dact.shape
    n = weight.shape[0]
    tiles = cdiv(m, tile.block_m) * cdiv(k, tile.block_n)
    programs = persistent_programs(dact.device, tiles, tile.programs_per_sm)
    half = [tile.block_m, tile.block_n // 2]
    launcher(_linear_act_bwd_tma_kernel, (programs,))(
        TensorDescriptor.from_tensor(du, half), partial, TensorDescriptor.from_tensor(dy, [tile.block_m, tile.block_k]),
        TensorDescriptor.from_tensor(weight, [tile.block_k, tile.block_n]), TensorDescriptor.from_tensor(dact, half),
        m, n, k, programs, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
        HAS_BIAS=partial is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)


# --------------------------------------------------------------------------- ahead-of-time specs
def tma_aot_specs(width: int, mlp_hidden: int, dtype: torch.dtype, param_dtype: torch.dtype,
                  fwd_tile: GemmTile, bwd_tile: GemmTile, infix: str = "") -> list[AotSpec]:
    """The TMA kernels as linear_act's sm_90+ 16-bit candidates launch them (``linear_act.aot_specs``): fc1
    forward on ``fwd_tile`` for each activation (training and inference) and fc2's dgrad on
    ``bwd_tile`` (C = width, H = mlp_hidden; the bias in ``param_dtype``); ``infix`` marks the entries' names
    (``linear_act_fwd{infix}_tma``)."""
    act, par = TRITON_DTYPE_NAMES[dtype], "*" + TRITON_DTYPE_NAMES[param_dtype]
    c, hid = width, mlp_hidden

    def desc(rows: int, cols: int) -> str:
        return f"tensordesc<{act}[{rows}, {cols}]>"

    def spec(name, fn, tile, constexprs, types, values, note):
        constexprs = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
                          HAS_BIAS=True, **constexprs)
        signature = kernel_signature(fn, types, constexprs)
        return AotSpec(name, fn, signature, constexprs, tile.num_warps, tile.num_stages, True, note,
                       divisible_by_16=divisible_args(signature, values), not_modelled=NOT_MODELLED)

    specs = []
    t = fwd_tile
    half = desc(t.block_m, t.block_n // 2)
    types = dict(h_desc=half, dact_desc=half, x_desc=desc(t.block_m, t.block_k), w_desc=desc(t.block_n, t.block_k),
                 BIAS=par)
    for name, code in ACTIVATIONS.items():
        for store in (True, False):  # training / inference
            specs.append(spec(f"linear_act_fwd{infix}_tma", _linear_act_fwd_tma_kernel, t,
                              dict(ACT=code, STORE_DACT=store), types, dict(N=hid, K=c),
                              f"C={c} H={hid} {name} store_dact={store}"))
    t = bwd_tile
    half = desc(t.block_m, t.block_n // 2)
    types = dict(du_desc=half, dact_desc=half, dy_desc=desc(t.block_m, t.block_k), w_desc=desc(t.block_k, t.block_n),
                 PARTIAL="*fp32")
    specs.append(spec(f"linear_act_bwd{infix}_tma", _linear_act_bwd_tma_kernel, t, {}, types, dict(N=c, K=hid),
                      f"C={c} H={hid}"))
    return specs
