"""Flash attention for ViT, forward and backward, straight from the packed qkv projection.

Math (per batch b and head h; q, k, v are N x D, scale s = D ** -0.5 unless given):
    S = s * q k^T,   P = softmax(S) row-wise,   Z = dropout keep mask (Bernoulli(1 - p)),
    out = (P * Z / (1 - p)) v,                  lse_i = log sum_j exp(S_ij)   (saved, fp32)
Backward (FlashAttention-2; delta_i = sum_d dO_id * out_id, recomputed per tile, no pre-pass):
    dV = (P * Z / (1 - p))^T dO,   dP = (dO v^T) * Z / (1 - p),   dS = P * (dP - delta),
    dQ = s * dS k,   dK = s * dS^T q,   with P recomputed as exp(S - lse) from the saved lse.

qkv bias. ``attention_linear(x, W, b, H)`` is the qkv Linear followed by attention. The bias rides in
the qkv GEMM's epilogue (``F.linear(x, W, b)``, one rounding, bitwise the qkv of eager timm, autocast
included), so the kernels see the biased q, k, v and run the math above unchanged. The Linear gets b
detached; its gradient d(b) = sum over batch and tokens of d(qkv) comes from the attention backward
instead: the dK/dV and dQ programs write fp32 column sums of their final dk, dv, dq tiles (valid rows
only, before rounding) into row b * tiles + tile of a (3, G, C) buffer (constexpr BIAS_GRAD), and
``sum_partials`` (kernels/_rows.py) adds the G rows in a fixed order and writes d(b) in the bias's
dtype (fp32 under autocast). So the eager addmm backward's separate sum over the (B, N, 3C) gradient
(a full extra read of it per block) is gone, with no algebra on the bias: the kernels' rounding is
exactly that of unbiased attention on eager's qkv, however large the bias is next to x @ W^T.

Layout. ``attention(qkv, H)`` takes the qkv Linear's output (B, N, 3 * H * D) as it leaves the GEMM
and reads q, k, v through the strides of its (B, N, 3, H, D) view: no permute, chunk or copy. The
output is written directly as (B, N, H * D), ready for the proj GEMM, and the gradient is one
(B, N, 3 * H * D) tensor written by the backward kernel. ``attention_qkv(q, k, v)`` takes
(B, H, N, D) tensors of any strides (the F.scaled_dot_product_attention layout).

Kernels (grid: batch * heads folded onto axis 0 with the tile index, so B * H may exceed 65535):
    _attention_fwd_kernel    one program per (b, h, q tile of 128 rows in fp16/bf16); loops over k/v
                             tiles with an online softmax in fp32 and an fp32 accumulator
    _attention_bwd_kernel    one program per (b, h, tile t): dK, dV of k/v tile t looping over q tiles
                             (``_bwd_dkdv``), then dQ of q tile t looping over k/v tiles (``_bwd_dq``);
                             delta of each q tile is recomputed from out and dO where it is needed
    _attention_probs_kernel  attention maps: exp(S - lse) for chosen query rows, outside training
Every loop runs its full tiles without key or row masks, then what is left as one masked step, 16 wide
when at most 16 are left (ViT's 197 tokens = 3 x 64 + 5 run 208 keys per query row, not 256).
``query_rows`` = M < N (``attention_linear``; the last block under class-token pooling, M = 1) computes the
first M queries only: the forward writes (B, M, C) and lse (B, H, M), the dK/dV loop steps over M query
rows, dQ tiles past M skip their loop and write zeros.
No atomics and no program reads what another writes in the same launch: gradients are bitwise
reproducible. Launches: 1 forward, 1 backward; with the qkv bias's gradient (constexpr BIAS_GRAD,
the same kernels) 1 forward, 1 + 1 backward (``sum_partials``).

Dtypes: fp16 and bf16 dots run on tensor cores with fp32 accumulation; softmax, lse and all
elementwise math are fp32; P is cast to the input dtype for the P v dot (as FlashAttention does).
fp32 inputs use IEEE fp32 dots unless torch.backends.cuda.matmul.allow_tf32 is True (then tf32).
Dropout is 8-bit, like FlashAttention's: each score element gets a random byte and is kept iff the byte is
>= t = round(256 p), so the rate applied is t / 256 (p = 0.1 runs as 26/256 = 0.1016; ``dropout_rate(p)``
says which) and kept values are scaled by 1 / (1 - t / 256), which keeps the expectation exact (t = 0 draws
nothing, t = 256 drops everything). One Philox-4x32-10 call serves 16 elements: element (i, j) of head
b * H + h reads byte k of word w of the call at counter (j // 16, i, b * H + h, 0), j = 16 (j // 16) + 4w + k
(``_utils.dropout_keep_tile``). Every kernel regenerates the mask from (seed, head, i, j), never stored:
the forward and dQ on their (q rows x keys) tiles, dK/dV on the same tile transposed, bitwise the same
mask. One Philox per element (the former draw) cost 4-5x the loop's instructions; one per 16 costs about
twice the loop without dropout. The seed is a 1-element CPU tensor from ``_utils.next_seed()`` (torch's CPU
generator: ``torch.manual_seed`` and checkpointing replay it), read as an int only inside the custom ops
(torch.compile traces it, no graph break) and saved for backward.

Limits: any N >= 1 (the last tile is masked; padded keys get exactly zero probability), head_dim
1..128 (a non-power-of-two D is padded inside the kernel with masked loads, never in memory; a 16-bit
D = 72 runs as 64 + 16 columns, see ``attention_config``).

Memory and bytes: the forward allocates only the output and the fp32 lse (B * H * N); nothing grows
with N^2 (the backward adds nothing but the bias partials). HBM traffic per token and layer,
C = H * D, e = bytes per element, counting each kernel's first touch (re-reads of one head's rows
across its tiles hit L2 at ViT sizes: the head's q, k, v, out, dO are 5 * N * D * e, 123 KB for
ViT-B):
    forward   read q, k, v (3C e), write out (C e) + lse (4H)              = 4C e + 4H   (1 launch)
    backward  read q, k, v, out, dO (5C e) + lse (4H), write dq, dk, dv (3C e) = 8C e + 4H (1 launch)
ViT-B/16 in bf16 (C = 768, H = 12): 6.2 KB per token forward, 12.3 KB backward (FlashAttention-2's
delta pre-pass, separate dK/dV and dQ kernels: 20.2 KB, 3 launches).
With the qkv bias's gradient: the backward writes and sum_partials reads the fp32 partials,
2 * 12C * T / N bytes per token (T = backward tiles per sequence; ViT-B bf16: T = 4, 0.37 KB) and writes
3C bias-grad values once, where the eager addmm backward read all of d(qkv) again (3C e = 4.6 KB per
token). The forward's bias costs nothing here: it rides in the qkv GEMM's epilogue.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning
from ._aot import TRITON_DTYPE_NAMES, AotSpec
from ._math import LN2, LOG2E
from ._rows import sum_partials
from ._tuning import bucket
from ._utils import (
    cdiv,
    check_float,
    check_kernel_device,
    check_ndim,
    check_shape,
    dropout_keep_tile,
    dropout_rate,
    dropout_threshold,
    gpu_arch,
    next_power_of_2,
    next_seed,
    run_op,
    seed_value,
)
from ._utils import input_precision as dot_input_precision

MAX_HEAD_DIM = 128
# The loops' last, partial step runs 16 wide when at most 16 keys / rows are left: a multiple of 16, as the MMA
# k-step and dropout_keep_tile (one Philox call per 16 columns) need.
LAST_STEP = 16
MAX_GRID = 2**31 - 1


# -------------------------------------------------------------------------------------- jit kernels
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
def _store_column_sums(P, x, row_ok, offs_d, d_ok, partial_row, head_dim):
    """Bias-gradient partial: the column sums of a program's fp32 (rows x D) tile x over its valid
    rows, stored at row ``partial_row`` of a (G * H, D) fp32 buffer (row (b * tiles + tile) * H + h).
    Every (row, column) has exactly one writer: no atomics, and the second stage sums rows in a fixed
    order."""
    tl.store(P + partial_row * head_dim + offs_d, tl.sum(tl.where(row_ok[:, None], x, 0.0), 0), mask=d_ok)


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
    drop_threshold, inv_keep, seed,  # dropout: 8-bit threshold t, 256 / (256 - t) (0 when t == 256), Philox seed
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
def _q_row_tiles(q_head, o_head, do_head, rows, row_ok, offs, ok, stride_qn, stride_qd, stride_on, stride_od,
                 stride_gn, stride_gd, TRANS_Q: tl.constexpr):
    """q (transposed with ``TRANS_Q``) and dO of some q rows and columns, and those columns' share of
    delta_i = rowsum(dO_i * out_i): what both backward phases load per q tile, main part and head_dim tail."""
    q = _load(q_head, rows, row_ok, offs, ok, stride_qn, stride_qd, TRANS_Q)
    do = _load(do_head, rows, row_ok, offs, ok, stride_gn, stride_gd, False)
    o = _load(o_head, rows, row_ok, offs, ok, stride_on, stride_od, False)
    return q, do, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)


@triton.jit
def _dkdv_step(
    dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head, bh, tile, start_m,
    stride_qn, stride_qd, stride_on, stride_od, stride_gn, stride_gd,
    q_len, head_dim, qk_scale, drop_threshold, inv_keep, seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D_TAIL: tl.constexpr,
    MASK_ROWS: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One q tile (rows start_m.. start_m + BLOCK_M) of phase 1; returns the updated (dk, dv, dk_t, dv_t).
    Only the last tile (``MASK_ROWS``) can run past q_len. delta_i = rowsum(dO_i * out_i) is recomputed
    here from out and dO (no pre-pass)."""
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
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        dk_t += tl.dot(dsT.to(qT_t.dtype), tl.trans(qT_t), input_precision=INPUT_PRECISION)
    return dk, dv, dk_t, dv_t


