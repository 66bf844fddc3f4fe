"""SwiGLU gate (DINOv2 giant's MLP, timm ``SwiGLUPacked`` / ``SwiGLU``): ``y = SiLU(a) * b``, forward and backward.

Math, elementwise over (M, F) rows, ``s = sigmoid(a)``:
  forward   ``y = a * s * b``
  backward  ``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * a * s``.
The sigmoid is evaluated once per element per pass (forward: once; backward: once, recomputed from the
saved pre-activations; neither SiLU(a) nor its derivative is ever written to memory).

Layout: ``a`` (the gate) and ``b`` (the value) are (..., F) tensors with contiguous columns and any row
stride, so both halves of timm's packed fc1 output h (..., 2F) are read in place as strided views
(``SwiGLUPacked``: gate first, ``h[..., :F]``; ``gate_last=True``: gate second); ``swiglu_packed(h)`` is the
one-tensor form, whose backward writes the packed gradient (..., 2F) in one buffer for fc1's GEMM. The GEMMs
(fc1 with its bias in cuBLAS's epilogue, fc2) stay in torch. No parameters: no reductions, no partial sums,
nothing that depends on launch order (deterministic).

Dtypes: fp32 / fp16 / bf16, a and b of one dtype; math in fp32, outputs cast on store in the input dtype.
Traffic per output element (s = bytes of the dtype): forward read a, b, write y = 3s; backward read dy, a, b,
write da, db = 5s; one launch each. Eager PyTorch: silu (2s) + mul (3s) forward, about 9s backward.
Limits: any F >= 1 (masked tiles), any number of rows (0 included); offsets in int64.
Compiled ahead of time for sm_80 / sm_90 (bf16, F = 4096: 8x256 tiles, 8 warps): 38-48 registers, no spills
(not yet listed in ``vit-fast report``'s aot_specs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rows import RowTile
from ._tuning import KernelLaunch, LaunchPlans
from ._utils import cdiv, check_float, check_kernel_device, first_order_only, kernel_op, next_power_of_2, run_op


@triton.jit
def _gate_and_value(A, B, stride_am, stride_bm, M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's (BLOCK_M, BLOCK_F) tile: rows, columns, mask, and gate and value in fp32."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    a = tl.load(A + rows[:, None] * stride_am + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows[:, None] * stride_bm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return rows, cols, mask, a, b


@triton.jit
def _swiglu_fwd_kernel(
    Y,  # (M, F) output, contiguous rows of F
    A, B,  # (M, F) gate and value, unit column stride
    stride_am, stride_bm, stride_ym,  # row strides
    M, F,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows, cols, mask, a, b = _gate_and_value(A, B, stride_am, stride_bm, M, F, BLOCK_M, BLOCK_F)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], (a * s * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DA, DB,  # (M, F) gradients of gate and value (may be the two halves of one packed buffer)
    DY, A, B,  # (M, F) incoming gradient, saved gate and value
    stride_dam, stride_dbm, stride_dym, stride_am, stride_bm,
    M, F,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows, cols, mask, a, b = _gate_and_value(A, B, stride_am, stride_bm, M, F, BLOCK_M, BLOCK_F)
    dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    silu = a * s
    da = dy * b * (s + silu * (1.0 - s))
    tl.store(DA + rows[:, None] * stride_dam + cols[None, :], da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + rows[:, None] * stride_dbm + cols[None, :], (dy * silu).to(DB.dtype.element_ty), mask=mask)


def tile_config(f: int) -> RowTile:
    """2048-element tiles at most 256 columns (BLOCK_F) wide, 8 elements per thread (DINOv2-g's F = 4096 is a
    multiple of 256; SigLIP-style odd widths are masked)."""
    block_f = min(256, next_power_of_2(f))
    block_m = max(1, 2048 // block_f)
    return RowTile(block_m, block_f, max(1, block_m * block_f // 256))


def _bound_launch(kernel, m: int, f: int) -> KernelLaunch:
    """``kernel`` on the static tile of an (M, F) problem, its grid and constants bound once (``KernelLaunch``: the
    compiled kernel called directly after the first launch)."""
    tile = tile_config(f)
    return KernelLaunch(kernel, (cdiv(m, tile.block_m), cdiv(f, tile.block_n)), BLOCK_M=tile.block_m,
                        BLOCK_F=tile.block_n, num_warps=tile.num_warps)


# per layout (sizes, row strides, dtype, device): what Triton specializes a launch on
_FWD_LAUNCHES = LaunchPlans(lambda m, f: _bound_launch(_swiglu_fwd_kernel, m, f))
_BWD_LAUNCHES = LaunchPlans(lambda m, f: _bound_launch(_swiglu_bwd_kernel, m, f))


@kernel_op("vit_fast::swiglu_fwd")
def swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b: (M, F) with unit column stride. Returns SiLU(a) * b, (M, F) contiguous in a.dtype."""
    m, f = a.shape
    y = torch.empty((m, f), device=a.device, dtype=a.dtype)
    if m == 0 or f == 0:
        return y
    strides = (a.stride(0), b.stride(0), y.stride(0))
    _FWD_LAUNCHES.get((m, f, strides, a.dtype, a.device), m, f)(y, a, b, *strides, m, f)
    return y


