"""The flash forward (online softmax over k/v tiles, any sequence length), the attention-map kernel and the
dropout-mask test kernel. Math, layout and dropout scheme: the package docstring."""
from __future__ import annotations

import triton
import triton.language as tl

from .._math import LN2, LOG2E
from .._utils import dropout_keep_tile
from .common import _head, _load, _program_tile, _tile, _tile_mask


@triton.jit
def _fwd_step(acc, acc_t, m_i, l_i, q, q_t, k_head, v_head, bh, rows, start_n, seq_len, head_dim,
              stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, drop_threshold, seed,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D_TAIL: tl.constexpr, MASK_KEYS: tl.constexpr,
              DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One k/v tile (keys start_n.. start_n + BLOCK_N) of the forward's online softmax; returns the updated
    (acc, acc_t, m_i, l_i). Only the last tile (``MASK_KEYS``) can run past seq_len: full tiles load and
    score without a key mask. The scale is applied inside the exponent's FFMA, s * qk_scale - m: the row
    max is taken on the raw scores (qk_scale > 0 commutes with max)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    col_ok = cols < seq_len if MASK_KEYS else None
    kT = _load(k_head, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, True)
    s = tl.dot(q, kT, input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < head_dim
        kT_t = _load(k_head, cols, col_ok, offs_t, t_ok, stride_kn, stride_kd, True)
        s = tl.dot(q_t, kT_t, s, input_precision=INPUT_PRECISION)
    if MASK_KEYS:
        s = tl.where(col_ok[None, :], s, float("-inf"))  # padded keys: exactly zero probability
    # The first tile always holds key 0, so m_new is finite from the first step on.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(dropout_keep_tile(seed, bh, rows, start_n, drop_threshold, BLOCK_N), p, 0.0)
    v = _load(v_head, cols, col_ok, offs_d, d_ok, stride_vn, stride_vd, False)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        v_t = _load(v_head, cols, col_ok, offs_t, t_ok, stride_vn, stride_vd, False)
        acc_t = acc_t * alpha[:, None] + tl.dot(p.to(v_t.dtype), v_t, input_precision=INPUT_PRECISION)
    return acc, acc_t, m_new, l_i


@triton.jit
def _attention_fwd_kernel(
    Out, Lse,  # outputs: (B, H, M, D) through strides; lse (B * H, M) fp32, natural log (M = q_len)
    Q, K, V,  # inputs: (B, H, N, D) through strides (views of the packed qkv); q's first M rows are read
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    num_heads, seq_len, head_dim: tl.constexpr,  # a constant: the d masks fold, loads vectorise at D = 72
    q_len,  # query rows computed: the first q_len of the N (all N but for the last block under class pooling)
    scale,  # softmax scale
    drop_threshold, inv_keep, SEED,  # dropout: 8-bit threshold t, 256 / (256 - t) (0 when t == 256), -> Philox seed
    BLOCK_M: tl.constexpr,  # q rows per program
    BLOCK_N: tl.constexpr,  # k/v rows per loop step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (>= 16), or its main part (see BLOCK_D_TAIL)
    DROPOUT: tl.constexpr,  # False skips the Philox draw entirely
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 dots; ignored for fp16/bf16
    BLOCK_D_TAIL: tl.constexpr = 0,  # 16: columns BLOCK_D.. BLOCK_D + 16 as a second part (D = 72: 64 + 16)
    TAIL_N: tl.constexpr = 16,  # keys left after the full tiles, if at most this many, run as one TAIL_N-wide step
    HEAD_ALIGN: tl.constexpr = 1,  # every head's offset is a multiple of this many elements (_head_align)
    PEEL: tl.constexpr = True,  # full tiles unmasked, then the last one (Tile.peel); False: every tile masked
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
    q_head = _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN)
    q = _load(q_head, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, False)
    k_head = _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN)
    v_head = _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN)

    qk_scale = scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_t, acc_t = q, 0.0  # the head_dim tail's q and accumulator (BLOCK_D_TAIL), unused placeholders without it
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < head_dim
        q_t = _load(q_head, rows, row_ok, offs_t, t_ok, stride_qn, stride_qd, False)
        acc_t = tl.zeros([BLOCK_M, BLOCK_D_TAIL], tl.float32)
    # Full k/v tiles without a key mask, then the rest as one masked step: TAIL_N wide when it fits (197 tokens
    # = 3 x 64 + 5 run 208 keys, not 256), else one more BLOCK_N-wide tile.
    if PEEL:
        full_end = seq_len - seq_len % BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            acc, acc_t, m_i, l_i = _fwd_step(acc, acc_t, m_i, l_i, q, q_t, k_head, v_head, bh, rows, start_n, seq_len,
                                             head_dim, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                             drop_threshold, seed, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, False, DROPOUT,
                                             INPUT_PRECISION)
        rest = seq_len - full_end  # < BLOCK_N
        if rest > TAIL_N:
            acc, acc_t, m_i, l_i = _fwd_step(acc, acc_t, m_i, l_i, q, q_t, k_head, v_head, bh, rows, full_end, seq_len,
                                             head_dim, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                             drop_threshold, seed, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT,
                                             INPUT_PRECISION)
        elif rest > 0:
            acc, acc_t, m_i, l_i = _fwd_step(acc, acc_t, m_i, l_i, q, q_t, k_head, v_head, bh, rows, full_end, seq_len,
                                             head_dim, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                             drop_threshold, seed, TAIL_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT,
                                             INPUT_PRECISION)
    else:  # every tile through the masked step (Tile.peel)
        for start_n in range(0, seq_len, BLOCK_N):
            acc, acc_t, m_i, l_i = _fwd_step(acc, acc_t, m_i, l_i, q, q_t, k_head, v_head, bh, rows, start_n, seq_len,
                                             head_dim, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                             drop_threshold, seed, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT,
                                             INPUT_PRECISION)

    if DROPOUT:
        acc = acc * inv_keep
    acc = acc / l_i[:, None]
    out_head = _head(Out, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN)
    tl.store(out_head + _tile(rows, offs_d, stride_on, stride_od, False),
             acc.to(Out.dtype.element_ty), mask=_tile_mask(row_ok, d_ok, False))
    if BLOCK_D_TAIL:
        if DROPOUT:
            acc_t = acc_t * inv_keep
        acc_t = acc_t / l_i[:, None]
        tl.store(out_head + _tile(rows, offs_t, stride_on, stride_od, False),
                 acc_t.to(Out.dtype.element_ty), mask=_tile_mask(row_ok, t_ok, False))
    lse = (m_i + tl.log2(l_i)) * LN2  # back to natural log
    tl.store(Lse + bh.to(tl.int64) * q_len + rows, lse, mask=row_ok)


