"""What every attention kernel shares: the limits, the (batch x heads x tiles) program map and the strided
tile loads of one head (jit helpers; no kernel here)."""
from __future__ import annotations

import triton
import triton.language as tl

MAX_HEAD_DIM = 128
# The loops' last, partial step runs 16 wide when at most 16 keys / rows are left: a multiple of 16, as the MMA
# k-step and dropout_keep_tile (one Philox call per 16 columns) need.
LAST_STEP = 16
MAX_GRID = 2**31 - 1


@triton.jit
def _program_tile(seq_len, BLOCK: tl.constexpr):
    """(batch * head index, the program's row indices) of a 1-D grid of B * H * cdiv(N, BLOCK)."""
    num_tiles = tl.cdiv(seq_len, BLOCK)
    pid = tl.program_id(0)
    return pid // num_tiles, (pid % num_tiles) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _head(X, bh, num_heads, stride_b, stride_h, ALIGN: tl.constexpr):
    """Pointer to head (b, h) = divmod(bh, H) of a (B, H, N, D)-strided tensor (int64 offset). ``ALIGN``: the
    launcher's promise that the offset is a multiple of it (the packed layout's head stride is D: 72 = 8 x 9
    elements is 16-byte aligned, which Triton, knowing only multiples of 16, cannot see; without the hint
    every load of a D = 72 head is one element wide)."""
    offset = (bh // num_heads).to(tl.int64) * stride_b + (bh % num_heads).to(tl.int64) * stride_h
    return X + tl.multiple_of(offset, ALIGN)


@triton.jit
def _tile(rows, offs_d, stride_n, stride_d, TRANS: tl.constexpr):
    """Element offsets of a (rows x D) tile of one head, or of its transpose (D x rows)."""
    if TRANS:
        off = rows[None, :].to(tl.int64) * stride_n + offs_d[:, None] * stride_d
    else:
        off = rows[:, None].to(tl.int64) * stride_n + offs_d[None, :] * stride_d
    return off


@triton.jit
def _tile_mask(row_ok, d_ok, TRANS: tl.constexpr):
    """The (rows x D) tile's mask, or its transpose's; ``row_ok`` None: every row is inside N (full tiles)."""
    if row_ok is None:
        mask = d_ok[:, None] if TRANS else d_ok[None, :]
    elif TRANS:
        mask = row_ok[None, :] & d_ok[:, None]
    else:
        mask = row_ok[:, None] & d_ok[None, :]
    return mask


@triton.jit
def _load(X, rows, row_ok, offs_d, d_ok, stride_n, stride_d, TRANS: tl.constexpr):
    """A (rows x D) tile (or its transpose) of one head; zeros outside N and D (masked, no padding)."""
    return tl.load(X + _tile(rows, offs_d, stride_n, stride_d, TRANS), mask=_tile_mask(row_ok, d_ok, TRANS), other=0.0)


@triton.jit
def _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs, ok, stride_qn, stride_qd, stride_on, stride_od,
                 stride_gn, stride_gd, TRANS_Q: tl.constexpr):
    """q (transposed with ``TRANS_Q``) and dO of some q rows and columns, and those columns' share of
    delta_i = rowsum(dO_i * out_i): what every backward loads per q tile."""
    q = _load(q_head, rows, row_ok, offs, ok, stride_qn, stride_qd, TRANS_Q)
    do = _load(do_head, rows, row_ok, offs, ok, stride_gn, stride_gd, False)
    o = _load(o_head, rows, row_ok, offs, ok, stride_on, stride_od, False)
    return q, do, _delta(o, do)


@triton.jit
def _delta(o, do):
    """delta_i = rowsum(dO_i * out_i) of a tile's rows (its columns' share), in fp32."""
    return tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