@swiglu_fwd.register_fake
def _(a, b):
    return a.new_empty(a.shape)


@kernel_op("vit_fast::swiglu_bwd")
def swiglu_bwd(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, packed: int) -> torch.Tensor:
    """dy, a, b: (M, F). Returns (M, 2F) = [da | db] (packed=1), [db | da] (packed=2, gate last) or
    (2, M, F) = stack(da, db) (packed=0: separate gate and value tensors)."""
    m, f = a.shape
    if packed:
        grad = torch.empty((m, 2 * f), device=a.device, dtype=a.dtype)
        da, db = (grad[:, :f], grad[:, f:]) if packed == 1 else (grad[:, f:], grad[:, :f])
    else:
        grad = torch.empty((2, m, f), device=a.device, dtype=a.dtype)
        da, db = grad[0], grad[1]
    if m == 0 or f == 0:
        return grad
    strides = (da.stride(0), db.stride(0), dy.stride(0), a.stride(0), b.stride(0))
    _BWD_LAUNCHES.get((m, f, strides, a.dtype, a.device), m, f)(da, db, dy, a, b, *strides, m, f)
    return grad


@swiglu_bwd.register_fake
def _(dy, a, b, packed):
    m, f = a.shape
    return a.new_empty((m, 2 * f) if packed else (2, m, f))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(M, F) view with unit column stride; copies only when the last dim is strided."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


class SwiGLUFunction(torch.autograd.Function):
    """Separate gate and value tensors (timm ``SwiGLU``: fc1_g, fc1_x)."""

    @staticmethod
    def forward(ctx, a, b):
        a2, b2 = _rows(a), _rows(b)
        ctx.save_for_backward(a2, b2)
        ctx.shape = a.shape
        return run_op(swiglu_fwd, a2, b2).view(a.shape)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dy):
        a2, b2 = ctx.saved_tensors
        grad = run_op(swiglu_bwd, _rows(dy), a2, b2, 0)
        return grad[0].view(ctx.shape), grad[1].view(ctx.shape)


class SwiGLUPackedFunction(torch.autograd.Function):
    """One packed tensor h (..., 2F): gate = first half (gate_last=False, timm SwiGLUPacked) or second."""

    @staticmethod
    def forward(ctx, h, gate_last):
        f = h.shape[-1] // 2
        h2 = _rows(h)
        a2, b2 = (h2[:, f:], h2[:, :f]) if gate_last else (h2[:, :f], h2[:, f:])
        ctx.save_for_backward(h2)
        ctx.gate_last, ctx.shape = gate_last, h.shape
        return run_op(swiglu_fwd, a2, b2).view(*h.shape[:-1], f)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dy):
        (h2,) = ctx.saved_tensors
        f = h2.shape[1] // 2
        a2, b2 = (h2[:, f:], h2[:, :f]) if ctx.gate_last else (h2[:, :f], h2[:, f:])
        grad = run_op(swiglu_bwd, _rows(dy), a2, b2, 2 if ctx.gate_last else 1)
        return grad.view(ctx.shape), None


def _check(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check_float(op, name, t)
        if t.dim() < 1 or t.shape[-1] < 1:
            raise ValueError(f"{op}: expected {name} with at least 1 dim (..., F) and F >= 1, got shape "
                             f"{tuple(t.shape)}")
    check_kernel_device(op, *tensors.values())


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SiLU(a) * b for a gate a and a value b of one shape (..., F) and dtype; see the module docstring."""
    _check("swiglu", a=a, b=b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"swiglu: expected gate a and value b of one shape and dtype, got {tuple(a.shape)} "
                         f"{a.dtype} and {tuple(b.shape)} {b.dtype}")
    return SwiGLUFunction.apply(a, b)


def swiglu_packed(h: torch.Tensor, gate_last: bool = False) -> torch.Tensor:
    """SiLU(gate) * value of a packed (..., 2F) tensor split in halves: gate first (timm SwiGLUPacked,
    ``gate_last=False``) or second. Returns (..., F)."""
    _check("swiglu_packed", h=h)
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: expected an even last dim (gate and value halves), got {tuple(h.shape)}")
    return SwiGLUPackedFunction.apply(h, bool(gate_last))


def swiglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference (math in fp32 for half inputs, result in a.dtype)."""
    compute = torch.promote_types(a.dtype, torch.float32)
    return (torch.nn.functional.silu(a.to(compute)) * b.to(compute)).to(a.dtype)


def swiglu_packed_ref(h: torch.Tensor, gate_last: bool = False) -> torch.Tensor:
    x1, x2 = h.chunk(2, dim=-1)
    return swiglu_ref(x2, x1) if gate_last else swiglu_ref(x1, x2)
