"""Position embeddings: timm's resampling to another grid and the fixed 2-D sin-cos table."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def resample_abs_pos_embed(posemb: torch.Tensor, new_size: tuple[int, int], old_size: tuple[int, int] | None = None,
                           num_prefix_tokens: int = 1, interpolation: str = "bicubic",
                           antialias: bool = True) -> torch.Tensor:
    """Resize a (1, prefix + h*w, D) position embedding to a new grid, exactly as timm does it:
    prefix tokens kept, the grid interpolated in float32 (bicubic, antialias), cast back."""
    num_new_tokens = new_size[0] * new_size[1] + num_prefix_tokens
    if num_new_tokens == posemb.shape[1]:
        if old_size is not None and tuple(old_size) == tuple(new_size):
            return posemb
        if old_size is None and new_size[0] == new_size[1]:
            return posemb
    if old_size is None:
        hw = int(math.sqrt(posemb.shape[1] - num_prefix_tokens))
        old_size = hw, hw
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim, dtype = posemb.shape[-1], posemb.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)
    if torch.compiler.is_compiling():
        # torch's antialiased bicubic backward does not trace at symbolic sizes (a dynamic-shape recompile raises
        # "Expected IntList but got GenericList"): the same separable resize as two matrices, whose products
        # trace; equal to it up to float32 rounding
        rows, cols = (_resize_matrix(o, n, interpolation, antialias, grid.device)
                      for o, n in zip(old_size, new_size))
        grid = rows @ grid @ cols.t()
    else:
        grid = F.interpolate(grid, size=tuple(new_size), mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, grid], dim=1) if num_prefix_tokens else grid


def _resize_matrix(old: int, new: int, interpolation: str, antialias: bool, device: torch.device) -> torch.Tensor:
    """(new, old): F.interpolate's resize of one axis as a matrix, its columns the responses to unit impulses
    (two identical columns across, since a one-wide axis would take another path of the kernel)."""
    impulses = torch.eye(old, device=device).reshape(old, 1, old, 1).expand(old, 1, old, 2)
    return F.interpolate(impulses, size=(new, 2), mode=interpolation, antialias=antialias)[..., 0].reshape(old, new).t()


def sincos_2d_pos_embed(grid_size: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding (MAE / DeiT-III style), shape (h*w, dim).

    The first half of the channels encodes the row, the second half the column; each half is
    [sin(pos * w_i), cos(pos * w_i)] with w_i = temperature ** (-i / (dim/4)), i < dim/4.
    """
    if dim % 4:
        raise ValueError(f"sin-cos 2-D position embedding needs embed dim divisible by 4, got {dim}")
    omega = temperature ** -(torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows = torch.arange(grid_size[0], dtype=torch.float64)[:, None].expand(grid_size).reshape(-1)
    cols = torch.arange(grid_size[1], dtype=torch.float64)[None, :].expand(grid_size).reshape(-1)
    parts = []
    for pos in (rows, cols):
        angles = pos[:, None] * omega[None, :]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()
