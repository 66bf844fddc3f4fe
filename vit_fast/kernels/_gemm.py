"""What the Triton GEMM kernels share (linear_act's pointer and TMA kernels, patch_embed's GEMMs): the tile config
type, the grouped order in which programs take output tiles and the column split of an accumulator for its
epilogue."""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

# Row tiles per group of the tile order: GROUP_M row tiles take every column tile before the next group starts, so a
# group's rows and the whole weight stay in L2.
GROUP_M = 8


@dataclass(frozen=True)
class GemmTile:
    block_m: int  # output tile rows
    block_n: int  # output tile columns
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of tile number pid, GROUP_M row tiles at a time sharing column tiles (L2 reuse)."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def column_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left and right (BLOCK_M, BLOCK_N // 2) halves of an accumulator tile: an epilogue run per part holds
    fewer live registers."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
