"""The flash backward: one launch, each program writing dK, dV of its k/v rows (looping over q tiles), then dQ
of the same q rows (looping over k/v tiles). S and dP are computed in both phases; delta per q tile. Math:
the package docstring.

The stored-dS backward (``StoredDsConfig``, an autotuning candidate at ViT lengths): the dK/dV phase alone, also
writing dS (rounded to the inputs' dtype, as the dK dot reads it) to a (B * H, q_len, N) workspace, then dQ =
scale * dS K from the workspace in a second launch, one dot per key step: S, dP and the exponential once per tile
pair instead of twice, for 2 * B * H * q_len * N' * e more bytes (N' = N rounded up to 16, so rows start aligned
and move in vectors; ViT-B/16 b256 bf16: 252 MB written and read per block, about 0.12 ms at the H200's 4.2 TB/s;
what the recompute costs is for a GPU to measure)."""
from __future__ import annotations

import triton
import triton.language as tl

from .._math import LOG2E
from .._utils import dropout_keep_tile
from .common import _head, _load, _q_row_tiles, _tile, _tile_mask


@triton.jit
def _dkdv_step(
    dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head, ds_head, bh, tile, start_m,
    stride_qn, stride_qd, stride_on, stride_od, stride_gn, stride_gd, stride_sm,
    seq_len, q_len, head_dim, qk_scale, drop_threshold, inv_keep, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D_TAIL: tl.constexpr,
    MASK_ROWS: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, STORE_DS: tl.constexpr,
):
    """One q tile (rows start_m.. start_m + BLOCK_M) of phase 1; returns the updated (dk, dv, dk_t, dv_t).
    Only the last tile (``MASK_ROWS``) can run past q_len. delta_i = rowsum(dO_i * out_i) is recomputed
    here from out and dO (no pre-pass). ``STORE_DS``: dS of the tile, rounded to the inputs' dtype as the dK dot
    reads it, is also written to the head's (q rows x keys) workspace ``ds_head`` (row stride ``stride_sm``)."""
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    row_ok = rows < q_len if MASK_ROWS else None
    qT, do, delta = _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd,
                                 stride_on, stride_od, stride_gn, stride_gd, True)
    if MASK_ROWS:  # padded q rows get lse = +inf, hence probability exactly 0
        lse2 = tl.load(lse_head + rows, mask=row_ok, other=float("inf")) * LOG2E
    else:
        lse2 = tl.load(lse_head + rows) * LOG2E
    sT = tl.dot(k, qT, input_precision=INPUT_PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # (dO v^T)^T
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < head_dim
        qT_t, do_t, delta_t = _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs_t, t_ok, stride_qn,
                                           stride_qd, stride_on, stride_od, stride_gn, stride_gd, True)
        delta += delta_t
        sT = tl.dot(k_t, qT_t, sT, input_precision=INPUT_PRECISION)
        dpT = tl.dot(v_t, tl.trans(do_t), dpT, input_precision=INPUT_PRECISION)
    pT = tl.exp2(sT * qk_scale - lse2[None, :])
    if DROPOUT:
        # drawn as the (q rows x k/v rows) tile the forward and dQ draw, then transposed: the same bits
        # SEED: the Philox seed drawn on the device (each CUDA-graph replay sees its own), loaded where the mask is
        # drawn (volatile: not held in a register across the loop, which spills the D = 72 build on sm_90)
        seed = tl.load(SEED, volatile=True).to(tl.int32)
        keep = tl.trans(dropout_keep_tile(seed, bh, rows, tile * BLOCK_N, drop_threshold, BLOCK_N))
        pT_drop = tl.where(keep, pT * inv_keep, 0.0).to(do.dtype)
        dv += tl.dot(pT_drop, do, input_precision=INPUT_PRECISION)
        if BLOCK_D_TAIL:
            dv_t += tl.dot(pT_drop, do_t, input_precision=INPUT_PRECISION)
        dpT = tl.where(keep, dpT * inv_keep, 0.0)
    else:
        dv += tl.dot(pT.to(do.dtype), do, input_precision=INPUT_PRECISION)
        if BLOCK_D_TAIL:
            dv_t += tl.dot(pT.to(do_t.dtype), do_t, input_precision=INPUT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    if STORE_DS:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ds_mask = cols[:, None] < seq_len
        if MASK_ROWS:
            ds_mask = ds_mask & row_ok[None, :]
        tl.store(ds_head + rows[None, :].to(tl.int64) * stride_sm + cols[:, None], dsT.to(ds_head.dtype.element_ty),
                 mask=ds_mask)
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        dk_t += tl.dot(dsT.to(qT_t.dtype), tl.trans(qT_t), input_precision=INPUT_PRECISION)
    return dk, dv, dk_t, dv_t


@triton.jit
def _bwd_dkdv(
    dk_head, dv_head, q_head, k_head, v_head, o_head, do_head, Lse, ds_head, bh, tile,
    stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
    stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd, stride_sm,
    seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_D_TAIL: tl.constexpr, TAIL_M: tl.constexpr, PEEL: tl.constexpr, STORE_DS: tl.constexpr = False,
):
    """Phase 1 of the backward: dK, dV of k/v tile ``tile`` (BLOCK_N rows), looping over q tiles: full ones
    without a row mask, then the rest as one masked step, TAIL_M rows wide when it fits (as the forward's keys).
    ``*_head`` point at head (b, h) of each tensor; the strides are its row and column strides.
    With BLOCK_D_TAIL every (rows x D) tile is two: columns 0..BLOCK_D and the tail (``_t``). ``STORE_DS``: every
    step also writes its dS to the head's (q rows x keys) workspace ``ds_head``, rows ``stride_sm`` apart."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = cols < seq_len
    d_ok = offs_d < head_dim
    k = _load(k_head, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, False)
    v = _load(v_head, cols, col_ok, offs_d, d_ok, stride_vn, stride_vd, False)
    lse_head = Lse + bh.to(tl.int64) * q_len

    qk_scale = scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    k_t, v_t, dk_t, dv_t = k, v, 0.0, 0.0  # the head_dim tail's tiles (BLOCK_D_TAIL), placeholders without it
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < head_dim
        k_t = _load(k_head, cols, col_ok, offs_t, t_ok, stride_kn, stride_kd, False)
        v_t = _load(v_head, cols, col_ok, offs_t, t_ok, stride_vn, stride_vd, False)
        dk_t = tl.zeros([BLOCK_N, BLOCK_D_TAIL], tl.float32)
        dv_t = tl.zeros([BLOCK_N, BLOCK_D_TAIL], tl.float32)
    if PEEL:
        full_end = q_len - q_len % BLOCK_M  # over the q_len query rows: the others have zero gradient
        for start_m in range(0, full_end, BLOCK_M):
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head,
                                            ds_head, bh, tile, start_m, stride_qn, stride_qd, stride_on,
                                            stride_od, stride_gn, stride_gd, stride_sm, seq_len, q_len, head_dim,
                                            qk_scale, drop_threshold, inv_keep, SEED, BLOCK_M, BLOCK_N, BLOCK_D,
                                            BLOCK_D_TAIL, False, DROPOUT, INPUT_PRECISION, STORE_DS)
        rest = q_len - full_end  # < BLOCK_M
        if rest > TAIL_M:
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head,
                                            ds_head, bh, tile, full_end, stride_qn, stride_qd, stride_on,
                                            stride_od, stride_gn, stride_gd, stride_sm, seq_len, q_len, head_dim,
                                            qk_scale, drop_threshold, inv_keep, SEED, BLOCK_M, BLOCK_N, BLOCK_D,
                                            BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION, STORE_DS)
        elif rest > 0:
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head,
                                            ds_head, bh, tile, full_end, stride_qn, stride_qd, stride_on,
                                            stride_od, stride_gn, stride_gd, stride_sm, seq_len, q_len, head_dim,
                                            qk_scale, drop_threshold, inv_keep, SEED, TAIL_M, BLOCK_N, BLOCK_D,
                                            BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION, STORE_DS)
    else:  # every q tile through the masked step (Tile.peel)
        for start_m in range(0, q_len, BLOCK_M):
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head,
                                            ds_head, bh, tile, start_m, stride_qn, stride_qd, stride_on,
                                            stride_od, stride_gn, stride_gd, stride_sm, seq_len, q_len, head_dim,
                                            qk_scale, drop_threshold, inv_keep, SEED, BLOCK_M, BLOCK_N, BLOCK_D,
                                            BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION, STORE_DS)

    offsets = _tile(cols, offs_d, stride_dn, stride_dd, False)
    mask = _tile_mask(col_ok, d_ok, False)
    dk = dk * scale
    tl.store(dk_head + offsets, dk.to(dk_head.dtype.element_ty), mask=mask)
    tl.store(dv_head + offsets, dv.to(dv_head.dtype.element_ty), mask=mask)
    if BLOCK_D_TAIL:
        offsets_t = _tile(cols, offs_t, stride_dn, stride_dd, False)
        mask_t = _tile_mask(col_ok, t_ok, False)
        dk_t = dk_t * scale
        tl.store(dk_head + offsets_t, dk_t.to(dk_head.dtype.element_ty), mask=mask_t)
        tl.store(dv_head + offsets_t, dv_t.to(dv_head.dtype.element_ty), mask=mask_t)


@triton.jit
def _dkdv_of_head(
    DK, DV, Q, K, V, O, DO, Lse, ds_head, bh, tile,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
    stride_gb, stride_gh, stride_gn, stride_gd, stride_db, stride_dh, stride_dn, stride_dd, stride_sm,
    num_heads, seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_D_TAIL: tl.constexpr, TAIL_M: tl.constexpr, PEEL: tl.constexpr,
    HEAD_ALIGN: tl.constexpr, STORE_DS: tl.constexpr,
):
    """``_bwd_dkdv`` of head ``bh`` = b * H + h, its tensors' pointers offset to that head here (both backward
    kernels run it)."""
    _bwd_dkdv(_head(DK, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN),
              _head(DV, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN),
              _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN),
              _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN),
              _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN),
              _head(O, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN),
              _head(DO, bh, num_heads, stride_gb, stride_gh, HEAD_ALIGN), Lse, ds_head, bh, tile,
              stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
              stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd, stride_sm,
              seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
              BLOCK_M, BLOCK_N, BLOCK_D, DROPOUT, INPUT_PRECISION, BLOCK_D_TAIL, TAIL_M, PEEL, STORE_DS)


@triton.jit
def _dq_step(
    dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, start_n,
    stride_kn, stride_kd, stride_vn, stride_vd,
    seq_len, head_dim, qk_scale, drop_threshold, inv_keep, SEED,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D_TAIL: tl.constexpr,
    MASK_KEYS: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One k/v tile (keys start_n.. start_n + BLOCK_N) of phase 2; returns the updated (dq, dq_t). Only the
    last tile (``MASK_KEYS``) can run past seq_len."""
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    col_ok = cols < seq_len if MASK_KEYS else None
    kT = _load(k_head, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, True)
    vT = _load(v_head, cols, col_ok, offs_d, d_ok, stride_vn, stride_vd, True)
    s = tl.dot(q, kT, input_precision=INPUT_PRECISION)
    dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < head_dim
        kT_t = _load(k_head, cols, col_ok, offs_t, t_ok, stride_kn, stride_kd, True)
        vT_t = _load(v_head, cols, col_ok, offs_t, t_ok, stride_vn, stride_vd, True)
        s = tl.dot(q_t, kT_t, s, input_precision=INPUT_PRECISION)
        dp = tl.dot(do_t, vT_t, dp, input_precision=INPUT_PRECISION)
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASK_KEYS:
        # Padded keys (k loaded as 0) must get p = 0: exp(0 - lse) overflows when every real score of
        # the row is very negative, and inf * 0 in ds @ k would put NaN into real rows of dq.
        p = tl.where(col_ok[None, :], p, 0.0)
    if DROPOUT:
        seed = tl.load(SEED, volatile=True).to(tl.int32)  # as in _dkdv_step
        dp = tl.where(dropout_keep_tile(seed, bh, rows, start_n, drop_threshold, BLOCK_N), dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        dq_t += tl.dot(ds.to(kT_t.dtype), tl.trans(kT_t), input_precision=INPUT_PRECISION)
    return dq, dq_t


@triton.jit
def _bwd_dq(
    dq_head, q_head, k_head, v_head, o_head, do_head, Lse, bh, tile,
    stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
    stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd,
    seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_D_TAIL: tl.constexpr, TAIL_N: tl.constexpr, PEEL: tl.constexpr,
):
    """Phase 2 of the backward: dQ of q tile ``tile`` (BLOCK_M rows), looping over k/v tiles as the forward
    does (full tiles unmasked, then one masked step, TAIL_N wide when it fits; with BLOCK_D_TAIL, each
    (rows x D) tile as its main part and its tail ``_t``, as in ``_bwd_dkdv``)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len  # rows q_len.. N: q, dO, out load as 0 and lse as +inf, so their dq is exactly 0
    d_ok = offs_d < head_dim
    q, do, delta = _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd,
                                stride_on, stride_od, stride_gn, stride_gd, False)
    q_t, do_t, dq_t = q, do, 0.0  # the head_dim tail's tiles (BLOCK_D_TAIL), placeholders without it
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < head_dim
        q_t, do_t, delta_t = _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs_t, t_ok, stride_qn, stride_qd,
                                          stride_on, stride_od, stride_gn, stride_gd, False)
        delta += delta_t
        dq_t = tl.zeros([BLOCK_M, BLOCK_D_TAIL], tl.float32)
    lse2 = tl.load(Lse + bh.to(tl.int64) * q_len + rows, mask=row_ok, other=float("inf")) * LOG2E

    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    keys = tl.where(tile * BLOCK_M < q_len, seq_len, 0)  # a tile past q_len skips the loop: its dq is 0
    if PEEL:
        full_end = keys - keys % BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, start_n,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, SEED, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, False, DROPOUT, INPUT_PRECISION)
        rest = keys - full_end  # < BLOCK_N
        if rest > TAIL_N:
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, full_end,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, SEED, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)
        elif rest > 0:
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, full_end,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, SEED, TAIL_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)
    else:  # every k/v tile through the masked step (Tile.peel)
        for start_n in range(0, keys, BLOCK_N):
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, start_n,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, SEED, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)

    dq = dq * scale
    store_ok = rows < seq_len  # every q row of the gradient is written, the rows past q_len as zeros
    tl.store(dq_head + _tile(rows, offs_d, stride_dn, stride_dd, False), dq.to(dq_head.dtype.element_ty),
             mask=_tile_mask(store_ok, d_ok, False))
    if BLOCK_D_TAIL:
        dq_t = dq_t * scale
        tl.store(dq_head + _tile(rows, offs_t, stride_dn, stride_dd, False), dq_t.to(dq_head.dtype.element_ty),
                 mask=_tile_mask(store_ok, t_ok, False))


@triton.jit
def _attention_bwd_kernel(
    DQ, DK, DV,  # outputs: (B, H, N, D) through the gradient strides (views of one dqkv buffer)
    Q, K, V, O, DO,  # inputs through strides; dO may be non-contiguous
    Lse,  # (B * H, q_len) fp32
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,  # out
    stride_gb, stride_gh, stride_gn, stride_gd,  # dO
    stride_db, stride_dh, stride_dn, stride_dd,  # dQ, dK and dV (same layout)
    num_heads, seq_len, head_dim: tl.constexpr,  # a constant: the d masks fold, loads vectorise at D = 72
    q_len,  # query rows of out, dO and lse (the forward's q_len): the other q rows get zero gradient
    scale, drop_threshold, inv_keep, SEED,
    BLOCK: tl.constexpr,  # rows owned: k/v rows in the dK/dV phase, q rows in the dQ phase
    KV_BLOCK_M: tl.constexpr,  # dK/dV phase: q rows per loop step
    Q_BLOCK_N: tl.constexpr,  # dQ phase: k/v rows per loop step
    BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_D_TAIL: tl.constexpr = 0,  # 16: head_dim as BLOCK_D + a 16-wide tail (see the forward)
    TAIL: tl.constexpr = 16,  # the last, partial q step (dK/dV) or k/v step (dQ) runs this wide when it fits
    HEAD_ALIGN: tl.constexpr = 1,  # every head's offset is a multiple of this many elements (_head_align)
    PEEL: tl.constexpr = True,  # as the forward's, for both phases' loops
):
    """Program (b, h, t) writes dK, dV of k/v rows t * BLOCK.., then dQ of the same q rows: one launch, no delta
    pre-pass, and each head's q, k, v, out, dO read from DRAM once (re-reads across its tiles hit L2)."""
    num_tiles = tl.cdiv(seq_len, BLOCK)
    pid = tl.program_id(0)
    bh, tile = pid // num_tiles, pid % num_tiles
    # Each phase gets its heads' pointers computed at its call (not kept live across phase 1).
    _dkdv_of_head(DK, DV, Q, K, V, O, DO, Lse, Lse, bh, tile,  # no dS workspace: a placeholder pointer and stride
                  stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
                  stride_gb, stride_gh, stride_gn, stride_gd, stride_db, stride_dh, stride_dn, stride_dd, 0,
                  num_heads, seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
                  KV_BLOCK_M, BLOCK, BLOCK_D, DROPOUT, INPUT_PRECISION, BLOCK_D_TAIL, TAIL, PEEL, HEAD_ALIGN, False)
    _bwd_dq(_head(DQ, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN),
            _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN),
            _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN),
            _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN),
            _head(O, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN),
            _head(DO, bh, num_heads, stride_gb, stride_gh, HEAD_ALIGN), Lse, bh, tile,
            stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd,
            seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
            BLOCK, Q_BLOCK_N, BLOCK_D, DROPOUT, INPUT_PRECISION, BLOCK_D_TAIL, TAIL, PEEL)


