"""The short-sequence backwards: one program per (image, head) owns the whole head.

Where the head fits one program's registers (``config.short_held``), ``_attention_short_bwd_kernel`` loads q,
dO, lse and delta_i = rowsum(dO_i * out_i) of every query row once (rows as the forward's key segments,
``ShortConfig.segments``), keeps dQ of the whole head as fp32 accumulators, and steps over the keys BLOCK_N at a
time: per step S = q k^T and dP = dO v^T are computed once for all rows, then

    dV_j = (P * Z / (1 - p))^T dO,   dK_j = s * dS^T q,   dQ += dS k_j,   dS = P * (dP - delta)

with dK_j, dV_j written at the end of the step and dQ after the last one. So every product of the
backward is computed once (the flash backward computes S and dP in both its phases), delta once per row,
nothing is re-read across programs, and no program reads what another writes: no atomics, no second
phase, bitwise repeatable.

Longer heads (up to ``config.SHORT_STREAMED``: 640 tokens at head_dim 64, 320 at 128) run
``_attention_short_bwd_streamed_kernel``: the same tile pairs, each once, with keys outer and the q rows streamed,
dQ summed in an fp32 workspace in a fixed order by the one program that owns the head.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._math import LOG2E
from .._utils import dropout_keep_tile
from .common import _delta, _head, _load, _q_row_tiles, _tile, _tile_mask


@triton.jit
def _row_segment(q_head, o_head, do_head, lse_head, start, q_len, head_dim,
                 stride_qn, stride_qd, stride_on, stride_od, stride_gn, stride_gd,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """q, dO, lse * log2(e) and delta of query rows start .. start + ROWS: rows past q_len load as zeros with
    lse = +inf, so their probabilities, and with them their share of every gradient, are exactly 0."""
    rows = start + tl.arange(0, ROWS)
    row_ok = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    q, do, delta = _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs_d, offs_d < head_dim, stride_qn,
                                stride_qd, stride_on, stride_od, stride_gn, stride_gd, False)
    return q, do, tl.load(lse_head + rows, mask=row_ok, other=float("inf")) * LOG2E, delta


@triton.jit
def _tile_pair(dq, dk, dv, q, do, lse2, delta, k, v, bh, row_start, start_n, col_ok, qk_scale,
               drop_threshold, inv_keep, SEED, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
               INPUT_PRECISION: tl.constexpr):
    """One (row segment x key step) pair: S and dP once, then its share of dQ (returned in full), dK, dV. SEED
    points at the Philox seed drawn on the device (a CUDA graph's replays each see their own); it is loaded where the
    mask is drawn, a cached load, since a seed held in a register across the key loop spills on sm_80."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
    # padded keys (loaded as 0) must get p = 0: exp(0 - lse) can overflow, and inf * 0 would reach dq as NaN
    p = tl.where(col_ok[None, :], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
    if DROPOUT:
        seed = tl.load(SEED, volatile=True).to(tl.int32)  # volatile: not hoisted out of the key loop
        keep = dropout_keep_tile(seed, bh, row_start + tl.arange(0, ROWS), start_n, drop_threshold, BLOCK_N)
        dv += tl.dot(tl.trans(tl.where(keep, p * inv_keep, 0.0).to(do.dtype)), do, input_precision=INPUT_PRECISION)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    else:
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=INPUT_PRECISION)
    ds = (p * (dp - delta[:, None])).to(q.dtype)
    dq += tl.dot(ds, k, input_precision=INPUT_PRECISION)
    dk += tl.dot(tl.trans(ds), q, input_precision=INPUT_PRECISION)
    return dq, dk, dv


@triton.jit
def _store_rows(X, x, start, n_rows, offs_d, d_ok, stride_n, stride_d, ROWS: tl.constexpr):
    rows = start + tl.arange(0, ROWS)
    tl.store(X + _tile(rows, offs_d, stride_n, stride_d, False), x.to(X.dtype.element_ty),
             mask=_tile_mask(rows < n_rows, d_ok, False))


@triton.jit
def _store_key_block(dk_head, dv_head, dk, dv, start_n, seq_len, scale, offs_d, d_ok, stride_n, stride_d,
                     BLOCK_N: tl.constexpr):
    """Writes one key block's dK (scaled) and dV."""
    _store_rows(dk_head, dk * scale, start_n, seq_len, offs_d, d_ok, stride_n, stride_d, BLOCK_N)
    _store_rows(dv_head, dv, start_n, seq_len, offs_d, d_ok, stride_n, stride_d, BLOCK_N)


@triton.jit
def _attention_short_bwd_kernel(
    DQ, DK, DV,  # outputs: (B, H, N, D) through the gradient strides (views of one dqkv buffer)
    Q, K, V, O, DO,  # inputs through strides
    Lse,  # (B * H, q_len) fp32
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,  # out
    stride_gb, stride_gh, stride_gn, stride_gd,  # dO
    stride_db, stride_dh, stride_dn, stride_dd,  # dQ, dK and dV (same layout)
    num_heads, seq_len, head_dim: tl.constexpr,
    q_len,  # query rows of out, dO and lse: the other q rows get zero gradient
    scale, drop_threshold, inv_keep, SEED,
    ROWS0: tl.constexpr,  # query-row segments: powers of two, ROWS0 + ROWS1 + ROWS2 >= N (ROWS1, ROWS2 may be 0)
    ROWS1: tl.constexpr,
    ROWS2: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HEAD_ALIGN: tl.constexpr = 1,
):
    bh = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_head = _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN)
    k_head = _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN)
    v_head = _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN)
    o_head = _head(O, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN)
    do_head = _head(DO, bh, num_heads, stride_gb, stride_gh, HEAD_ALIGN)
    lse_head = Lse + bh.to(tl.int64) * q_len

    q0, do0, lse0, delta0 = _row_segment(q_head, o_head, do_head, lse_head, 0, q_len, head_dim, stride_qn, stride_qd,
                                         stride_on, stride_od, stride_gn, stride_gd, ROWS0, BLOCK_D)
    dq0 = tl.zeros([ROWS0, BLOCK_D], tl.float32)
    q1, do1, lse1, delta1, dq1 = q0, do0, lse0, delta0, dq0  # placeholders where a segment is absent
    q2, do2, lse2, delta2, dq2 = q0, do0, lse0, delta0, dq0
    if ROWS1:
        q1, do1, lse1, delta1 = _row_segment(q_head, o_head, do_head, lse_head, ROWS0, q_len, head_dim, stride_qn,
                                             stride_qd, stride_on, stride_od, stride_gn, stride_gd, ROWS1, BLOCK_D)
        dq1 = tl.zeros([ROWS1, BLOCK_D], tl.float32)
    if ROWS2:
        q2, do2, lse2, delta2 = _row_segment(q_head, o_head, do_head, lse_head, ROWS0 + ROWS1, q_len, head_dim,
                                             stride_qn, stride_qd, stride_on, stride_od, stride_gn, stride_gd, ROWS2,
                                             BLOCK_D)
        dq2 = tl.zeros([ROWS2, BLOCK_D], tl.float32)

    qk_scale = scale * LOG2E
    dk_head = _head(DK, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    dv_head = _head(DV, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    for start_n in range(0, seq_len, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        k = _load(k_head, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, False)
        v = _load(v_head, cols, col_ok, offs_d, d_ok, stride_vn, stride_vd, False)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dq0, dk, dv = _tile_pair(dq0, dk, dv, q0, do0, lse0, delta0, k, v, bh, 0, start_n, col_ok, qk_scale,
                                 drop_threshold, inv_keep, SEED, ROWS0, BLOCK_N, DROPOUT, INPUT_PRECISION)
        if ROWS1:
            dq1, dk, dv = _tile_pair(dq1, dk, dv, q1, do1, lse1, delta1, k, v, bh, ROWS0, start_n, col_ok, qk_scale,
                                     drop_threshold, inv_keep, SEED, ROWS1, BLOCK_N, DROPOUT, INPUT_PRECISION)
        if ROWS2:
            dq2, dk, dv = _tile_pair(dq2, dk, dv, q2, do2, lse2, delta2, k, v, bh, ROWS0 + ROWS1, start_n, col_ok,
                                     qk_scale, drop_threshold, inv_keep, SEED, ROWS2, BLOCK_N, DROPOUT,
                                     INPUT_PRECISION)
        _store_key_block(dk_head, dv_head, dk, dv, start_n, seq_len, scale, offs_d, d_ok, stride_dn, stride_dd,
                         BLOCK_N)

    # every q row of the gradient is written, the rows past q_len as the zeros they hold
    dq_head = _head(DQ, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    dq0 = dq0 * scale
    _store_rows(dq_head, dq0, 0, seq_len, offs_d, d_ok, stride_dn, stride_dd, ROWS0)
    if ROWS1:
        dq1 = dq1 * scale
        _store_rows(dq_head, dq1, ROWS0, seq_len, offs_d, d_ok, stride_dn, stride_dd, ROWS1)
    if ROWS2:
        dq2 = dq2 * scale
        _store_rows(dq_head, dq2, ROWS0 + ROWS1, seq_len, offs_d, d_ok, stride_dn, stride_dd, ROWS2)


@triton.jit
def _workspace_rows(acc_head, rows, offs_d, BLOCK_D: tl.constexpr):
    """Pointers to some rows of a head's (q_len, BLOCK_D) fp32 dQ workspace."""
    return acc_head + rows[:, None] * BLOCK_D + offs_d[None, :]


@triton.jit
def _streamed_key_block(q_head, k_head, v_head, do_head, lse_head, delta_head, acc_head, dk_head, dv_head, bh,
                        start_n, seq_len, q_len, offs_d, d_ok, stride_qn, stride_qd, stride_kn, stride_kd, stride_vn,
                        stride_vd, stride_gn, stride_gd, stride_dn, stride_dd, scale, qk_scale, drop_threshold,
                        inv_keep, SEED, BLOCK_M: tl.constexpr, KEYS: tl.constexpr, BLOCK_D: tl.constexpr,
                        DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One key block of the streamed backward: its dK, dV over every q tile, each tile's dQ share added to the
    workspace rows (the first block stores them), then dK, dV written. The barrier
    orders this block's workspace stores before the next block's loads of the same rows by other threads; nothing
    may overlap the blocks (no loop flattening or warp specialisation across them)."""
    cols = start_n + tl.arange(0, KEYS)
    col_ok = cols < seq_len
    k = _load(k_head, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, False)
    v = _load(v_head, cols, col_ok, offs_d, d_ok, stride_vn, stride_vd, False)
    dk = tl.zeros([KEYS, BLOCK_D], tl.float32)
    dv = tl.zeros([KEYS, BLOCK_D], tl.float32)
    for start_m in range(0, q_len, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q = _load(q_head, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, False)
        do = _load(do_head, rows, row_ok, offs_d, d_ok, stride_gn, stride_gd, False)
        lse2 = tl.load(lse_head + rows, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(delta_head + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        dq, dk, dv = _tile_pair(dq, dk, dv, q, do, lse2, delta, k, v, bh, start_m, start_n, col_ok, qk_scale,
                                drop_threshold, inv_keep, SEED, BLOCK_M, KEYS, DROPOUT, INPUT_PRECISION)
        acc = _workspace_rows(acc_head, rows, offs_d, BLOCK_D)
        dq += tl.load(acc, mask=row_ok[:, None] & (start_n > 0), other=0.0)
        tl.store(acc, dq, mask=row_ok[:, None])
    tl.debug_barrier()
    _store_key_block(dk_head, dv_head, dk, dv, start_n, seq_len, scale, offs_d, d_ok, stride_dn, stride_dd, KEYS)


@triton.jit
def _attention_short_bwd_streamed_kernel(
    DQ, DK, DV,  # outputs: (B, H, N, D) through the gradient strides (views of one dqkv buffer)
    Q, K, V, O, DO,  # inputs through strides
    Lse,  # (B * H, q_len) fp32
    Delta,  # (B * H, q_len) fp32 workspace: delta of every q row, written here first
    DQAcc,  # (B * H, q_len, BLOCK_D) fp32 workspace: the head's unscaled dQ, read and written by its program only
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,  # out
    stride_gb, stride_gh, stride_gn, stride_gd,  # dO
    stride_db, stride_dh, stride_dn, stride_dd,  # dQ, dK and dV (same layout)
    num_heads, seq_len, head_dim: tl.constexpr,
    q_len,  # query rows of out, dO and lse: the other q rows get zero gradient
    scale, drop_threshold, inv_keep, SEED,
    BLOCK_M: tl.constexpr,  # q rows per inner step
    BLOCK_N: tl.constexpr,  # keys per outer step (their dK, dV held)
    BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HEAD_ALIGN: tl.constexpr = 1,
):
    """The short backward for heads whose dQ does not fit the registers (up to ``SHORT_STREAMED``): one
    program per (image, head) still, keys outer (dK, dV of BLOCK_N keys held), query rows streamed inner, each
    (q tile, key block) pair computed once as in ``_tile_pair``. dQ accumulates in the head's fp32 workspace rows,
    which only this program touches, in a fixed key order: no atomics, bitwise repeatable. The barriers order one
    key block's workspace stores before the next block's loads of the same rows by other threads of the program."""
    bh = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_head = _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN)
    k_head = _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN)
    v_head = _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN)
    o_head = _head(O, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN)
    do_head = _head(DO, bh, num_heads, stride_gb, stride_gh, HEAD_ALIGN)
    lse_head = Lse + bh.to(tl.int64) * q_len
    delta_head = Delta + bh.to(tl.int64) * q_len
    acc_head = DQAcc + bh.to(tl.int64) * q_len * BLOCK_D

    for start_m in range(0, q_len, BLOCK_M):  # delta once per row
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        do = _load(do_head, rows, row_ok, offs_d, d_ok, stride_gn, stride_gd, False)
        o = _load(o_head, rows, row_ok, offs_d, d_ok, stride_on, stride_od, False)
        tl.store(delta_head + rows, _delta(o, do), mask=row_ok)
    tl.debug_barrier()

    qk_scale = scale * LOG2E
    dk_head = _head(DK, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    dv_head = _head(DV, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    # A last block of few keys still streams every q tile: peeling it 16 wide (257 tokens: 2 x 128 + 16 keys) left
    # that loop's SASS ceiling at 21-37% on sm_90 and spilled 16 B in the wide dropout build, so it runs full width.
    for start_n in range(0, seq_len, BLOCK_N):
        _streamed_key_block(
            q_head, k_head, v_head, do_head, lse_head, delta_head, acc_head, dk_head, dv_head, bh, start_n, seq_len,
            q_len, offs_d, d_ok, stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_gn,
            stride_gd, stride_dn, stride_dd, scale, qk_scale, drop_threshold, inv_keep, SEED, BLOCK_M, BLOCK_N,
            BLOCK_D, DROPOUT, INPUT_PRECISION)

    # every q row of the gradient is written, the rows past q_len as zeros
    dq_head = _head(DQ, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    for start_m in range(0, seq_len, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        dq = tl.load(_workspace_rows(acc_head, rows, offs_d, BLOCK_D), mask=(rows < q_len)[:, None], other=0.0) * scale
        _store_rows(dq_head, dq, start_m, seq_len, offs_d, d_ok, stride_dn, stride_dd, BLOCK_M)