@triton.jit
def _bwd_dkdv(
    dk_head, dv_head, PK, PV, q_head, k_head, v_head, o_head, do_head, Lse, bh, tile, partial_row,
    stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
    stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd,
    seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_D_TAIL: tl.constexpr, TAIL_M: tl.constexpr, PEEL: tl.constexpr,
):
    """Phase 1 of the backward: dK, dV of k/v tile ``tile`` (BLOCK_N rows), looping over q tiles: full ones
    without a row mask, then the rest as one masked step, TAIL_M rows wide when it fits (as the forward's keys).
    ``*_head`` point at head (b, h) of each tensor; the strides are its row and column strides.
    With BLOCK_D_TAIL every (rows x D) tile is two: columns 0..BLOCK_D and the tail (``_t``)."""
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
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head, bh,
                                            tile, start_m, stride_qn, stride_qd, stride_on, stride_od, stride_gn,
                                            stride_gd, q_len, head_dim, qk_scale, drop_threshold, inv_keep, seed,
                                            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, False, DROPOUT, INPUT_PRECISION)
        rest = q_len - full_end  # < BLOCK_M
        if rest > TAIL_M:
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head, bh,
                                            tile, full_end, stride_qn, stride_qd, stride_on, stride_od, stride_gn,
                                            stride_gd, q_len, head_dim, qk_scale, drop_threshold, inv_keep, seed,
                                            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)
        elif rest > 0:
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head, bh,
                                            tile, full_end, stride_qn, stride_qd, stride_on, stride_od, stride_gn,
                                            stride_gd, q_len, head_dim, qk_scale, drop_threshold, inv_keep, seed,
                                            TAIL_M, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)
    else:  # every q tile through the masked step (Tile.peel)
        for start_m in range(0, q_len, BLOCK_M):
            dk, dv, dk_t, dv_t = _dkdv_step(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_head, o_head, do_head, lse_head, bh,
                                            tile, start_m, stride_qn, stride_qd, stride_on, stride_od, stride_gn,
                                            stride_gd, q_len, head_dim, qk_scale, drop_threshold, inv_keep, seed,
                                            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)

    offsets = _tile(cols, offs_d, stride_dn, stride_dd, False)
    mask = _tile_mask(col_ok, d_ok, False)
    dk = dk * scale
    tl.store(dk_head + offsets, dk.to(dk_head.dtype.element_ty), mask=mask)
    tl.store(dv_head + offsets, dv.to(dv_head.dtype.element_ty), mask=mask)
    if BIAS_GRAD:  # padded k/v rows hold junk (p of a zero key), hence the row mask
        _store_column_sums(PK, dk, col_ok, offs_d, d_ok, partial_row, head_dim)
        _store_column_sums(PV, dv, col_ok, offs_d, d_ok, partial_row, head_dim)
    if BLOCK_D_TAIL:
        offsets_t = _tile(cols, offs_t, stride_dn, stride_dd, False)
        mask_t = _tile_mask(col_ok, t_ok, False)
        dk_t = dk_t * scale
        tl.store(dk_head + offsets_t, dk_t.to(dk_head.dtype.element_ty), mask=mask_t)
        tl.store(dv_head + offsets_t, dv_t.to(dv_head.dtype.element_ty), mask=mask_t)
        if BIAS_GRAD:
            _store_column_sums(PK, dk_t, col_ok, offs_t, t_ok, partial_row, head_dim)
            _store_column_sums(PV, dv_t, col_ok, offs_t, t_ok, partial_row, head_dim)


@triton.jit
def _dq_step(
    dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, start_n,
    stride_kn, stride_kd, stride_vn, stride_vd,
    seq_len, head_dim, qk_scale, drop_threshold, inv_keep, seed,
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
        dp = tl.where(dropout_keep_tile(seed, bh, rows, start_n, drop_threshold, BLOCK_N), dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=INPUT_PRECISION)
    if BLOCK_D_TAIL:
        dq_t += tl.dot(ds.to(kT_t.dtype), tl.trans(kT_t), input_precision=INPUT_PRECISION)
    return dq, dq_t


@triton.jit
def _bwd_dq(
    dq_head, PQ, q_head, k_head, v_head, o_head, do_head, Lse, bh, tile, partial_row,
    stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
    stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd,
    seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, BIAS_GRAD: tl.constexpr,
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
                                inv_keep, seed, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, False, DROPOUT, INPUT_PRECISION)
        rest = keys - full_end  # < BLOCK_N
        if rest > TAIL_N:
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, full_end,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, seed, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)
        elif rest > 0:
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, full_end,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, seed, TAIL_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)
    else:  # every k/v tile through the masked step (Tile.peel)
        for start_n in range(0, keys, BLOCK_N):
            dq, dq_t = _dq_step(dq, dq_t, q, q_t, do, do_t, delta, lse2, k_head, v_head, bh, rows, start_n,
                                stride_kn, stride_kd, stride_vn, stride_vd, seq_len, head_dim, qk_scale, drop_threshold,
                                inv_keep, seed, BLOCK_N, BLOCK_D, BLOCK_D_TAIL, True, DROPOUT, INPUT_PRECISION)

    dq = dq * scale
    store_ok = rows < seq_len  # every q row of the gradient is written, the rows past q_len as zeros
    tl.store(dq_head + _tile(rows, offs_d, stride_dn, stride_dd, False), dq.to(dq_head.dtype.element_ty),
             mask=_tile_mask(store_ok, d_ok, False))
    if BIAS_GRAD:
        _store_column_sums(PQ, dq, row_ok, offs_d, d_ok, partial_row, head_dim)
    if BLOCK_D_TAIL:
        dq_t = dq_t * scale
        tl.store(dq_head + _tile(rows, offs_t, stride_dn, stride_dd, False), dq_t.to(dq_head.dtype.element_ty),
                 mask=_tile_mask(store_ok, t_ok, False))
        if BIAS_GRAD:
            _store_column_sums(PQ, dq_t, row_ok, offs_t, t_ok, partial_row, head_dim)


