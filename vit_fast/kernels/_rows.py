"""Row views of (..., N) tensors and the fixed-order partial-sum reduction shared by the row-tile
kernels (bias_gelu, bias_dropout_add, add_layer_norm) and the GEMM / attention backwards.

Parameter gradients are reduced in two deterministic stages, never with atomics: each backward
program writes the fp32 column sums of its rows into one row of a (K, G, N) partial buffer, then
``sum_partials`` adds the G rows in a fixed order (bitwise reproducible for a given G).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ._aot import LAUNCH_DEFAULT_STAGES, AotSpec, divisible_args, kernel_signature
from ._tuning import KernelLaunch
from ._utils import cdiv, check_float, check_shape, next_power_of_2, programs_to_fill


@dataclass(frozen=True)
class RowTile:
    """Launch shape of a row-tile kernel (layer_norm, bias_gelu, bias_dropout_add, swiglu): ``block_m`` rows of
    a ``block_n``-column tile on ``num_warps`` warps."""
    block_m: int
    block_n: int
    num_warps: int


# sum_partials' tile: 128 partial rows x 32 columns per loop step. A ViT backward leaves a few hundred partial rows
# (num_partials) of a few thousand columns; narrow column blocks give the launch dozens of programs (ViT-B's
# LayerNorm: 2 x 768 columns, 48 programs instead of 6 at 256 columns) and tall ones few dependent loads per program
# (528 rows: 5 instead of 33 at 16 rows), which is what a latency-bound reduction of ~3 MB needs.
_BLOCK_G = 128
_WARPS = 4


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


def sum_partials_block_n(n: int) -> int:
    """Columns per program of ``sum_partials_kernel`` for width n (one 128-byte line of fp32 per partial row)."""
    return min(32, next_power_of_2(n))


def sum_partials(partial: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(K, G, N) fp32 -> (K, N) column sums over G in a fixed order, in out_dtype. One launch."""
    k, g, n = partial.shape
    return bind_sum_partials(k, g, n, out_dtype, partial.device)(partial)


def bind_sum_partials(k: int, g: int, n: int, out_dtype: torch.dtype,
                      device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``sum_partials`` for (k, g, n) fp32 partials, its grid and constants bound once (a launch plan keeps it)."""
    block_n = sum_partials_block_n(n)
    kernel = KernelLaunch(_sum_partials_kernel, (k, cdiv(n, block_n)), BLOCK_G=_BLOCK_G, BLOCK_N=block_n,
                          num_warps=_WARPS)

    def summed(partial: torch.Tensor) -> torch.Tensor:
        out = torch.empty((k, n), device=device, dtype=out_dtype)
        kernel(out, partial, g, n)
        return out
    return summed


def sum_partials_spec(out_type: str, block_n: int, note: str, width: int | None = None) -> AotSpec:
    """The AOT spec of one ``sum_partials`` launch writing ``out_type`` ('*fp32', '*bf16', ...) with
    ``block_n`` columns per program; ``width`` (the launch's N) is claimed 16-divisible when it is."""
    constexprs = dict(BLOCK_G=_BLOCK_G, BLOCK_N=block_n)
    signature = kernel_signature(_sum_partials_kernel, dict(OUT=out_type, PARTIAL="*fp32"), constexprs)
    values = {} if width is None else dict(N=width)
    return AotSpec("sum_partials", _sum_partials_kernel, signature, constexprs, _WARPS, LAUNCH_DEFAULT_STAGES, False,
                   note, divisible_by_16=divisible_args(signature, values))


def num_partials(row_tiles: int, col_tiles: int, device: torch.device, per_sm: int = 4) -> int:
    """Programs along the rows of a backward launch (= rows of the fp32 partial buffer): enough
    programs over the whole grid to fill the GPU (``programs_to_fill``). Fixed per device and shape,
    so reproducible. Under the interpreter: a few partials, so the multi-program reduction is exercised."""
    target = programs_to_fill(device, per_sm=per_sm) if device.type == "cuda" else 3 * col_tiles
    return max(1, min(row_tiles, cdiv(target, col_tiles)))


def param_grad_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """dtype the partial-sum reduction writes: the parameters' own when they agree, else fp32."""
    return params[0].dtype if params and all(t.dtype == params[0].dtype for t in params) else torch.float32


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(M, N) view with contiguous columns; copies only when the last dim is strided (or stride 0). Rows already
    (M, N) are not reshaped (a reshape costs about a microsecond of host time where it returns a view)."""
    rows = t if t.dim() == 2 and t.shape[1] == n else t.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def check_rows_input(op: str, x: torch.Tensor) -> int:
    """x: a float tensor (..., N) with at least 2 dims and N >= 1; returns N."""
    check_float(op, "x", x)
    if x.dim() < 2 or x.shape[-1] < 1:
        raise ValueError(f"{op}: expected x with at least 2 dims (..., N) and N >= 1, got shape {tuple(x.shape)}")
    return x.shape[-1]


def check_param(op: str, name: str, t: Optional[torch.Tensor], n: int) -> None:
    """A per-column parameter: None, or a float tensor of shape (N,)."""
    if t is not None:
        check_float(op, name, t)
        check_shape(op, name, t, (n,))