@triton.jit
def _attention_bwd_dkdv_kernel(
    DK, DV, DS,  # outputs: dK, dV (B, H, N, D) through the gradient strides; dS (B * H, q_len, stride_sm)
    Q, K, V, O, DO, Lse,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_db, stride_dh, stride_dn, stride_dd,
    stride_sm,  # dS's row stride: N rounded up to 16, so every row starts 16-element aligned (vector stores)
    num_heads, seq_len, head_dim: tl.constexpr, q_len,
    scale, drop_threshold, inv_keep, SEED,
    BLOCK: tl.constexpr,  # k/v rows owned
    KV_BLOCK_M: tl.constexpr,  # q rows per loop step
    BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_D_TAIL: tl.constexpr = 0,
    TAIL: tl.constexpr = 16,
    HEAD_ALIGN: tl.constexpr = 1,
    PEEL: tl.constexpr = True,
):
    """The stored-dS backward's first launch: program (b, h, t) writes dK, dV of k/v rows t * BLOCK.. as
    ``_attention_bwd_kernel``'s first phase, and dS of every (q row, key) pair it computes to the workspace, which
    ``_attention_bwd_dq_stored_kernel`` reads for dQ: S and dP once per tile pair, not twice."""
    num_tiles = tl.cdiv(seq_len, BLOCK)
    pid = tl.program_id(0)
    bh, tile = pid // num_tiles, pid % num_tiles
    _dkdv_of_head(DK, DV, Q, K, V, O, DO, Lse, DS + bh.to(tl.int64) * q_len * stride_sm, bh, tile,
                  stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
                  stride_gb, stride_gh, stride_gn, stride_gd, stride_db, stride_dh, stride_dn, stride_dd, stride_sm,
                  num_heads, seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, SEED,
                  KV_BLOCK_M, BLOCK, BLOCK_D, DROPOUT, INPUT_PRECISION, BLOCK_D_TAIL, TAIL, PEEL, HEAD_ALIGN, True)