@triton.jit
def _attention_bwd_kernel(
    DQ, DK, DV,  # outputs: (B, H, N, D) through the gradient strides (views of one dqkv buffer)
    PQ, PK, PV,  # BIAS_GRAD outputs: (B * tiles * H, D) fp32 column partials of dq, dk, dv, else None
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
    scale, drop_threshold, inv_keep, seed,
    BLOCK: tl.constexpr,  # rows owned: k/v rows in the dK/dV phase, q rows in the dQ phase
    KV_BLOCK_M: tl.constexpr,  # dK/dV phase: q rows per loop step
    Q_BLOCK_N: tl.constexpr,  # dQ phase: k/v rows per loop step
    BLOCK_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BIAS_GRAD: tl.constexpr,  # also write column partials of dq, dk, dv (the qkv bias's gradient)
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
    partial_row = (((bh // num_heads) * num_tiles + tile) * num_heads + bh % num_heads).to(tl.int64)
    # Each phase gets its heads' pointers computed at its call (not kept live across phase 1).
    _bwd_dkdv(_head(DK, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN),
              _head(DV, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN), PK, PV,
              _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN),
              _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN),
              _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN),
              _head(O, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN),
              _head(DO, bh, num_heads, stride_gb, stride_gh, HEAD_ALIGN), Lse, bh, tile, partial_row,
              stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
              stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd,
              seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, seed,
              KV_BLOCK_M, BLOCK, BLOCK_D, DROPOUT, INPUT_PRECISION, BIAS_GRAD, BLOCK_D_TAIL, TAIL, PEEL)
    _bwd_dq(_head(DQ, bh, num_heads, stride_db, stride_dh, HEAD_ALIGN), PQ,
            _head(Q, bh, num_heads, stride_qb, stride_qh, HEAD_ALIGN),
            _head(K, bh, num_heads, stride_kb, stride_kh, HEAD_ALIGN),
            _head(V, bh, num_heads, stride_vb, stride_vh, HEAD_ALIGN),
            _head(O, bh, num_heads, stride_ob, stride_oh, HEAD_ALIGN),
            _head(DO, bh, num_heads, stride_gb, stride_gh, HEAD_ALIGN), Lse, bh, tile, partial_row,
            stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_on, stride_od, stride_gn, stride_gd, stride_dn, stride_dd,
            seq_len, head_dim, q_len, scale, drop_threshold, inv_keep, seed,
            BLOCK, Q_BLOCK_N, BLOCK_D, DROPOUT, INPUT_PRECISION, BIAS_GRAD, BLOCK_D_TAIL, TAIL, PEEL)


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
def _attention_dropout_mask_kernel(Keep, seq_len, drop_threshold, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Test helper: materialise the keep mask (B * H, N, N) exactly as the kernels draw it (program (tile, bh)
    writes BLOCK_M query rows of head bh, BLOCK_N keys at a time)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    keep_rows = Keep + (bh.to(tl.int64) * seq_len + rows[:, None]) * seq_len
    for start_n in range(0, seq_len, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep_tile(seed, bh, rows, start_n, drop_threshold, BLOCK_N)
        tl.store(keep_rows + cols[None, :], keep.to(tl.int8), mask=row_ok[:, None] & (cols < seq_len)[None, :])


# ------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class Tile:
    block_m: int  # q rows (per program, or per loop step in dK/dV)
    block_n: int  # k/v rows (per loop step, or per program in dK/dV)
    num_warps: int
    num_stages: int
    split: bool = False  # head_dim 65..79, not a multiple of 16: 64 columns + a 16-wide tail (``_block_dims``)
    # Loops run their full tiles without masks, then the last, partial one (16 wide when it fits); False: every
    # tile through the masked step, where the peeled build spills (fp32; 128-wide 16-bit heads with dropout)
    peel: bool = True


@dataclass(frozen=True)
class AttentionConfig:
    fwd: Tile
    dkdv: Tile  # backward phase 1: block_n k/v rows owned, block_m q rows per loop step
    dq: Tile  # backward phase 2: block_m q rows owned, block_n k/v rows per loop step

    def __post_init__(self):
        dkdv, dq = self.dkdv, self.dq
        if (dkdv.block_n, dkdv.num_warps, dkdv.num_stages, dkdv.split, dkdv.peel) != (
                dq.block_m, dq.num_warps, dq.num_stages, dq.split, dq.peel):
            raise ValueError(f"attention_config: the dK/dV and dQ phases run in one kernel, each program owning "
                             f"the same rows in both, so they need one row count, num_warps, num_stages, "
                             f"head_dim split and peel; "
                             f"got {dkdv} and {dq}")


def attention_config(seq_len: int, head_dim: int, dtype: torch.dtype, arch: int,
                     input_precision: str | None = None, dropout: bool = False) -> AttentionConfig:
    """Block sizes per (N, D, dtype, arch, dropout on or off): a small explicit table, no autotuning.

    ``vit-fast report`` compiles every entry for sm_80 and sm_90, with and without dropout and the
    qkv bias's gradient partials, and prints its registers and spills. The tiles were sized when the
    kernels still added the qkv bias themselves (the notes below are from then); they now hold fewer
    live values, and larger tiles are worth timing on a GPU before any change. fp32 depends on the dot
    precision (default: the torch tf32 flag): IEEE fp32 dots run on the FMA units and need smaller
    tiles than tf32 ones. The backward's two phases share one launch, hence one warp count.
    Short sequences clamp the tiles to N rounded up to a power of two (>= 16), which only lowers
    register use.

    16-bit backward on sm_90, head_dim <= 64: each program owns 128 rows (two warpgroups, 8 warps, 2 stages)
    and steps over 32 q rows in dK/dV and 64 keys in dQ, so every dot is a wgmma of N >= 32 (the former
    64 rows owned with 16-row steps gave 64x16 wgmma tiles; its main loops read 53-56% in ``vit-fast
    report``'s SASS ceiling, these 86-92% without dropout and 44-46% with it, no spills at 173-246
    registers; with the full tiles unmasked, 100% and 50-59%). 64x64 steps at 4 warps spill with the bias
    partials, at 8 warps they split into 64x32
    wgmma tiles (68%); 128x64 steps spill with dropout. Wider heads keep the small tiles: 64-row steps
    with a 128-wide head spill hundreds of bytes.

    Dropout's keep tile (16 bytes per Philox call, spread over the score tile) holds registers of its own, so
    a few entries shrink when ``dropout`` is on, where the no-dropout tile would spill: the wide 16-bit forward
    (sm_80 64x32 at 4 warps, sm_90 128x32) and the IEEE fp32 backward on sm_80.

    Head dims that are not a multiple of 16 (SigLIP So400m's 72; 88) pad to BLOCK_D = 128 with the padded
    columns masked inside the dots' 16-wide k-steps, which holds registers the 80- and 128-wide heads do not
    need; ``ragged`` picks their own tiles where the wide ones spill (checked at N = 256 and 257, whose
    seq_len divisibility gives different builds): the sm_80 IEEE forward 32x32 at 8 warps, the sm_80 16-bit
    forward with dropout 64x16, and on sm_90 the 16-bit forward 128x32, the 16-bit backward 32 rows owned at
    1 stage (16 rows with dropout) and the IEEE backward with dropout at 2 stages. The sm_90 16-bit backward
    pays for it in its ceiling (``vit-fast report``; docs/gpu-readiness.md, Performance).

    16-bit head dims in 65..80 (D = 72; D = 80, which padded to 128 measured 8.6x slower on an H200, torch 2.11,
    triton 3.6, 2026-11-26) instead split the head (``Tile.split``, ``_block_dims``): 64 columns plus a 16-wide
    tail, two dots summed for q k^T and dO v^T and two accumulators for out, dq, dk, dv, so the tiles carry 80
    columns, not 128. With head_dim a constant and the head offsets known to be 16-byte aligned (HEAD_ALIGN 8:
    72 = 8 x 9) every load is vectorised, and the split takes the D <= 64 tiles (checked at N = 256 and 257,
    bf16 and fp16, with and without the bias partials, 0 spills; SASS
    ceilings, dropout in brackets): forward sm_80 128x32 100% (64x32 on 8 warps: 66%), sm_90 128x64 90% (43%);
    backward sm_80 16 q rows per step, 32 rows owned, 100% (16 rows owned on 4 warps: 74%; 8 warps spill 8 B),
    sm_90 as D <= 64 (128 rows owned, 32-row / 64-key steps) 100% (55%), 202-254 regs. (Before the alignment hint
    every D = 72 load was one element wide: sm_90 forward 38-51%, backward 32-34% at 32 rows owned, 1 stage.)
    fp32 keeps the padded builds (not measured split).
    """
    if dtype == torch.float32 and input_precision is None:  # the torch tf32 flag, read now: not cached
        input_precision = dot_input_precision(dtype)
    return _attention_config(seq_len, head_dim, dtype, arch, input_precision, dropout)


@functools.lru_cache(maxsize=None)  # a pure table lookup asked on every launch: built once per shape
def _attention_config(seq_len: int, head_dim: int, dtype: torch.dtype, arch: int, input_precision: str | None,
                      dropout: bool) -> AttentionConfig:
    wide = next_power_of_2(head_dim) > 64  # D in 65..128: twice the registers per row
    # D = 72, 88 (SigLIP So400m: 72): not a multiple of the 16-wide MMA k-step, so the padded columns are
    # masked inside the dots' tiles, which costs registers of their own; checked at N = 256 and 257
    ragged = head_dim % 16 != 0
    stages = 3 if arch >= 90 else 2
    warps = 8 if wide else 4
    # Backward tiles: (dK/dV: q rows per step, k/v rows owned), (dQ: q rows owned, k/v rows per step).
    # The merged kernel holds the larger of the two phases' live sets plus an out tile per dK/dV step
    # (delta), so its tiles are smaller than separate kernels' would be.
    if dtype == torch.float32 and (input_precision or dot_input_precision(dtype)) == "ieee":
        # backward at 2 stages: at 3 on sm_90 ptxas caps it at 80 registers, 8-24 B spills (D = 64 with dropout,
        # D = 72 with dropout, D = 80)
        fwd, dkdv, dq = Tile(32, 32, 8, stages), Tile(16, 32, 8, 2), Tile(32, 16, 8, 2)
        if not wide and arch < 90:  # at 8 warps ptxas caps the bias-gradient builds at 64 regs: 8-16 B spills
            dkdv, dq = Tile(16, 32, 4, stages), Tile(32, 16, 4, stages)  # 144-150 regs, no spills
        if wide and arch < 90 and not ragged:  # 32x32 at 8 warps: 24 B stack with bias + dropout; this one
            fwd = Tile(32, 16, 4, stages)  # 120-152 regs (D = 72: 24-176 B spills; 32x32 at 8 warps 105-174 regs)
        if dropout and arch < 90:  # the tiles above spill 8-104 B with the keep tile
            dkdv, dq = (Tile(16, 16, 8, stages), Tile(16, 16, 8, stages)) if wide else \
                (Tile(16, 32, 8, stages), Tile(32, 16, 8, stages))
        elif dropout and not wide:  # sm_90, D <= 64: 16 x 32 spills 8-16 B on triton 3.6
            dkdv, dq = Tile(16, 16, 8, 2), Tile(16, 16, 8, 2)
    elif dtype == torch.float32:  # tf32 tensor cores; fp32 tiles take twice the registers of 16-bit ones
        fwd = Tile(64, 32, warps, stages)
        # wide 16x32 / 32x16: 48 B spills on sm_90 with bias + dropout
        dkdv, dq = (Tile(16, 16, 8, stages), Tile(16, 16, 8, stages)) if wide else \
            (Tile(32, 32, 8, stages), Tile(32, 32, 8, stages))
    else:
        fwd = Tile(128, 64, 8, stages)
        # narrow 32x64 / 64x32 at 4 warps: 8-40 B spills on sm_80 (at 8 warps: 48 B without bias)
        dkdv, dq = (Tile(16, 32, 8, stages), Tile(32, 16, 8, stages)) if wide else \
            (Tile(16, 64, 4, stages), Tile(64, 16, 4, stages))
        if not wide and arch >= 90:  # wgmma tiles of N >= 32: 128 rows owned, 32 q rows per dK/dV step
            dkdv, dq = Tile(32, 128, 8, 2), Tile(128, 64, 8, 2)
        if wide and arch < 90:  # 128x64: 48-64 B spills with bias; 128x32 with 3 stages: 183-194 regs
            fwd = Tile(128, 32, 8, 3)
        if wide and dropout:  # with the keep tile 128x32 spills 8 B on sm_80, 128x64 32-40 B on sm_90 (D = 72)
            fwd = Tile(128, 32, 8, stages)
            if arch < 90:  # D = 72: 8-16 B spills at 128x16, 256 B at 64x32 on 4 warps; 64x16 on 8: 175-180 regs
                fwd = Tile(64, 16, 8, 3) if ragged else Tile(64, 32, 4, 3)
        if ragged and arch >= 90:  # D = 72, N = 257: 128x64 spills 8 B; the backward 8-32 B at 32 rows owned and
            fwd = Tile(128, 32, 8, stages)  # 3 stages (16 B with bias at 2), 24-48 B with dropout at 1 or 2
            dkdv, dq = (Tile(16, 16, 8, stages), Tile(16, 16, 8, stages)) if dropout else \
                (Tile(16, 32, 8, 1), Tile(32, 16, 8, 1))  # 217 / 172-204 regs
    if _block_dims(head_dim, True)[1] and dtype != torch.float32:  # D = 72, 80 as 64 + 16 columns, 16-bit only
        fwd = Tile(128, 64, 8, 3, True) if arch >= 90 else Tile(64, 32, 8, 3, True) if dropout else \
            Tile(128, 32, 8, 3, True)
        if arch >= 90:  # the D <= 64 tiles, with dropout too
            dkdv, dq = Tile(32, 128, 8, 2, True), Tile(128, 64, 8, 2, True)
        elif dropout:  # 16 rows owned on 4 warps, 1 stage (8 warps, or 2 stages on triton 3.6: 8 B spills)
            dkdv, dq = Tile(16, 16, 4, 1, True), Tile(16, 16, 4, 1, True)
        else:
            dkdv, dq = Tile(16, 32, 8, 2, True), Tile(32, 16, 8, 2, True)
    # One masked loop where the peeled build spills: fp32 (FMA dots hold whole tiles; 120-496 B at ViT-B) and the
    # 128-wide 16-bit heads with dropout (D = 80: 216 B in the sm_80 forward, 16 B in the backward)
    fwd, dkdv, dq = (replace(t, peel=False) if dtype == torch.float32 or (wide and dropout and not t.split) else t
                     for t in (fwd, dkdv, dq))
    cap = max(16, next_power_of_2(seq_len))
    clamp = lambda t: replace(t, block_m=min(t.block_m, cap), block_n=min(t.block_n, cap))  # noqa: E731
    return AttentionConfig(fwd=clamp(fwd), dkdv=clamp(dkdv), dq=clamp(dq))


def attention_grid(batch_heads: int, seq_len: int, block: int) -> tuple[int]:
    """1-D grid: (batch * heads) x tiles folded onto axis 0 (limit 2^31 - 1, not 65535)."""
    programs = batch_heads * cdiv(seq_len, block)
    if programs > MAX_GRID:
        raise ValueError(f"attention: {programs} programs exceed the CUDA grid limit {MAX_GRID}; "
                         f"split the batch (batch*heads={batch_heads}, seq_len={seq_len})")
    return (programs,)


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _block_dims(head_dim: int, split: bool) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D_TAIL) of a forward or backward launch: with ``split`` (the config's Tile), a head_dim in
    65..80 (SigLIP So400m's 72, ViT-H's 80) runs as 64 columns plus a 16-wide tail (80 wide, not 128); every
    other launch as one power-of-two part (tail 0, the kernels' single-part path). Measured on an H200
    (2026-11-26, docs/measured/): D = 80 padded to 128 took 8.77 ms forward + backward at 128 x 257 x 16 heads,
    where the split D = 72 took 1.02 ms at 128 x 256 x 16."""
    if split and 64 < head_dim <= 80:
        return 64, 16
    return _block_d(head_dim), 0


# ------------------------------------------------------------ validation and launchers (custom ops)
def _head_align(*tensors: torch.Tensor) -> int:
    """The largest of 16, 8, 4, 2, 1 dividing the batch and head strides of every (B, H, N, D) tensor: the
    kernels' HEAD_ALIGN (``_head``)."""
    align = 16
    for t in tensors:
        for stride in t.stride()[:2]:
            while stride % align:
                align //= 2
    return align


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every allocation of the launchers goes through here (tests track and poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_head_dim(op: str, head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: expected head_dim in 1..{MAX_HEAD_DIM}, got {head_dim}")


def _check_scale(op: str, scale: float | None) -> None:
    """The kernels mask padded keys with -inf before scaling (the scale rides in the exponent's FFMA), which holds
    for a positive finite scale only."""
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: expected scale a finite number > 0 or None (head_dim ** -0.5), got {scale!r}")


def _check_dropout(op: str, dropout_p: float) -> None:
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: expected dropout_p in [0, 1], got {dropout_p}")


def _check_query_rows(op: str, query_rows: int | None, seq_len: int) -> None:
    if query_rows is not None and not (isinstance(query_rows, int) and not isinstance(query_rows, bool)
                                       and 1 <= query_rows <= seq_len):
        raise ValueError(f"{op}: expected query_rows an int in 1..{seq_len} (the tokens) or None, got {query_rows!r}")


def _check_num_heads(op: str, num_heads: int) -> None:
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"{op}: expected num_heads to be a positive int, got {num_heads!r}")


def _check_packed(op: str, qkv: torch.Tensor, num_heads: int) -> int:
    """Validate a packed (B, N, 3 * H * D) qkv; returns head_dim."""
    check_float(op, "qkv", qkv)
    check_ndim(op, "qkv", qkv, 3)
    _check_num_heads(op, num_heads)
    width = qkv.shape[-1]
    if width == 0 or width % (3 * num_heads):
        raise ValueError(f"{op}: expected qkv last dim divisible by 3 * num_heads = {3 * num_heads}, got {width}")
    head_dim = width // (3 * num_heads)
    _check_head_dim(op, head_dim)
    if qkv.shape[1] < 1:
        raise ValueError(f"{op}: expected at least one token, got qkv of shape {tuple(qkv.shape)}")
    if not qkv.is_contiguous():
        raise ValueError(f"{op}: expected a contiguous qkv (the qkv Linear's output), got strides {qkv.stride()}")
    return head_dim


def _check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> int:
    """x (B, N, C_in), the qkv Linear's weight (3 * H * D, C_in) and optional bias (3 * H * D,), on one
    device that runs the kernels, of one dtype unless autocast picks the GEMM's: checked before the GEMM
    (the qkv it produces then needs no check of its own). Returns head_dim."""
    check_float(op, "x", x)
    check_ndim(op, "x", x, 3)
    if x.shape[1] < 1:
        raise ValueError(f"{op}: expected at least one token, got x of shape {tuple(x.shape)}")
    check_float(op, "weight", weight)
    check_ndim(op, "weight", weight, 2)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: expected weight of shape (3 * H * D, {x.shape[-1]}) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    _check_num_heads(op, num_heads)
    if weight.shape[0] == 0 or weight.shape[0] % (3 * num_heads):
        raise ValueError(f"{op}: expected weight rows divisible by 3 * num_heads = {3 * num_heads}, "
                         f"got weight of shape {tuple(weight.shape)}")
    if bias is not None:
        check_float(op, "bias", bias)
        check_shape(op, "bias", bias, (weight.shape[0],))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: expected {name} on x's device {x.device}, got {t.device}")
        if t is not None and t.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"{op}: expected {name} with x's dtype {x.dtype} (outside autocast), got {t.dtype}")
    check_kernel_device(op, x)
    head_dim = weight.shape[0] // (3 * num_heads)
    _check_head_dim(op, head_dim)
    return head_dim


def _check_separate(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t)
        check_ndim(op, name, t, 4)
    if not (q.shape == k.shape == v.shape) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: expected q, k, v of one shape (B, H, N, D) and dtype, got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    if q.shape[2] < 1:
        raise ValueError(f"{op}: expected at least one token, got q of shape {tuple(q.shape)}")
    _check_head_dim(op, q.shape[-1])


def _split_packed(qkv: torch.Tensor, num_heads: int):
    """(B, H, N, D) views of q, k, v inside the packed (B, N, 3 * H * D) qkv (no copy)."""
    B, N, width = qkv.shape
    return qkv.view(B, N, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _heads_view(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H * D) -> (B, H, N, D) view (reshape semantics, so an expanded grad also works)."""
    return t.unflatten(-1, (num_heads, t.shape[-1] // num_heads)).transpose(1, 2)


def _dropout_args(dropout_p: float) -> tuple[bool, int, float]:
    """(draw a mask at all, the 8-bit threshold t, the scale 1 / (1 - t / 256) of kept values, 0 when t == 256)."""
    threshold = dropout_threshold(dropout_p)
    return threshold > 0, threshold, (0.0 if threshold >= 256 else 256.0 / (256 - threshold))


def _launch_fwd(q, k, v, out, lse, scale: float, dropout_p: float, seed: int) -> None:
    """out (B, H, M, D) and lse (B, H, M) of the first M = out.shape[2] query rows (M <= N)."""
    B, H, N, D = q.shape
    q_len = out.shape[2]
    precision, arch = dot_input_precision(q.dtype), gpu_arch(q.device)
    dropout, threshold, inv_keep = _dropout_args(dropout_p)

    def launch(cfg: Tile) -> None:
        block_d, tail = _block_dims(D, cfg.split)
        _attention_fwd_kernel[attention_grid(B * H, q_len, cfg.block_m)](
            out, lse, q, k, v, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, N, D, q_len, scale, threshold, inv_keep, seed,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_D_TAIL=tail, DROPOUT=dropout,
            INPUT_PRECISION=precision, TAIL_N=LAST_STEP, PEEL=cfg.peel, HEAD_ALIGN=_head_align(q, k, v, out),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    static = attention_config(N, D, q.dtype, arch, precision, dropout).fwd
    # q_len < N (the last block's class-token query) is its own tuning entry: it must not pick the full launches'
    launch(_tuning.choose("attention_fwd", (bucket(N), D, str(q.dtype), arch, precision, dropout, q_len == N),
                          _fwd_candidates(static), launch, q.device))


def _launch_bwd(do, q, k, v, out, lse, dq, dk, dv, scale: float, dropout_p: float, seed: int,
                bias_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """One launch writes dq, dk, dv (which share one stride layout). With ``bias_dtype`` (the qkv bias's
    gradient is wanted) its programs also write fp32 column partials of dk, dv and dq into the three
    slabs of one (3, G, H * D) buffer (G = B * tiles), and ``sum_partials`` (one launch) returns
    d(bias) (3 * H * D,) in that dtype. out, dO and lse may hold the first M < N query rows only (the
    forward's): the other rows of dq are written as zeros."""
    B, H, N, D = q.shape
    q_len = out.shape[2]
    precision, arch = dot_input_precision(q.dtype), gpu_arch(q.device)
    dropout, threshold, inv_keep = _dropout_args(dropout_p)

    def launch(cfg: AttentionConfig) -> Optional[torch.Tensor]:
        block_d, tail = _block_dims(D, cfg.dq.split)
        partial = None if bias_dtype is None else _empty((3, B * cdiv(N, cfg.dq.block_m), H * D),
                                                         torch.float32, q.device)
        slabs = (None, None, None) if partial is None else partial.unbind(0)
        _attention_bwd_kernel[attention_grid(B * H, N, cfg.dq.block_m)](
            dq, dk, dv, *slabs, q, k, v, out, do, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *do.stride(), *dq.stride(),
            H, N, D, q_len, scale, threshold, inv_keep, seed,
            BLOCK=cfg.dq.block_m, KV_BLOCK_M=cfg.dkdv.block_m, Q_BLOCK_N=cfg.dq.block_n,
            BLOCK_D=block_d, BLOCK_D_TAIL=tail, DROPOUT=dropout, INPUT_PRECISION=precision,
            BIAS_GRAD=partial is not None, TAIL=LAST_STEP, PEEL=cfg.dq.peel,
            HEAD_ALIGN=_head_align(q, k, v, out, do, dq, dk, dv),
            num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages)
        return None if partial is None else sum_partials(partial, bias_dtype).view(-1)
    static = attention_config(N, D, q.dtype, arch, precision, dropout)
    return launch(_tuning.choose("attention_bwd", (bucket(N), D, str(q.dtype), arch, precision, dropout,
                                                   bias_dtype is not None, q_len == N), _bwd_candidates(static),
                                 launch, q.device))


@functools.lru_cache(maxsize=None)
def _fwd_candidates(static: Tile) -> tuple[Tile, ...]:
    return tuple(_tuning.tile_candidates(static))


@functools.lru_cache(maxsize=None)  # asked on every backward launch: built once per config
def _bwd_candidates(static: AttentionConfig) -> tuple[AttentionConfig, ...]:
    """The static backward config, then: the rows each program owns halved (both phases), the q rows per
    dK/dV step halved, the k/v rows per dQ step halved, the warps doubled (both phases share the launch)."""
    dkdv, dq = static.dkdv, static.dq
    pairs = [(dkdv, dq)]
    if dq.block_m >= 32:
        pairs.append((replace(dkdv, block_n=dkdv.block_n // 2), replace(dq, block_m=dq.block_m // 2)))
    if dkdv.block_m >= 32:
        pairs.append((replace(dkdv, block_m=dkdv.block_m // 2), dq))
    if dq.block_n >= 32:
        pairs.append((dkdv, replace(dq, block_n=dq.block_n // 2)))
    if dq.num_warps < 8:
        pairs.append((replace(dkdv, num_warps=8), replace(dq, num_warps=8)))
    return tuple(AttentionConfig(static.fwd, d, q) for d, q in pairs)


# Custom ops: torch.compile(fullgraph=True) traces through them; the autograd Functions call them.
@torch.library.custom_op("vit_fast::attention_fwd", mutates_args=())
def attention_fwd(qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
                  seed: Optional[torch.Tensor], query_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward: qkv (B, N, 3 * H * D) -> (out (B, M, H * D), lse (B, H, M) fp32) for the first
    M = query_rows queries (every token still a key and value). Inputs were validated by the calling
    functional."""
    B, N, width = qkv.shape
    D = width // (3 * num_heads)
    out = _empty((B, query_rows, num_heads * D), qkv.dtype, qkv.device)
    lse = _empty((B, num_heads, query_rows), torch.float32, qkv.device)
    _launch_fwd(*_split_packed(qkv, num_heads), _heads_view(out, num_heads), lse, scale, dropout_p,
                seed_value(seed))
    return out, lse


@attention_fwd.register_fake
def _(qkv, num_heads, scale, dropout_p, seed, query_rows):
    B, N, width = qkv.shape
    return qkv.new_empty((B, query_rows, width // 3)), qkv.new_empty((B, num_heads, query_rows), dtype=torch.float32)


@torch.library.custom_op("vit_fast::attention_bwd", mutates_args=())
def attention_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, qkv_bias: Optional[torch.Tensor], out: torch.Tensor,
                  lse: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
                  seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed backward: (dqkv, dbias). dqkv is one (B, N, 3 * H * D) gradient with dQ, dK, dV written
    into its three slices (dQ zero past the forward's query rows, out.shape[1]); with ``qkv_bias`` (the bias
    already inside qkv: only its presence and dtype
    matter here) dbias (3 * H * D,) in the bias dtype is the sum of dqkv over batch and tokens, else an
    empty tensor (custom ops cannot return None)."""
    check_kernel_device("attention_bwd", grad_out, qkv, qkv_bias, out, lse)
    if grad_out.shape != out.shape:
        raise ValueError(f"attention_bwd: expected grad_out of shape {tuple(out.shape)}, got {tuple(grad_out.shape)}")
    dqkv = _empty(qkv.shape, qkv.dtype, qkv.device)
    dbias = _launch_bwd(_heads_view(grad_out, num_heads), *_split_packed(qkv, num_heads), _heads_view(out, num_heads),
                        lse, *_split_packed(dqkv, num_heads), scale, dropout_p, seed_value(seed),
                        None if qkv_bias is None else qkv_bias.dtype)
    return dqkv, qkv.new_empty(0) if dbias is None else dbias


@attention_bwd.register_fake
def _(grad_out, qkv, qkv_bias, out, lse, num_heads, scale, dropout_p, seed):
    return torch.empty_like(qkv), qkv.new_empty(0) if qkv_bias is None else torch.empty_like(qkv_bias)


@torch.library.custom_op("vit_fast::attention_qkv_fwd", mutates_args=())
def attention_qkv_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float,
                      seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Separate (B, H, N, D) q, k, v of any strides -> (out (B, H, N, D) contiguous, lse (B, H, N)).
    Inputs were validated by ``attention_qkv``."""
    B, H, N, D = q.shape
    out = _empty((B, H, N, D), q.dtype, q.device)
    lse = _empty((B, H, N), torch.float32, q.device)
    _launch_fwd(q, k, v, out, lse, scale, dropout_p, seed_value(seed))
    return out, lse


@attention_qkv_fwd.register_fake
def _(q, k, v, scale, dropout_p, seed):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("vit_fast::attention_qkv_bwd", mutates_args=())
def attention_qkv_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, scale: float, dropout_p: float,
                      seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_kernel_device("attention_qkv_bwd", grad_out, q, k, v, out, lse)
    if grad_out.shape != q.shape:
        raise ValueError(f"attention_qkv_bwd: expected grad_out of shape {tuple(q.shape)}, got {tuple(grad_out.shape)}")
    dq, dk, dv = (_empty(q.shape, q.dtype, q.device) for _ in range(3))
    _launch_bwd(grad_out, q, k, v, out, lse, dq, dk, dv, scale, dropout_p, seed_value(seed))
    return dq, dk, dv


@attention_qkv_bwd.register_fake
def _(grad_out, q, k, v, out, lse, scale, dropout_p, seed):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))


def _check_attention(op: str, qkv: torch.Tensor, num_heads: int, dropout_p: float, scale: float | None) -> int:
    """Every check of the packed functionals, once per call; returns head_dim."""
    head_dim = _check_packed(op, qkv, num_heads)
    _check_dropout(op, dropout_p)
    _check_scale(op, scale)
    check_kernel_device(op, qkv)
    return head_dim


# ----------------------------------------------------------------------------------------- autograd
class AttentionFunction(torch.autograd.Function):
    """qkv_bias: the qkv Linear's bias already inside qkv (added by the GEMM with the bias detached), or
    None. It is an input only so that the backward returns its gradient, from the kernel's partials."""

    @staticmethod
    def forward(ctx, qkv, qkv_bias, num_heads, scale, dropout_p, seed, query_rows):
        out, lse = run_op(attention_fwd, qkv, num_heads, scale, dropout_p, seed, query_rows)
        ctx.save_for_backward(qkv, qkv_bias, out, lse, seed)
        ctx.set_materialize_grads(False)  # no zero-filled grad for the non-differentiable lse
        ctx.args = (num_heads, scale, dropout_p)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        qkv, qkv_bias, out, lse, seed = ctx.saved_tensors
        dqkv, dbias = run_op(attention_bwd, grad_out, qkv, qkv_bias, out, lse, *ctx.args, seed)
        return dqkv, (dbias if qkv_bias is not None else None), None, None, None, None, None


class AttentionQKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, dropout_p, seed):
        out, lse = run_op(attention_qkv_fwd, q, k, v, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, seed)
        ctx.set_materialize_grads(False)  # no zero-filled grad for the non-differentiable lse
        ctx.args = (scale, dropout_p)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        *tensors, seed = ctx.saved_tensors
        return *run_op(attention_qkv_bwd, grad_out, *tensors, *ctx.args, seed), None, None, None


# --------------------------------------------------------------------------------------- functional
def _dropout_and_seed(dropout_p: float, training: bool) -> tuple[float, Optional[torch.Tensor]]:
    """(p, seed): a ``next_seed()`` tensor only when dropout is active (else None, nothing drawn).
    dropout_p was checked by the caller."""
    p = float(dropout_p) if training else 0.0
    return p, (next_seed() if dropout_threshold(p) > 0 else None)


def _attention_with_lse(qkv: torch.Tensor, num_heads: int, head_dim: int, scale: float | None, dropout_p: float,
                        training: bool, qkv_bias: torch.Tensor | None = None,
                        query_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed path after validation (done once, by the public functional that calls this)."""
    p, seed = _dropout_and_seed(dropout_p, training)
    scale = head_dim**-0.5 if scale is None else float(scale)
    rows = qkv.shape[1] if query_rows is None else query_rows
    return AttentionFunction.apply(qkv, qkv_bias, num_heads, scale, p, seed, rows)


def attention_with_lse(qkv: torch.Tensor, num_heads: int, scale: float | None = None, dropout_p: float = 0.0,
                       training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` that also returns the fp32 log-sum-exp (B, H, N) for ``attention_probs``."""
    head_dim = _check_attention("attention", qkv, num_heads, dropout_p, scale)
    return _attention_with_lse(qkv, num_heads, head_dim, scale, dropout_p, training)


def attention(qkv: torch.Tensor, num_heads: int, scale: float | None = None, dropout_p: float = 0.0,
              training: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v from the packed qkv (B, N, 3 * H * D) -> (B, N, H * D).

    ``dropout_p`` (in [0, 1], applied when ``training``) is quantised to a multiple of 1/256: the kernels
    drop t / 256 of the probabilities, t = round(256 p) (p = 0.1 -> 26/256), and scale the rest by
    1 / (1 - t / 256); ``dropout_rate(p)`` returns the rate applied. The same holds for every functional
    here (``attention_linear``, ``attention_qkv``, ``attention_with_lse``)."""
    head_dim = _check_attention("attention", qkv, num_heads, dropout_p, scale)
    return _attention_with_lse(qkv, num_heads, head_dim, scale, dropout_p, training)[0]


def attention_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                     scale: float | None = None, dropout_p: float = 0.0, training: bool = False,
                     return_lse: bool = False, query_rows: int | None = None):
    """The qkv Linear then ``attention``: attention(F.linear(x, weight, bias), num_heads) -> (B, N, H * D), or
    (B, M, H * D) with ``query_rows`` = M.

    The bias rides in the GEMM's epilogue (cuBLAS; under autocast cast like eager's, so qkv is bitwise
    eager timm's) and its gradient comes from the attention backward's column partials, not from a
    separate sum over d(qkv): the Linear sees the bias detached, the attention Function returns d(bias).
    ``return_lse``: also return the fp32 log-sum-exp (B, H, N), (B, H, M) with query_rows, for
    ``attention_probs`` (which needs all N rows, so no query_rows, and takes
    the biased qkv, F.linear(x, weight, bias)). ``query_rows`` = M: only the first M tokens' output,
    (B, M, H * D), bitwise ``attention_linear(...)[:, :M]``; every token is still a key and value, the
    kernels skip the other queries (the last block under class-token pooling needs token 0 only)."""
    head_dim = _check_linear("attention_linear", x, weight, bias, num_heads)
    _check_dropout("attention_linear", dropout_p)
    _check_scale("attention_linear", scale)
    _check_query_rows("attention_linear", query_rows, x.shape[1])
    qkv = F.linear(x, weight, None if bias is None else bias.detach())  # contiguous (B, N, 3 * H * D)
    grad_bias = bias if bias is not None and bias.requires_grad and torch.is_grad_enabled() else None
    out, lse = _attention_with_lse(qkv, num_heads, head_dim, scale, dropout_p, training, grad_bias, query_rows)
    return (out, lse) if return_lse else out


def attention_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v for (B, H, N, D) tensors of any strides -> (B, H, N, D)."""
    _check_separate("attention_qkv", q, k, v)
    _check_dropout("attention_qkv", dropout_p)
    _check_scale("attention_qkv", scale)
    check_kernel_device("attention_qkv", q, k, v)
    p, seed = _dropout_and_seed(dropout_p, training)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return AttentionQKVFunction.apply(q, k, v, scale, p, seed)[0]


def attention_probs(qkv: torch.Tensor, lse: torch.Tensor, num_heads: int, scale: float | None = None,
                    rows=None) -> torch.Tensor:
    """Exact attention probabilities (before dropout) recomputed from the forward's lse.

    Returns fp32 (B, H, len(rows), N) for the chosen query rows (e.g. rows=[0], the class token),
    or the full (B, H, N, N) map when rows is None. Runs in tiles; nothing but the result is stored.
    Pass the same ``qkv`` as to ``attention_with_lse`` (for ``attention_linear``: the biased
    F.linear(x, weight, bias)).
    """
    head_dim = _check_packed("attention_probs", qkv, num_heads)
    check_kernel_device("attention_probs", qkv, lse)
    B, N, _ = qkv.shape
    if lse.shape != (B, num_heads, N) or lse.dtype != torch.float32:
        raise ValueError(f"attention_probs: expected lse of shape {(B, num_heads, N)} and dtype float32, "
                         f"got {tuple(lse.shape)} {lse.dtype}")
    rows = torch.arange(N) if rows is None else torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    if rows.numel() and (rows.min() < 0 or rows.max() >= N):
        raise ValueError(f"attention_probs: expected rows in [0, {N}), got {rows.tolist()}")
    rows = rows.to(device=qkv.device, dtype=torch.int64)
    lse = lse.contiguous()
    scale = head_dim**-0.5 if scale is None else float(scale)
    q, k, _ = _split_packed(qkv, num_heads)
    R = rows.numel()
    probs = _empty((B, num_heads, R, N), torch.float32, qkv.device)
    if R == 0:
        return probs
    precision = dot_input_precision(qkv.dtype)
    cfg = attention_config(N, head_dim, qkv.dtype, gpu_arch(qkv.device), precision).dq
    block_m = min(cfg.block_m, max(16, next_power_of_2(R)))
    _attention_probs_kernel[attention_grid(B * num_heads, R, block_m)](
        probs, q, k, lse, rows, *q.stride(), *k.stride(), num_heads, N, head_dim, R, scale,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block_d(head_dim),
        INPUT_PRECISION=precision, HEAD_ALIGN=_head_align(q, k), num_warps=cfg.num_warps)
    return probs


def attention_dropout_mask(seed: int, batch: int, num_heads: int, seq_len: int, dropout_p: float,
                           device="cpu") -> torch.Tensor:
    """Test helper: the bool keep mask (B, H, N, N) the kernels draw for ``seed`` (small sizes only); rate
    ``dropout_rate(dropout_p)``. Drawn in tiles of another shape than the training kernels' on purpose:
    the mask depends only on (seed, b * H + h, i, j)."""
    keep = _empty((batch * num_heads, seq_len, seq_len), torch.int8, torch.device(device))
    block_m = 16
    _attention_dropout_mask_kernel[(cdiv(seq_len, block_m), batch * num_heads)](
        keep, seq_len, dropout_threshold(dropout_p), seed, BLOCK_M=block_m, BLOCK_N=32)
    return keep.view(batch, num_heads, seq_len, seq_len).bool()


# ---------------------------------------------------------------------------------------- reference
def attention_qkv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      dropout_p: float = 0.0, training: bool = False, dropout_mask: torch.Tensor | None = None):
    """Eager attention as timm computes it, in the inputs' dtype. ``dropout_mask`` (bool keep mask)
    replaces the random draw, so a test can hand the reference the kernel's exact mask."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    rate = dropout_rate(dropout_p)  # the kernels' rate: p quantised to a multiple of 1/256
    if dropout_mask is not None:
        attn = attn * dropout_mask * (0.0 if rate >= 1.0 else 1.0 / (1.0 - rate))
    elif training and rate > 0.0:
        attn = torch.nn.functional.dropout(attn, rate)
    return attn @ v


def attention_ref(qkv: torch.Tensor, num_heads: int, scale: float | None = None, dropout_p: float = 0.0,
                  training: bool = False, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``attention``: timm's split of the packed qkv, eager attention, (B, N, H * D)."""
    B, N, width = qkv.shape
    q, k, v = qkv.reshape(B, N, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)
    out = attention_qkv_ref(q, k, v, scale, dropout_p, training, dropout_mask)
    return out.transpose(1, 2).reshape(B, N, width // 3)


def attention_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                         scale: float | None = None, dropout_p: float = 0.0, training: bool = False,
                         dropout_mask: torch.Tensor | None = None, query_rows: int | None = None) -> torch.Tensor:
    """Reference for ``attention_linear``: timm's qkv Linear, then ``attention_ref`` (its first query_rows)."""
    out = attention_ref(F.linear(x, weight, bias), num_heads, scale, dropout_p, training, dropout_mask)
    return out if query_rows is None else out[:, :query_rows]


# ------------------------------------------------------------------------------ ahead-of-time specs
_FLOAT_ARGS = ("scale", "inv_keep")


def _launch_values(tokens: int, num_heads: int, head_dim: int) -> dict[str, int]:
    """Integer arguments of a packed-layout launch (qkv (B, N, 3HD), out/dO (B, N, HD))."""
    N, H, D = tokens, num_heads, head_dim
    values = dict(num_heads=H, seq_len=N, q_len=N, head_dim=D, num_rows=1)
    for t in "qkvd":  # q, k, v and the packed gradient: (B, H, N, D) view of a (B, N, 3HD) tensor
        values.update({f"stride_{t}b": N * 3 * H * D, f"stride_{t}h": D, f"stride_{t}n": 3 * H * D, f"stride_{t}d": 1})
    for t in "og":  # out and dO: (B, H, N, D) view of a (B, N, HD) tensor
        values.update({f"stride_{t}b": N * H * D, f"stride_{t}h": D, f"stride_{t}n": H * D, f"stride_{t}d": 1})
    return values


_BIAS_GRAD_ARGS = ("PQ", "PK", "PV")  # the qkv bias's gradient partials: None without BIAS_GRAD


def _aot_spec(name, fn, dtype, constexprs, tile, note, values, has_dot, bias_grad=False):
    """Type every argument of ``fn`` as a launch of the packed path types it: tensors in ``dtype``
    (lse/delta/probs/partials fp32, Rows i64), ints i32, floats fp32; unit strides become constexpr 1
    and multiples of 16 are listed in divisible_by_16, both as Triton specialises a real launch.
    Without ``bias_grad`` the partials are constexpr None. head_dim is a constexpr; HEAD_ALIGN is what
    ``_head_align`` finds for the packed layout (its batch and head strides are multiples of D)."""
    head_align = next(a for a in (16, 8, 4, 2, 1) if values["head_dim"] % a == 0)
    constexprs = dict(constexprs, head_dim=values["head_dim"], HEAD_ALIGN=head_align,
                      **{a: 1 for a in fn.arg_names if values.get(a) == 1 and a.startswith("stride_")})
    if "BIAS_GRAD" in fn.arg_names:
        constexprs["BIAS_GRAD"] = bias_grad
        if not bias_grad:
            constexprs.update({a: None for a in _BIAS_GRAD_ARGS})
    width = values["num_heads"] * values["head_dim"]
    elem = torch.empty((), dtype=dtype).element_size()
    aligned = {a: width * elem % 16 == 0 for a in ("K", "V", "DK", "DV")}  # k, v inside qkv / dqkv
    aligned.update(PK=width * 4 % 16 == 0, PV=width * 4 % 16 == 0)  # slabs 1, 2 of the (3, G, H * D) partials
    pointer_types = dict(Lse="*fp32", Delta="*fp32", P="*fp32", Rows="*i64", PQ="*fp32", PK="*fp32", PV="*fp32")
    signature, divisible = {}, []
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg[0].isupper():  # a pointer
            signature[arg] = pointer_types.get(arg, "*" + TRITON_DTYPE_NAMES[dtype])
            if aligned.get(arg, True):
                divisible.append(arg)
        elif arg in _FLOAT_ARGS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if values.get(arg, 1) % 16 == 0:
                divisible.append(arg)
    return AotSpec(name=name, fn=fn, signature=signature, constexprs=constexprs, num_warps=tile.num_warps,
                   num_stages=tile.num_stages, has_dot=has_dot, note=note,
                   divisible_by_16=tuple(divisible))


def aot_specs(tokens: int, width: int, num_heads: int, dtype: torch.dtype, arch: int, **_) -> list[AotSpec]:
    """Every launch the config table makes for one ViT attention layer: training with and without
    attention dropout, the backward with and without the qkv bias's gradient partials, the
    attention-map kernel, and for fp32 both dot precisions (IEEE, the default, runs on FMA units, so
    only tf32 entries are expected to use tensor cores). The d(qkv_bias) reduction is bias_gelu's
    ``sum_partials`` at width 3 * C (the same BLOCK_N=256 build its own specs list for C)."""
    D = width // num_heads
    values = _launch_values(tokens, num_heads, D)
    specs = []
    for precision in ("ieee", "tf32") if dtype == torch.float32 else ("ieee",):
        tensor_cores = dtype != torch.float32 or precision == "tf32"
        for dropout in (False, True):
            cfg = attention_config(tokens, D, dtype, arch, precision, dropout)
            note = f"N={tokens} D={D} dropout={dropout}"
            common = lambda tile: dict(zip(("BLOCK_D", "BLOCK_D_TAIL"), _block_dims(D, tile.split)),  # noqa: E731
                                       DROPOUT=dropout, INPUT_PRECISION=precision, PEEL=tile.peel)
            specs.append(_aot_spec("attention_fwd", _attention_fwd_kernel, dtype,
                                   dict(common(cfg.fwd), BLOCK_M=cfg.fwd.block_m, BLOCK_N=cfg.fwd.block_n,
                                        TAIL_N=LAST_STEP), cfg.fwd,
                                   note, values, tensor_cores))
            bwd = dict(common(cfg.dq), BLOCK=cfg.dq.block_m, KV_BLOCK_M=cfg.dkdv.block_m, Q_BLOCK_N=cfg.dq.block_n,
                       TAIL=LAST_STEP)
            for bias_grad in (False, True):
                specs.append(_aot_spec("attention_bwd", _attention_bwd_kernel, dtype, bwd, cfg.dq,
                                       f"{note} qkv_bias_grad={bias_grad} dkdv={cfg.dkdv.block_n}x{cfg.dkdv.block_m} "
                                       f"dq={cfg.dq.block_m}x{cfg.dq.block_n}", values, tensor_cores, bias_grad))
        cfg = attention_config(tokens, D, dtype, arch, precision)
        specs.append(_aot_spec("attention_probs", _attention_probs_kernel, dtype,
                               dict(BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n, BLOCK_D=_block_d(D),
                                    INPUT_PRECISION=precision), cfg.dq,
                               f"N={tokens} D={D} attention maps", values, tensor_cores))
    return specs