@triton.jit
def _attention_probs_kernel(
    P,  # output: (B * H, R, N) fp32 probabilities of the selected query rows
    Q, K, Lse, Rows,  # q, k through strides; lse (B * H, N); Rows (R,) int64 query indices
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    num_heads, seq_len, head_dim: tl.constexpr, num_rows,
    scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HEAD_ALIGN: tl.constexpr = 1,
):
    bh, r = _program_tile(num_rows, BLOCK_M)
    r_ok = r < num_rows
    rows = tl.load(Rows + r, mask=r_ok, other=0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_head = _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN)
    q = _load(q_head, rows, r_ok, offs_d, d_ok, stride_qn, stride_qd, False)
    lse2 = tl.load(Lse + bh.to(tl.int64) * seq_len + rows, mask=r_ok, other=float("inf")) * LOG2E
    k_head = _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN)
    p_rows = P + (bh.to(tl.int64) * num_rows + r[:, None]) * seq_len
    for start_n in range(0, seq_len, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < seq_len
        kT = _load(k_head, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, True)
        p = tl.exp2(tl.dot(q, kT, input_precision=INPUT_PRECISION) * (scale * LOG2E) - lse2[:, None])
        tl.store(p_rows + cols[None, :], p, mask=r_ok[:, None] & col_ok[None, :])


@triton.jit
def _attention_dropout_mask_kernel(Keep, seq_len, drop_threshold, SEED, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Test helper: materialise the keep mask (B * H, N, N) exactly as the kernels draw it (program (tile, bh)
    writes BLOCK_M query rows of head bh, BLOCK_N keys at a time)."""
    seed = tl.load(SEED).to(tl.int32)  # drawn on the device (kernels/_utils.next_seed)
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    keep_rows = Keep + (bh.to(tl.int64) * seq_len + rows[:, None]) * seq_len
    for start_n in range(0, seq_len, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep_tile(seed, bh, rows, start_n, drop_threshold, BLOCK_N)
        tl.store(keep_rows + cols[None, :], keep.to(tl.int8), mask=row_ok[:, None] & (cols < seq_len)[None, :])
