"""The short-sequence forward: each program holds one head's whole K and V (``config.short_held``; longer heads
run the flash forward) and a tile of queries, scores every key in one go and takes a plain softmax: no online
rescaling, no loop.

The keys are held as up to three segments of power-of-two rows (``config.short_segments``: ViT-B/16's 197 tokens
as 128 + 64 + 16 = 208 rows), so the padding is at most 15 rows where one power-of-two tile would pad 197 to 256.
Padded keys get exactly zero probability (-inf scores; only the last segment can hold any). Same math, dropout
bits, lse and output layout as the flash forward (the package docstring), so either backward can run on either
forward's output.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._math import LN2, LOG2E
from .._utils import dropout_keep_tile
from .common import _head, _load, _program_tile, _tile, _tile_mask


@triton.jit
def _segment_scores(q, k_head, start, seq_len, head_dim, stride_kn, stride_kd,
                    KEYS: tl.constexpr, BLOCK_D: tl.constexpr, LAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Raw scores q k^T of keys start .. start + KEYS, -inf past seq_len: only the ``LAST`` segment can reach
    past it (the others end at least 16 rows before N rounded up to 16), so only it is masked."""
    cols = start + tl.arange(0, KEYS)
    col_ok = cols < seq_len if LAST else None
    offs_d = tl.arange(0, BLOCK_D)
    kT = _load(k_head, cols, col_ok, offs_d, offs_d < head_dim, stride_kn, stride_kd, True)
    s = tl.dot(q, kT, input_precision=INPUT_PRECISION)
    if LAST:
        s = tl.where(col_ok[None, :], s, float("-inf"))
    return s


@triton.jit
def _segment_pv(acc, s, m2, qk_scale, v_head, bh, rows, start, seq_len, head_dim, stride_vn, stride_vd,
                drop_threshold, seed, KEYS: tl.constexpr, BLOCK_D: tl.constexpr, LAST: tl.constexpr,
                DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """(acc + P v over keys start .. start + KEYS, the row sums of P before dropout), P = exp2(s * qk_scale - m2)."""
    p = tl.exp2(s * qk_scale - m2[:, None])
    row_sum = tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(dropout_keep_tile(seed, bh, rows, start, drop_threshold, KEYS), p, 0.0)
    cols = start + tl.arange(0, KEYS)
    offs_d = tl.arange(0, BLOCK_D)
    v = _load(v_head, cols, cols < seq_len if LAST else None, offs_d, offs_d < head_dim, stride_vn, stride_vd, False)
    return tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION), row_sum


@triton.jit
def _attention_short_fwd_kernel(
    Out, Lse,  # outputs: (B, H, M, D) through strides; lse (B * H, M) fp32, natural log (M = q_len)
    Q, K, V,  # inputs: (B, H, N, D) through strides (views of the packed qkv)
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    num_heads, seq_len, head_dim: tl.constexpr,
    q_len,  # query rows computed: the first q_len of the N
    scale, drop_threshold, inv_keep, SEED,  # as the flash forward's
    BLOCK_M: tl.constexpr,  # q rows per program
    KEYS0: tl.constexpr,  # key segments: powers of two, KEYS0 + KEYS1 + KEYS2 >= N (KEYS1, KEYS2 may be 0)
    KEYS1: tl.constexpr,
    KEYS2: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (>= 16)
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HEAD_ALIGN: tl.constexpr = 1,
):
    # the Philox seed is read on the device: a CUDA graph's replays each see the seed drawn in them
    if DROPOUT:
        seed = tl.load(SEED).to(tl.int32)  # seeds are < 2**31: one 32-bit register
    else:
        seed = 0
    bh, rows = _program_tile(q_len, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    d_ok = offs_d < head_dim
    q = _load(_head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN), rows, row_ok, offs_d, d_ok,
              stride_qn, stride_qd, False)
    k_head = _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN)
    v_head = _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN)

    # Every score of the row first (segment 0 holds key 0, so the max is finite), then one exp each.
    s0 = _segment_scores(q, k_head, 0, seq_len, head_dim, stride_kn, stride_kd, KEYS0, BLOCK_D, KEYS1 == 0,
                         INPUT_PRECISION)
    m = tl.max(s0, 1)
    s1, s2 = s0, s0  # placeholders where a segment is absent
    if KEYS1:
        s1 = _segment_scores(q, k_head, KEYS0, seq_len, head_dim, stride_kn, stride_kd, KEYS1, BLOCK_D, KEYS2 == 0,
                             INPUT_PRECISION)
        m = tl.maximum(m, tl.max(s1, 1))
    if KEYS2:
        s2 = _segment_scores(q, k_head, KEYS0 + KEYS1, seq_len, head_dim, stride_kn, stride_kd, KEYS2, BLOCK_D, True,
                             INPUT_PRECISION)
        m = tl.maximum(m, tl.max(s2, 1))
    qk_scale = scale * LOG2E  # softmax in base 2, the scale inside the exponent's FFMA (qk_scale > 0)
    m2 = m * qk_scale
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i = _segment_pv(acc, s0, m2, qk_scale, v_head, bh, rows, 0, seq_len, head_dim, stride_vn, stride_vd,
                           drop_threshold, seed, KEYS0, BLOCK_D, KEYS1 == 0, DROPOUT, INPUT_PRECISION)
    if KEYS1:
        acc, l1 = _segment_pv(acc, s1, m2, qk_scale, v_head, bh, rows, KEYS0, seq_len, head_dim, stride_vn,
                              stride_vd, drop_threshold, seed, KEYS1, BLOCK_D, KEYS2 == 0, DROPOUT, INPUT_PRECISION)
        l_i += l1
    if KEYS2:
        acc, l2 = _segment_pv(acc, s2, m2, qk_scale, v_head, bh, rows, KEYS0 + KEYS1, seq_len, head_dim, stride_vn,
                              stride_vd, drop_threshold, seed, KEYS2, BLOCK_D, True, DROPOUT, INPUT_PRECISION)
        l_i += l2
    if DROPOUT:
        acc = acc * inv_keep
    acc = acc / l_i[:, None]
    out_head = _head(Out, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN)
    tl.store(out_head + _tile(rows, offs_d, stride_on, stride_od, False), acc.to(Out.dtype.element_ty),
             mask=_tile_mask(row_ok, d_ok, False))
    tl.store(Lse + bh.to(tl.int64) * q_len + rows, (m2 + tl.log2(l_i)) * LN2, mask=row_ok)