@triton.jit
def _dq_stored_step(dq, dq_t, ds_rows, k_head, row_ok, start_n, seq_len, stride_kn, stride_kd, head_dim,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D_TAIL: tl.constexpr,
                    MASK_KEYS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """dq (and its tail) += dS K over keys start_n.. start_n + BLOCK_N, masked past q_len (and, in the last step,
    ``MASK_KEYS``, past seq_len); ``ds_rows``: the program's rows of the head's dS (a column of pointers)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    if MASK_KEYS:
        col_ok = cols < seq_len
        ds = tl.load(ds_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    else:
        col_ok = None
        ds = tl.load(ds_rows + cols[None, :], mask=row_ok[:, None], other=0.0)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load(k_head, cols, col_ok, offs_d, offs_d < head_dim, stride_kn, stride_kd, False)
    dq += tl.dot(ds, k, input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        k_t = _load(k_head, cols, col_ok, offs_t, offs_t < head_dim, stride_kn, stride_kd, False)
        dq_t += tl.dot(ds, k_t, input_precision=INPUT_PRECISION)
    return dq, dq_t


@triton.jit
def _attention_bwd_dq_stored_kernel(
    DQ,  # output: dQ (B, H, N, D) through the gradient strides, zero past q_len
    DS, K,  # dS (B * H, q_len, stride_sm) from _attention_bwd_dkdv_kernel; k through strides
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_db, stride_dh, stride_dn, stride_dd,
    stride_sm,
    num_heads, seq_len, head_dim: tl.constexpr, q_len, scale,
    BLOCK_M: tl.constexpr,  # q rows owned
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_D_TAIL: tl.constexpr = 0,
    TAIL: tl.constexpr = 16,  # the last, partial key step runs this wide when it fits
    HEAD_ALIGN: tl.constexpr = 1,
):
    """The stored-dS backward's second launch: program (b, h, t) writes dQ = scale * dS K of q rows t * BLOCK_M..,
    one dot per key step (no S, dP or exponential; full key steps unmasked, then the rest as one masked step, TAIL
    wide when it fits); q rows past q_len (no dS) get zeros."""
    num_tiles = tl.cdiv(seq_len, BLOCK_M)
    pid = tl.program_id(0)
    bh, tile = pid // num_tiles, pid % num_tiles
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    ds_rows = DS + bh.to(tl.int64) * q_len * stride_sm + rows[:, None].to(tl.int64) * stride_sm
    k_head = _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq_t = tl.zeros([BLOCK_M, BLOCK_D_TAIL], tl.float32) if BLOCK_D_TAIL else 0.0
    keys = tl.where(tile * BLOCK_M < q_len, seq_len, 0)  # a tile past q_len skips the loop: its dq is 0
    full_end = keys - keys % BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        dq, dq_t = _dq_stored_step(dq, dq_t, ds_rows, k_head, row_ok, start_n, seq_len, stride_kn, stride_kd,
                                   head_dim, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, False, INPUT_PRECISION)
    rest = keys - full_end  # < BLOCK_N
    if rest > TAIL:
        dq, dq_t = _dq_stored_step(dq, dq_t, ds_rows, k_head, row_ok, full_end, seq_len, stride_kn, stride_kd,
                                   head_dim, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, INPUT_PRECISION)
    elif rest > 0:
        dq, dq_t = _dq_stored_step(dq, dq_t, ds_rows, k_head, row_ok, full_end, seq_len, stride_kn, stride_kd,
                                   head_dim, TAIL, BLOCK_D, BLOCK_D_TAIL, True, INPUT_PRECISION)
    dq_head = _head(DQ, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN)
    offs_d = tl.arange(0, BLOCK_D)
    store_ok = rows < seq_len
    tl.store(dq_head + _tile(rows, offs_d, stride_dn, stride_dd, False), (dq * scale).to(dq_head.dtype.element_ty),
             mask=_tile_mask(store_ok, offs_d < head_dim, False))
    if BLOCK_D_TAIL:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        tl.store(dq_head + _tile(rows, offs_t, stride_dn, stride_dd, False),
                 (dq_t * scale).to(dq_head.dtype.element_ty), mask=_tile_mask(store_ok, offs_t < head_dim, False))
