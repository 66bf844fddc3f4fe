"""Fused patch embedding: im2col GEMM + conv bias + class/register tokens + position embedding.

Eager ViT embeds patches with a strided Conv2d, flattens and transposes the feature map, concatenates
the class/register tokens and adds the position embedding (timm ``PatchEmbed`` + ``_pos_embed``).
Here the forward is one launch (plus the weight's cast to the compute dtype under autocast, as eager's) and
the backward two (three when the images need a gradient; plus dtokens' cast to the compute dtype when the
tokens are wider, as eager's cast backward).

Shapes: images (B, C, H, W), weight (D, C, P, P) in Conv2d layout and pos_embed (1, L, D), any strides;
bias (D,), cls_token (1, 1, D), reg_tokens (1, R, D) or None (copied when not contiguous: a few KB).
Hp, Wp = H/P, W/P, Np = Hp*Wp patches, prefix = [cls] + R, tokens (B, prefix + Np, D) ordered
[cls, regs..., patches] exactly as timm's ``_pos_embed``. ``pos_embed_covers_prefix`` (timm: not ``no_embed_class``):
L = prefix + Np and every token gets its row; otherwise L = Np and the prefix tokens carry none.

Forward (one launch). The patch rows are a GEMM  X[m, k] @ W[k, n]  with m = b*Np + hp*Wp + wp and
k = c*P*P + py*P + px (the conv weight's (C, P, P) flattening); the A tile is gathered from the
NCHW images by pointer arithmetic (no im2col tensor), cast to the compute dtype in the load, the
accumulator is fp32, the epilogue adds bias[n] + pos_embed[prefix? + p, n] before one store at
token row prefix + p. Extra programs after the patch rows write the B*prefix prefix rows
(cls/reg + their pos_embed rows).

Backward (dY = dtokens, any strides, e.g. stride 0 from ``.sum()``):
  dW[n, k]  = sum_m dY[b, prefix+p, n] * X[m, k]   gathered again from the images, computed as the
              transposed tile X^T @ dY (pixels on the MMA's M side, n on its N side); the m axis is cut
              into S fixed chunks, each program writes fp32 partials, a reduction kernel sums the S
              partials in order (deterministic, no atomics). The row offsets of the gather advance by
              BLOCK_M per step with carries (no div/mod by Np, Wp inside the loop); where every row block is
              alike whole patch rows (224 px at P = 14: 64 rows = 4 patch rows), the offsets inside a block
              are loop-invariant and only the block's scalar start carries. dbias[n] = sum_m dY[m, n]:
              one extra program per n-block and split in the same launch, partials summed alike.
              With 16-bit compute a library candidate (``LibraryDweight``) times beside the kernel's tiles: the
              patches gathered once into a (B, T, K) matrix, dW = dY^T @ patches on cuBLAS with fp32
              accumulation and output, dbias a torch sum; one partial row, the same reduction launch after it.
  dpos[t]   = sum_b dY[b, t] (t over all tokens, or the patches only), dcls = sum_b dY[b, 0],
  dreg[r]   = sum_b dY[b, 1+r]: fixed-order batch sums, extra programs of the reduction launch.
  dX[m, k]  = sum_n dY[m, n] * W[n, k] scattered back to the pixels (patches do not overlap, so every
              pixel is written exactly once); only when the images require grad.

Dtype policy: compute dtype = the autocast dtype when autocast is on for the images' device, else the
images' dtype. fp32 images are cast in the load, the weight and bias to the compute dtype (as autocast casts
the convolution's), fp32 accumulation; tokens come out in the compute dtype or, asked for (``tokens_dtype``:
the model's fp32 residual stream under autocast), wider, the convolution's output rounded to the compute dtype
before the fp32 class token and position adds, as eager's conv then promoting add. Every gradient comes out in
its tensor's own dtype; the GEMMs' dY is rounded to the compute dtype, the batch sums' is not. fp32 dots use TF32 when
``torch.backends.cudnn.allow_tf32`` is set (PyTorch's default, as eager Conv2d does), IEEE otherwise.

Traffic per image (ViT-B/16, 224 px, B=256, bf16 autocast, fp32 images and parameters, the model's fp32
tokens; parameter traffic divided by B): forward, 1 launch, reads the image once (602 KB; the other n-blocks
re-read it from L2) and writes the fp32 tokens once (605 KB), ~1.2 MB; eager (cast images, cast weight, cast
bias, conv, cat, add: 6 launches) moves ~3.6 MB to the same tokens. Backward, 3 launches: dY's cast to bf16
(605 KB read, 303 KB written), the bf16 dY in the dW GEMM and the fp32 dY in the batch sums, the image once,
the fp32 dW partials written and read back (S=8 on sm_90: 148 KB; S=3 on sm_80: 55 KB), ~2.3 MB; eager
~3.1-3.5 MB in 5-6 launches. The saved activation is
the caller's image (eager also keeps a bf16 copy).

Limits: square patches (P x P, stride P, no padding; any P >= 1: for P <= 2 a K tile spans several
channels, as tl.dot needs K >= 16), H and W positive multiples of P, float images.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _tuning
from ._aot import TRITON_DTYPE_NAMES, AotSpec
from ._gemm import GemmTile
from ._tuning import bucket, launcher
from ._utils import (
    FLOAT_DTYPES,
    SM_COUNT,
    cdiv,
    check_float,
    check_kernel_device,
    check_ndim,
    check_shape,
    compute_dtype_for,
    first_order_only,
    gpu_arch,
    kernel_op,
    next_power_of_2,
    run_op,
)

OP = "patch_embed"


# -------------------------------------------------------------------------------------- jit kernels
# K is walked in tiles of CHANS channels x ROWS patch rows x PATCH_PAD columns (PATCH_PAD = next power of
# two >= P): tile t covers channels c0 = (t // STEPS) * CHANS ... and rows py0 = (t % STEPS) * ROWS ...
# CHANS > 1 only for P <= 2, where one channel's patch is under the 16 K-columns tl.dot needs. Inside a tile
# the pixel offsets are row-contiguous runs the compiler can vectorize (no div/mod by runtime values).
@triton.jit
def _num_tiles(C, PATCH: tl.constexpr, ROWS: tl.constexpr, CHANS: tl.constexpr):
    """K tiles per patch: channel groups x row steps."""
    return tl.cdiv(C, CHANS) * ((PATCH + ROWS - 1) // ROWS)


@triton.jit
def _tile_pixels(t, C, stride_c, stride_y, stride_x,
                 PATCH: tl.constexpr, PATCH_PAD: tl.constexpr, ROWS: tl.constexpr, CHANS: tl.constexpr):
    """(pixel offsets, valid mask, conv-weight index k = c*P*P + py*P + px) of the CHANS*ROWS*PATCH_PAD tile t."""
    STEPS: tl.constexpr = (PATCH + ROWS - 1) // ROWS
    TILE: tl.constexpr = ROWS * PATCH_PAD
    if CHANS == 1:  # one channel per tile (P >= 3): the channel is a scalar, as the compiler likes it
        c = t // STEPS
        py = (t % STEPS) * ROWS + tl.arange(0, TILE) // PATCH_PAD
        px = tl.arange(0, TILE) % PATCH_PAD
        if (PATCH == PATCH_PAD) and (PATCH % ROWS == 0):
            valid = tl.full((TILE,), 1, tl.int1)  # statically in range: keeps loads vectorizable
        else:
            valid = (py < PATCH) & (px < PATCH)
    else:  # P <= 2 (STEPS == 1): CHANS whole patches side by side, channels past C masked
        idx = tl.arange(0, CHANS * TILE)
        c = t * CHANS + idx // TILE
        py = (idx % TILE) // PATCH_PAD
        px = idx % PATCH_PAD
        valid = (py < PATCH) & (px < PATCH) & (c < C)
    return c * stride_c + py * stride_y + px * stride_x, valid, c * (PATCH * PATCH) + py * PATCH + px


@triton.jit
def _patch_rows(offs_m, Np, Wp, P: tl.constexpr, prefix, stride_b, stride_h, stride_w, stride_tb, stride_tt):
    """For patch rows m = b*Np + p: (image offset of the patch's top-left pixel, token row offset, p)."""
    b = offs_m // Np
    p = offs_m % Np
    img = b.to(tl.int64) * stride_b + ((p // Wp) * P).to(tl.int64) * stride_h + ((p % Wp) * P).to(tl.int64) * stride_w
    tok = b.to(tl.int64) * stride_tb + (prefix + p).to(tl.int64) * stride_tt
    return img, tok, p


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr):
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return tl.dot(a, b, acc)


@triton.jit
def _patch_embed_fwd_kernel(
    Out, X, W, Bias, Pos, Cls, Reg,  # tokens (B, T, D) contiguous; images; weight (D, C, P, P) in the compute dtype
    sxb, sxc, sxh, sxw,  # image strides
    swd, swc, swy, swx,  # weight strides
    spt, spd, srt,  # pos_embed strides (token, channel), reg_tokens token stride
    M, D, C, Np, Wp, T, prefix, pos_base,  # M = B*Np patch rows, T = prefix + Np tokens
    HAS_BIAS: tl.constexpr, HAS_CLS: tl.constexpr, HAS_REG: tl.constexpr, POS_PREFIX: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 dots; ignored for fp16/bf16
    PATCH: tl.constexpr, PATCH_PAD: tl.constexpr, ROWS: tl.constexpr, CHANS: tl.constexpr,  # P: a model constant
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # 1-D grid, n fastest: programs that share an image tile run together (L2 reuse of the gather).
    pid = tl.program_id(0)
    num_n = tl.cdiv(D, BLOCK_N)
    pid_m = pid // num_n
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    cdt = W.dtype.element_ty  # the compute dtype (the dots'); the tokens may be wider (fp32 residual under autocast)
    if pid_m < tl.cdiv(M, BLOCK_M):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        img, tok, p = _patch_rows(offs_m, Np, Wp, PATCH, prefix, sxb, sxh, sxw, T * D, D)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(0, _num_tiles(C, PATCH, ROWS, CHANS)):
            xpix, valid, _ = _tile_pixels(t, C, sxc, sxh, sxw, PATCH, PATCH_PAD, ROWS, CHANS)
            wpix, _, _ = _tile_pixels(t, C, swc, swy, swx, PATCH, PATCH_PAD, ROWS, CHANS)
            a = tl.load(X + img[:, None] + xpix[None, :], mask=mask_m[:, None] & valid[None, :], other=0.0)
            w = tl.load(W + offs_n[None, :] * swd + wpix[:, None], mask=valid[:, None] & mask_n[None, :], other=0.0)
            acc = _dot(a.to(cdt), w, acc, INPUT_PRECISION)
        if HAS_BIAS:  # in the compute dtype, as autocast casts the convolution's bias
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(cdt).to(tl.float32)[None, :]
        if Out.dtype.element_ty != cdt:  # the convolution's output rounds to the compute dtype before the pos add
            acc = acc.to(cdt).to(tl.float32)
        acc += tl.load(Pos + (pos_base + p)[:, None] * spt + offs_n[None, :] * spd,
                       mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        tl.store(Out + tok[:, None] + offs_n[None, :], acc.to(Out.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])
    else:
        # prefix rows r = b*prefix + j: the class token (j = 0), register tokens, their pos_embed rows
        offs_r = (pid_m - tl.cdiv(M, BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (offs_r < (M // Np) * prefix)[:, None] & mask_n[None, :]
        j = offs_r % prefix
        val = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_CLS:
            val += tl.load(Cls + offs_n[None, :] + 0 * j[:, None], mask=mask & (j == 0)[:, None], other=0.0).to(tl.float32)
        if HAS_REG:
            val += tl.load(Reg + (j - HAS_CLS)[:, None] * srt + offs_n[None, :],
                           mask=mask & (j >= HAS_CLS)[:, None], other=0.0).to(tl.float32)
        if POS_PREFIX:
            val += tl.load(Pos + j[:, None] * spt + offs_n[None, :] * spd, mask=mask, other=0.0).to(tl.float32)
        row = (offs_r // prefix).to(tl.int64) * T * D + j * D
        tl.store(Out + row[:, None] + offs_n[None, :], val.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _int64(x):
    """x as an int64 scalar (x may be a runtime i32 or a constexpr such as a unit stride)."""
    return tl.full((), 0, tl.int64) + x


@triton.jit
def _rows_start(m, Np, Wp, P: tl.constexpr, prefix, stride_b, stride_h, stride_w, stride_tb, stride_tt):
    """State of patch rows m = b*Np + hp*Wp + wp for _rows_advance_image / _rows_advance_tokens: (image offset,
    hp, wp, token offset, p = hp*Wp + wp); the only divisions, once per program."""
    img, tok, p = _patch_rows(m, Np, Wp, P, prefix, stride_b, stride_h, stride_w, stride_tb, stride_tt)
    return img, p // Wp, p % Wp, tok, p


@triton.jit
def _rows_advance_image(img, hp, wp, Np, Wp, P: tl.constexpr, stride_b, stride_h, stride_w, STEP: tl.constexpr):
    """(image offset, hp, wp) of rows m + STEP from those of rows m: a mixed-radix add of STEP = (db, dh, dw)
    in digits (b, hp < Hp, wp < Wp) with two carries, no division per element. Carries multiply (not
    tl.where) so Triton still sees offsets divisible by the strides' alignment and vectorizes the loads."""
    Hp = Np // Wp
    step_h = (STEP % Np) // Wp
    step_w = (STEP % Np) % Wp
    wp += step_w
    carry_w = (wp >= Wp).to(tl.int32)
    wp -= carry_w * Wp
    hp += step_h + carry_w
    carry_h = (hp >= Hp).to(tl.int32)
    hp -= carry_h * Hp
    sb, sh, sw = _int64(stride_b), _int64(stride_h), _int64(stride_w)  # strides may be constexpr 1
    img += ((STEP // Np) * sb + (step_h * P) * sh + (step_w * P) * sw
            + carry_w.to(tl.int64) * (P * sh - (Wp * P) * sw) + carry_h.to(tl.int64) * (sb - (Hp * P) * sh))
    return img, hp, wp


@triton.jit
def _rows_advance_tokens(tok, p, Np, stride_tb, stride_tt, STEP: tl.constexpr):
    """(token offset, p) of rows m + STEP from those of rows m: p wraps at most once (STEP % Np < Np)."""
    step_p = STEP % Np
    p += step_p
    carry = (p >= Np).to(tl.int32)
    p -= carry * Np
    stb, stt = _int64(stride_tb), _int64(stride_tt)
    tok += (STEP // Np) * stb + step_p * stt + carry.to(tl.int64) * (stb - Np * stt)
    return tok, p


@triton.jit
def _patch_embed_dweight_kernel(
    Part, DY, X,  # fp32 partials (S, D*K + D), K = C*P*P; dtokens (B, T, D) any strides; images
    sdb, sdt, sdd,  # dtokens strides
    sxb, sxc, sxh, sxw,  # image strides
    M, D, K, Np, Wp, prefix, blocks_per_split,  # each split covers blocks_per_split row blocks
    HAS_BIAS: tl.constexpr,
    ALIGNED_BLOCKS: tl.constexpr,  # _aligned_blocks(Np, Wp, BLOCK_M): row blocks are alike whole patch rows
    INPUT_PRECISION: tl.constexpr,
    PATCH: tl.constexpr, PATCH_PAD: tl.constexpr, ROWS: tl.constexpr, CHANS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # grid (n-blocks x (k-tiles + HAS_BIAS), S): program (n, t, s) owns dW[n-block, k-tile t] over split s of the
    # patches; with a bias, program t = k-tiles of each n-block sums dbias[n-block] over the split instead
    pid = tl.program_id(0)
    split = tl.program_id(1)
    C = K // (PATCH * PATCH)
    num_t = _num_tiles(C, PATCH, ROWS, CHANS)
    pid_n = pid // (num_t + HAS_BIAS)
    pid_t = pid % (num_t + HAS_BIAS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    m_begin = split * blocks_per_split * BLOCK_M
    m_end = tl.minimum(m_begin + blocks_per_split * BLOCK_M, M)
    row = Part + split.to(tl.int64) * (D * K + D)
    offs_m = m_begin + tl.arange(0, BLOCK_M)
    img, hp, wp, tok, p = _rows_start(offs_m, Np, Wp, PATCH, prefix, sxb, sxh, sxw, sdb, sdt)
    if pid_t < num_t:
        # dW^T tile (pixels x n) = X^T (pixels x m) @ dY (m x n): the pixels are the MMA's M side, n its N side
        # (wide wgmma tiles on sm_90). Row offsets advance by BLOCK_M per step without div/mod (_rows_advance_*).
        pix, valid, offs_k = _tile_pixels(pid_t, C, sxc, sxh, sxw, PATCH, PATCH_PAD, ROWS, CHANS)
        cdt = DY.dtype.element_ty
        acc = tl.zeros((CHANS * ROWS * PATCH_PAD, BLOCK_N), dtype=tl.float32)
        if ALIGNED_BLOCKS:
            # every row block is the same whole patch rows (or piece of one) of one image: the offsets inside a
            # block are loop-invariant and only the block's scalar start advances (no per-row carries, no row mask)
            j = tl.arange(0, BLOCK_M)
            x_offs = (((j // Wp) * PATCH) * sxh + ((j % Wp) * PATCH) * sxw)[None, :] + pix[:, None]
            dy_offs = (j * sdt)[:, None] + offs_n[None, :] * sdd
            img0, hp0, wp0, tok0, p0 = _rows_start(m_begin, Np, Wp, PATCH, prefix, sxb, sxh, sxw, sdb, sdt)
            for m0 in range(m_begin, m_end, BLOCK_M):
                dy = tl.load(DY + tok0 + dy_offs, mask=mask_n[None, :], other=0.0)
                xt = tl.load(X + img0 + x_offs, mask=valid[:, None], other=0.0)
                acc = _dot(xt.to(cdt), dy, acc, INPUT_PRECISION)
                img0, hp0, wp0 = _rows_advance_image(img0, hp0, wp0, Np, Wp, PATCH, sxb, sxh, sxw, BLOCK_M)
                tok0, p0 = _rows_advance_tokens(tok0, p0, Np, sdb, sdt, BLOCK_M)
        else:
            for m0 in range(m_begin, m_end, BLOCK_M):
                mask_m = m0 + tl.arange(0, BLOCK_M) < m_end
                dy = tl.load(DY + tok[:, None] + offs_n[None, :] * sdd, mask=mask_m[:, None] & mask_n[None, :],
                             other=0.0)
                xt = tl.load(X + img[None, :] + pix[:, None], mask=valid[:, None] & mask_m[None, :], other=0.0)
                acc = _dot(xt.to(cdt), dy, acc, INPUT_PRECISION)
                img, hp, wp = _rows_advance_image(img, hp, wp, Np, Wp, PATCH, sxb, sxh, sxw, BLOCK_M)
                tok, p = _rows_advance_tokens(tok, p, Np, sdb, sdt, BLOCK_M)
        tl.store(row + offs_n[None, :] * K + offs_k[:, None], acc, mask=valid[:, None] & mask_n[None, :])
    else:
        # dbias[n] = sum_m dY[m, n]: once per n-block (not per k-tile), elementwise fp32 sums, one tl.sum at the end
        sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for m0 in range(m_begin, m_end, BLOCK_M):
            mask_m = m0 + tl.arange(0, BLOCK_M) < m_end
            sums += tl.load(DY + tok[:, None] + offs_n[None, :] * sdd, mask=mask_m[:, None] & mask_n[None, :],
                            other=0.0).to(tl.float32)
            tok, p = _rows_advance_tokens(tok, p, Np, sdb, sdt, BLOCK_M)
        tl.store(row + D * K + offs_n, tl.sum(sums, axis=0), mask=mask_n)


@triton.jit
def _patch_embed_reduce_kernel(
    DW, DBias, DPos, DCls, DReg,  # gradients, contiguous, each in its parameter's dtype
    Part, DY,  # fp32 partials (S, D*K + D); dtokens (B, T, D) any strides
    sdb, sdt, sdd,  # dtokens strides
    S, B, D, K, T, prefix, pos_base,  # pos_base = 0 when pos_embed covers the prefix, else prefix
    HAS_DW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CLS: tl.constexpr, HAS_REG: tl.constexpr,
    BLOCK: tl.constexpr, BATCH_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_DW:
        num_w = tl.cdiv(D * K + D, BLOCK)
    else:  # frozen projection: only the batch sums
        num_w = 0
    if pid < num_w:
        # dW and dbias: sum the S partial rows in split order
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < D * K + D
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, S):
            acc += tl.load(Part + s * (D * K + D) + offs, mask=mask, other=0.0)
        tl.store(DW + offs, acc.to(DW.dtype.element_ty), mask=offs < D * K)
        if HAS_BIAS:
            tl.store(DBias + (offs - D * K), acc.to(DBias.dtype.element_ty), mask=mask & (offs >= D * K))
    else:
        # dpos / dcls / dreg: sums over the batch of the token gradient, element e = t*D + n; BATCH_TILE
        # images per step keep several loads in flight, one tl.sum at the end fixes the order
        WIDTH: tl.constexpr = BLOCK // BATCH_TILE
        elems = (pid - num_w) * WIDTH + tl.arange(0, WIDTH)  # (names differ from the other branch's:
        in_range = elems < T * D                               #  Triton merges same-named values)
        t = elems // D
        n = elems % D
        src = DY + (t.to(tl.int64) * sdt + n * sdd)[None, :]
        tile = tl.zeros((BATCH_TILE, WIDTH), dtype=tl.float32)
        for b0 in range(0, B, BATCH_TILE):
            rows = b0 + tl.arange(0, BATCH_TILE)
            tile += tl.load(src + rows.to(tl.int64)[:, None] * sdb, mask=(rows < B)[:, None] & in_range[None, :],
                            other=0.0).to(tl.float32)
        sums = tl.sum(tile, axis=0)
        tl.store(DPos + (elems - pos_base * D), sums.to(DPos.dtype.element_ty), mask=in_range & (t >= pos_base))
        if HAS_CLS:
            tl.store(DCls + n, sums.to(DCls.dtype.element_ty), mask=in_range & (t == 0))
        if HAS_REG:
            tl.store(DReg + (elems - HAS_CLS * D), sums.to(DReg.dtype.element_ty),
                     mask=in_range & (t >= HAS_CLS) & (t < prefix))


@triton.jit
def _patch_embed_dimages_kernel(
    DX, DY, W,  # image gradient (images' dtype); dtokens any strides; weight (D, C, P, P)
    sdb, sdt, sdd,  # dtokens strides
    sgb, sgc, sgh, sgw,  # image-gradient strides
    swd, swc, swy, swx,  # weight strides
    M, D, C, Np, Wp, prefix,
    INPUT_PRECISION: tl.constexpr,
    PATCH: tl.constexpr, PATCH_PAD: tl.constexpr, ROWS: tl.constexpr, CHANS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program (m-block, k-tile t): dX[m-block, tile t] = dY[m-block, :] @ W[:, tile t], scattered to pixels
    pid = tl.program_id(0)
    num_t = _num_tiles(C, PATCH, ROWS, CHANS)
    offs_m = (pid // num_t) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    img, tok, p = _patch_rows(offs_m, Np, Wp, PATCH, prefix, sgb, sgh, sgw, sdb, sdt)
    wpix, valid, _ = _tile_pixels(pid % num_t, C, swc, swy, swx, PATCH, PATCH_PAD, ROWS, CHANS)
    cdt = DY.dtype.element_ty
    acc = tl.zeros((BLOCK_M, CHANS * ROWS * PATCH_PAD), dtype=tl.float32)
    for n0 in range(0, D, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < D
        dy = tl.load(DY + tok[:, None] + offs_n[None, :] * sdd, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        w = tl.load(W + offs_n[:, None] * swd + wpix[None, :], mask=mask_n[:, None] & valid[None, :], other=0.0)
        acc = _dot(dy, w.to(cdt), acc, INPUT_PRECISION)
    gpix, _, _ = _tile_pixels(pid % num_t, C, sgc, sgh, sgw, PATCH, PATCH_PAD, ROWS, CHANS)
    tl.store(DX + img[:, None] + gpix[None, :], acc.to(DX.dtype.element_ty), mask=mask_m[:, None] & valid[None, :])


# ------------------------------------------------------------------------------------------ configs
# Per arch and compute-dtype width: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of each GEMM.
# M = patches, N = width D, K = pixels per patch. fwd tiles (M, N) over K; dweight tiles (N, K) over M
# (split into S chunks); dimages tiles (M, K) over N. fp32 compute (IEEE dots run on FMA units, TF32
# on tensor cores) uses smaller tiles so the fp32 operands stay in registers without spills.
_CONFIGS = {
    (80, 2): dict(fwd=(128, 128, 32, 8, 3), dweight=(64, 128, 64, 8, 3), dimages=(128, 64, 64, 4, 3)),
    (90, 2): dict(fwd=(128, 128, 64, 8, 3), dweight=(64, 256, 64, 8, 3), dimages=(256, 64, 64, 8, 3)),
    (80, 4): dict(fwd=(64, 64, 32, 4, 2), dweight=(32, 64, 64, 4, 2), dimages=(64, 32, 64, 4, 2)),
    (90, 4): dict(fwd=(64, 64, 32, 4, 2), dweight=(32, 64, 64, 4, 2), dimages=(64, 32, 64, 4, 2)),
}
# Images whose strides are not all multiples of 16 elements (DINOv2's 518 px rows): Triton cannot prove the gathered
# pixel runs aligned, so each pixel of the A / dX tile keeps its own address registers and the 16-bit tiles above
# spill (sm_80 fwd and dimages, sm_90 fwd and dimages). These entries replace those kernels' tiles there: fewer pixels
# per thread (a shorter K tile in the forward; twice the warps for dimages, on sm_90 over the same 256 rows);
# fp32 stays as above. dweight: each thread gathers its pixels one by one, each patch row with its own offset carries,
# so fewer rows per step (BLOCK_M) and a wider n side (BLOCK_N) spread that cost over more MMA work.
_CONFIGS_UNALIGNED_IMAGES = {
    (80, 2): dict(fwd=(128, 128, 16, 8, 3), dweight=(16, 256, 64, 8, 3), dimages=(128, 64, 64, 8, 3)),
    (90, 2): dict(fwd=(128, 128, 32, 8, 3), dweight=(32, 512, 64, 8, 3), dimages=(256, 64, 64, 16, 3)),
}
# The 16-bit forward with fp32 tokens ({aligned: tile}): the table's 128 x 128 tiles spill at patch 14 (sm_80 16 B,
# sm_90 32-104 B; `vit-fast report`, triton 3.8). sm_90 halves the K step (0 spills, SASS ceiling 73% at patch 14,
# 100% at 16), sm_80 and unaligned images halve the columns (0 spills; sm_80 79% / 100%; on sm_90 a 64-column
# tile reads 52% at patch 14).
_WIDE_TOKENS_FWD = {
    (80, 2): {True: (128, 64, 32, 8, 3), False: (128, 64, 16, 8, 3)},
    (90, 2): {True: (128, 128, 32, 8, 3), False: (128, 64, 32, 8, 3)},
}
_REDUCE = (1024, 8, 8, 1)  # batch sums: 8 x 128 tiles
_DW_PROGRAMS_PER_SM = 2  # the dW split fills the GPU with ~2 programs per SM (_utils.programs_to_fill)


def images_aligned(strides) -> bool:
    """Whether every image stride is 1 or a multiple of 16 elements, as Triton specialises integer arguments
    (224 px: yes; 518 px rows: no): picks the table of patch_embed_config."""
    return all(s == 1 or s % 16 == 0 for s in strides)


@dataclass(frozen=True)
class ReduceTile:
    """The batch-sum kernel's launch: ``block`` outputs per program, ``batch_tile`` images per step."""
    block: int
    batch_tile: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PatchEmbedConfig:
    """Launch parameters of every patch-embedding kernel: a GemmTile per GEMM (fwd tiles (M, N) over K;
    dweight (N, K) over M; dimages (M, K) over N), the batch-sum tile, and the SM count the dW split fills."""
    fwd: GemmTile
    dweight: GemmTile
    dimages: GemmTile
    reduce: ReduceTile
    num_sms: int


def patch_embed_config(arch: int, dtype: torch.dtype, aligned: bool = True,
                       tokens_dtype: Optional[torch.dtype] = None) -> PatchEmbedConfig:
    """Launch parameters of every kernel for a GPU arch (80|90), compute dtype and image alignment
    (``images_aligned`` of the strides the kernel gathers from or scatters to); a table (autotuning may try
    the fwd, dweight and dimages tiles' variants, vit_fast/kernels/_tuning.py). ``tokens_dtype`` (default the
    compute dtype): wider tokens than the GEMM's, fp32 from a 16-bit GEMM (the model under autocast), hold twice
    the epilogue's bytes per output (``_WIDE_TOKENS_FWD``)."""
    key = (arch, 4 if dtype == torch.float32 else 2)
    table = dict(_CONFIGS[key], **({} if aligned else _CONFIGS_UNALIGNED_IMAGES.get(key, {})))
    if tokens_dtype is not None and tokens_dtype.itemsize > dtype.itemsize and key in _WIDE_TOKENS_FWD:
        table["fwd"] = _WIDE_TOKENS_FWD[key][aligned]
    return PatchEmbedConfig(**{kernel: GemmTile(*entry) for kernel, entry in table.items()},
                            reduce=ReduceTile(*_REDUCE), num_sms=SM_COUNT[arch])


@dataclass(frozen=True)
class LibraryDweight:
    """The dW GEMM on the GPU's BLAS library (cuBLAS): a candidate of the ``patch_embed_dweight`` choice beside the
    kernel's tiles, for 16-bit compute (the kernel measured 2.5 ms at ViT-B/16 b256 on an H200, 23 TFLOP/s:
    docs/measured/nvidia-h200-2026-11-27.md). The autotuner times both on the user's GPU; the kernel stays the static
    choice until a GPU measures this faster (PREDICTED about 0.2 ms: a 59 GFLOP GEMM plus one 230 MB copy)."""
    library: str = "cublas"


LIBRARY_DWEIGHT = LibraryDweight()
# inside ``with library_dweight_only():`` every 16-bit dW launch (of any thread) takes the library route
library_dweight_only = _tuning.ProcessSwitch()


def _dweight_candidates(tile: GemmTile, dtype: torch.dtype) -> list:
    """The kernel's tiles, then (16-bit compute only: fp32 would follow a different TF32 flag than the
    convolution's) the library GEMM."""
    if dtype not in (torch.float16, torch.bfloat16):
        return _candidates(tile)
    return [LIBRARY_DWEIGHT] if library_dweight_only.on else _candidates(tile) + [LIBRARY_DWEIGHT]


def _dweight_by_library(dtokens: torch.Tensor, images: torch.Tensor, patch: int, prefix: int,
                        has_bias: bool) -> torch.Tensor:
    """``LibraryDweight``'s (1, D*K + D) fp32 partial row: dW (D, K) in the weight's (C, P, P) order, then dbias
    (left unwritten without a bias, where the reduction does not read it). The patches are copied once into a
    (B, T, C, P, P) matrix in dtokens' dtype whose prefix rows are zero, so the GEMM reads dtokens as it lies (a
    (B * T, D) view) rather than a copy of its patch rows; the few zero rows cost prefix / Np of the GEMM."""
    B, C, H, W = images.shape
    T, D = dtokens.shape[1], dtokens.shape[2]
    P, Hp, Wp = patch, H // patch, W // patch
    K = C * P * P
    patches = torch.empty((B, T, C, P, P), dtype=dtokens.dtype, device=images.device)
    patches[:, :prefix].zero_()
    gathered = images.unflatten(2, (Hp, P)).unflatten(4, (Wp, P)).permute(0, 2, 4, 1, 3, 5)  # (B, Hp, Wp, C, P, P)
    patches[:, prefix:].view(B, Hp, Wp, C, P, P).copy_(gathered)
    dy, rows = dtokens.reshape(B * T, D), patches.view(B * T, K)
    partial = torch.empty((1, D * K + D), dtype=torch.float32, device=images.device)
    if images.is_cuda:  # fp32 accumulation and output in cuBLAS, as the kernel's
        partial[0, :D * K].view(D, K).copy_(torch.mm(dy.t(), rows, out_dtype=torch.float32))
    else:  # CPU (the interpreter's tests): the same products of 16-bit values, summed in fp32
        torch.mm(dy.t().float(), rows.float(), out=partial[0, :D * K].view(D, K))
    if has_bias:
        torch.sum(dtokens[:, prefix:], dim=(0, 1), dtype=torch.float32, out=partial[0, D * K:])
    return partial


def _dweight_split(M: int, D: int, k_tiles: int, tile: GemmTile, num_sms: int) -> tuple[int, int]:
    """(S, row blocks per split): a fixed cut of the patch axis for the dW partials (depends on shape only)."""
    tiles = cdiv(D, tile.block_n) * k_tiles
    m_blocks = cdiv(M, tile.block_m)
    splits = min(m_blocks, max(1, cdiv(_DW_PROGRAMS_PER_SM * num_sms, tiles)))
    per_split = cdiv(m_blocks, splits)
    return cdiv(m_blocks, per_split), per_split


def _aligned_blocks(Np: int, Wp: int, block_m: int) -> bool:
    """Whether every BLOCK_M-row block of the patch axis covers the same patch positions relative to its start (whole
    patch rows of one image, or a piece of one row): then the dW gather's offsets are loop-invariant."""
    return Np % block_m == 0 and (block_m % Wp == 0 or Wp % block_m == 0)


def input_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow the flag eager Conv2d follows (cuDNN TF32, on by default in PyTorch)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cudnn.allow_tf32 else "ieee"


_MIN_DOT_K = 16  # tl.dot on NVIDIA needs K (and this kernel's tile widths) >= 16


def _gemm_launch(tile: GemmTile, dtype: torch.dtype, patch: int, in_chans: int) -> tuple[dict, dict, int]:
    """(constexprs, launch options, K tiles per patch) of a GEMM kernel: a K tile is CHANS channels x ROWS
    patch rows x PATCH_PAD columns, ROWS * PATCH_PAD ~ the table's BLOCK_K; CHANS > 1 only where one
    channel's padded patch is under 16 columns (P <= 2)."""
    pad = next_power_of_2(patch)
    rows = min(max(1, tile.block_k // pad), pad)
    chans = max(1, _MIN_DOT_K // (rows * pad))  # powers of two: CHANS * ROWS * PATCH_PAD >= 16
    constexprs = dict(INPUT_PRECISION=input_precision(dtype), PATCH=patch, PATCH_PAD=pad, ROWS=rows, CHANS=chans,
                      BLOCK_M=tile.block_m, BLOCK_N=tile.block_n)
    k_tiles = cdiv(in_chans, chans) * cdiv(patch, rows)
    return constexprs, dict(num_warps=tile.num_warps, num_stages=tile.num_stages), k_tiles


# ------------------------------------------------------------ validation and launchers (custom ops)
def _check_float_dtype(dtype: torch.dtype, what: str = "compute dtype") -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{OP}: expected a {what} in (float32, float16, bfloat16), got {dtype}")


def _check_inputs(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix,
                  dtypes=FLOAT_DTYPES) -> int:
    """Validate shapes and dtypes (ValueError naming what was expected); returns the token count."""
    for name, t in (("images", images), ("weight", weight), ("bias", bias), ("pos_embed", pos_embed),
                    ("cls_token", cls_token), ("reg_tokens", reg_tokens)):
        if t is not None or name not in ("bias", "cls_token", "reg_tokens"):
            check_float(OP, name, t, dtypes)
    check_ndim(OP, "images (B, C, H, W)", images, 4)
    check_ndim(OP, "weight (D, C, P, P)", weight, 4)
    D, C, P, P2 = weight.shape
    if P != P2:
        raise ValueError(f"{OP}: expected a square patch weight (D, C, P, P), got shape {tuple(weight.shape)}")
    B, C_img, H, W = images.shape
    if C_img != C:
        raise ValueError(f"{OP}: images have {C_img} channels but the weight expects in_chans={C}")
    if H < P or W < P:
        raise ValueError(f"{OP}: expected images of at least one patch (H >= P and W >= P), got {H}x{W} "
                         f"for patch size {P}")
    if H % P or W % P:
        raise ValueError(f"{OP}: image size {H}x{W} is not divisible by the patch size {P}")
    if bias is not None:
        check_shape(OP, "bias", bias, (D,))
    prefix = 0
    if cls_token is not None:
        check_shape(OP, "cls_token", cls_token, (1, 1, D))
        prefix += 1
    if reg_tokens is not None:
        check_ndim(OP, "reg_tokens (1, R, D)", reg_tokens, 3)
        check_shape(OP, "reg_tokens", reg_tokens, (1, reg_tokens.shape[1], D))
        prefix += reg_tokens.shape[1]
    num_patches = (H // P) * (W // P)
    covered = prefix + num_patches if pos_embed_covers_prefix else num_patches
    what = "prefix + patches" if pos_embed_covers_prefix else "patches only (pos_embed_covers_prefix=False)"
    if tuple(pos_embed.shape) != (1, covered, D):
        raise ValueError(f"{OP}: expected pos_embed of shape (1, {covered}, {D}) ({what}: {prefix} prefix "
                         f"tokens + {H // P}x{W // P} patches), got {tuple(pos_embed.shape)}")
    return prefix + num_patches


@kernel_op("vit_fast::patch_embed_fwd")
def patch_embed_fwd(images: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    pos_embed: torch.Tensor, cls_token: Optional[torch.Tensor], reg_tokens: Optional[torch.Tensor],
                    pos_embed_covers_prefix: bool, compute_dtype: torch.dtype,
                    tokens_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Tokens (B, prefix + Np, D) in tokens_dtype (default compute_dtype), the GEMM in compute_dtype; one launch."""
    T = _check_inputs(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix)
    _check_float_dtype(compute_dtype)
    tokens_dtype = tokens_dtype or compute_dtype
    _check_float_dtype(tokens_dtype, "tokens_dtype")
    device = check_kernel_device(OP, images, weight, bias, pos_embed, cls_token, reg_tokens)
    B, C, H, W = images.shape
    D, _, P, _ = weight.shape
    Np, Wp = (H // P) * (W // P), W // P
    prefix, M = T - Np, B * Np
    # the kernel reads bias, cls_token and reg_tokens rows with unit channel stride (images, weight and
    # pos_embed go through their strides): copy strided or expanded (stride-0) views, a no-op otherwise
    bias, cls_token, reg_tokens = (t.contiguous() if t is not None else None for t in (bias, cls_token, reg_tokens))
    gemm_weight = weight.to(compute_dtype)  # as autocast casts the convolution's weight (a no-op without autocast)
    out = torch.empty((B, T, D), dtype=tokens_dtype, device=device)
    arch = gpu_arch(device)

    def launch(tile: GemmTile) -> None:
        consts, opts, _ = _gemm_launch(tile, compute_dtype, P, C)
        rows = cdiv(M, consts["BLOCK_M"]) + cdiv(B * prefix, consts["BLOCK_M"])
        grid = (rows * cdiv(D, consts["BLOCK_N"]),)
        launcher(_patch_embed_fwd_kernel, grid)(
            out, images, gemm_weight, bias if bias is not None else weight, pos_embed,
            cls_token if cls_token is not None else weight, reg_tokens if reg_tokens is not None else weight,
            *images.stride(), *gemm_weight.stride(), pos_embed.stride(1), pos_embed.stride(2),
            reg_tokens.stride(1) if reg_tokens is not None else 0,
            M, D, C, Np, Wp, T, prefix, prefix if pos_embed_covers_prefix else 0,
            HAS_BIAS=bias is not None, HAS_CLS=int(cls_token is not None), HAS_REG=reg_tokens is not None,
            POS_PREFIX=pos_embed_covers_prefix and prefix > 0, **consts, **opts)
    aligned = images_aligned(images.stride())
    # the fp32 dot precision too (cudnn.allow_tf32): tf32 and IEEE dots favour other tiles
    key = (bucket(M), D, C, P, str(images.dtype), str(compute_dtype), input_precision(compute_dtype), str(tokens_dtype),
           arch, T - Np, aligned)
    tiles = _candidates(patch_embed_config(arch, compute_dtype, aligned, tokens_dtype).fwd)
    launch(_tuning.choose("patch_embed_fwd", key, tiles, launch, device))
    return out


def _candidates(tile: GemmTile) -> list[GemmTile]:
    return _tuning.tile_candidates(tile, ("block_m", "block_n"), stages="num_stages")


@patch_embed_fwd.register_fake
def _(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix, compute_dtype,
      tokens_dtype=None):
    T = _check_inputs(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix)
    return images.new_empty((images.shape[0], T, weight.shape[0]), dtype=tokens_dtype or compute_dtype)


def _grad_shapes(images, weight, bias, pos_embed, cls_token, reg_tokens, needs_dimages, needs_proj_grads):
    """(shape, dtype) of [dW, dbias, dpos, dcls, dreg, dimages]; absent gradients are empty tensors."""
    def like(t, present=True):
        return (tuple(t.shape), t.dtype) if t is not None and present else ((0,), weight.dtype)
    return [like(weight, needs_proj_grads), like(bias, needs_proj_grads), like(pos_embed), like(cls_token),
            like(reg_tokens), like(images, needs_dimages)]


@kernel_op("vit_fast::patch_embed_bwd")
def patch_embed_bwd(dtokens: torch.Tensor, images: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    pos_embed: torch.Tensor, cls_token: Optional[torch.Tensor], reg_tokens: Optional[torch.Tensor],
                    pos_embed_covers_prefix: bool, needs_dimages: bool, needs_proj_grads: bool = True,
                    compute_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """[dweight, dbias, dpos_embed, dcls_token, dreg_tokens, dimages], each in its tensor's dtype (an
    absent tensor, dimages when not needed, dweight/dbias for a frozen projection give empty tensors).
    One to three launches: dW/dbias partials (unless frozen), reduction + batch sums, dimages. The GEMMs (dW,
    dbias, dimages) take dtokens rounded to compute_dtype (default its own), as the convolution's gradient under
    autocast; the batch sums (dpos, dcls, dreg) take dtokens as they are."""
    T = _check_inputs(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix)
    B, C, H, W = images.shape
    D, _, P, _ = weight.shape
    check_float(OP, "dtokens", dtokens)
    check_shape(OP, "dtokens", dtokens, (B, T, D))
    device = check_kernel_device(OP, dtokens, images, weight, bias, pos_embed, cls_token, reg_tokens)
    Np, Wp, K = (H // P) * (W // P), W // P, C * P * P
    prefix, M = T - Np, B * Np
    grads = [torch.empty(s, dtype=dt, device=device)
             for s, dt in _grad_shapes(images, weight, bias, pos_embed, cls_token, reg_tokens, needs_dimages,
                                       needs_proj_grads)]
    dW, dbias, dpos, dcls, dreg, dimages = grads
    if B == 0:  # an empty batch contributes nothing (and would make an empty split of the patch axis)
        return [g.zero_() for g in grads]
    arch = gpu_arch(device)
    compute_dtype = compute_dtype or dtokens.dtype
    _check_float_dtype(compute_dtype)
    dy = dtokens.to(compute_dtype)  # the GEMMs' operand (a no-op without autocast)
    aligned = images_aligned(images.stride())  # dW gathers from the images, dimages scatters to its own strides
    cfg = patch_embed_config(arch, compute_dtype, aligned)
    key = (bucket(M), D, C, P, str(images.dtype), str(compute_dtype), input_precision(compute_dtype), arch, prefix,
           bias is not None, aligned)

    splits, partials = 0, dpos  # a frozen projection (e.g. MoCo v3) skips the dW GEMM
    if needs_proj_grads:
        def launch_dweight(tile: GemmTile | LibraryDweight) -> tuple[int, torch.Tensor]:
            if isinstance(tile, LibraryDweight):
                return 1, _dweight_by_library(dy, images, P, prefix, bias is not None)
            consts, opts, k_tiles = _gemm_launch(tile, compute_dtype, P, C)
            splits, per_split = _dweight_split(M, D, k_tiles, tile, cfg.num_sms)
            partials = torch.empty((splits, D * K + D), dtype=torch.float32, device=device)
            grid = (cdiv(D, consts["BLOCK_N"]) * (k_tiles + (bias is not None)), splits)
            launcher(_patch_embed_dweight_kernel, grid)(
                partials, dy, images, *dy.stride(), *images.stride(),
                M, D, K, Np, Wp, prefix, per_split, HAS_BIAS=bias is not None,
                ALIGNED_BLOCKS=_aligned_blocks(Np, Wp, consts["BLOCK_M"]), **consts, **opts)
            return splits, partials
        splits, partials = launch_dweight(_tuning.choose(
            "patch_embed_dweight", key, _dweight_candidates(cfg.dweight, compute_dtype), launch_dweight, device))

    red = cfg.reduce
    reduce_programs = cdiv(D * K + D, red.block) if needs_proj_grads else 0
    grid = (reduce_programs + cdiv(T * D, red.block // red.batch_tile),)
    launcher(_patch_embed_reduce_kernel, grid)(
        dW if needs_proj_grads else dpos, dbias if bias is not None and needs_proj_grads else dpos, dpos,
        dcls if cls_token is not None else dpos, dreg if reg_tokens is not None else dpos, partials, dtokens,
        *dtokens.stride(), splits, B, D, K, T, prefix, 0 if pos_embed_covers_prefix else prefix,
        HAS_DW=needs_proj_grads, HAS_BIAS=bias is not None, HAS_CLS=int(cls_token is not None),
        HAS_REG=reg_tokens is not None, BLOCK=red.block, BATCH_TILE=red.batch_tile,
        num_warps=red.num_warps, num_stages=red.num_stages)

    if needs_dimages:
        dx_aligned = images_aligned(dimages.stride())
        dx_tile = patch_embed_config(arch, compute_dtype, dx_aligned).dimages

        def launch_dimages(tile: GemmTile) -> None:
            consts, opts, k_tiles = _gemm_launch(tile, compute_dtype, P, C)
            grid = (cdiv(M, consts["BLOCK_M"]) * k_tiles,)
            launcher(_patch_embed_dimages_kernel, grid)(
                dimages, dy, weight, *dy.stride(), *dimages.stride(), *weight.stride(),
                M, D, C, Np, Wp, prefix, **consts, **opts)
        launch_dimages(_tuning.choose("patch_embed_dimages", key + (dx_aligned,), _candidates(dx_tile),
                                      launch_dimages, device))
    return grads


@patch_embed_bwd.register_fake
def _(dtokens, images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix, needs_dimages,
      needs_proj_grads=True, compute_dtype=None):
    return [images.new_empty(s, dtype=dt) for s, dt in _grad_shapes(
        images, weight, bias, pos_embed, cls_token, reg_tokens, needs_dimages, needs_proj_grads)]


# ----------------------------------------------------------------------------------------- autograd
class PatchEmbedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix, compute_dtype,
                tokens_dtype):
        ctx.save_for_backward(images, weight, bias, pos_embed, cls_token, reg_tokens)
        ctx.pos_embed_covers_prefix, ctx.compute_dtype = pos_embed_covers_prefix, compute_dtype
        return run_op(patch_embed_fwd, images, weight, bias, pos_embed, cls_token, reg_tokens,
                      pos_embed_covers_prefix, compute_dtype, tokens_dtype)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, dtokens):
        images, weight, bias, pos_embed, cls_token, reg_tokens = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dW, dbias, dpos, dcls, dreg, dimages = run_op(patch_embed_bwd,
            dtokens, images, weight, bias, pos_embed, cls_token, reg_tokens,
            ctx.pos_embed_covers_prefix, needs[0], needs[1] or needs[2], ctx.compute_dtype)
        wanted = lambda i, g: g if needs[i] else None  # noqa: E731
        return (wanted(0, dimages), wanted(1, dW), wanted(2, dbias), wanted(3, dpos), wanted(4, dcls),
                wanted(5, dreg), None, None, None)


# --------------------------------------------------------------------------------------- functional
def patch_embed(images: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pos_embed: torch.Tensor,
                cls_token: Optional[torch.Tensor] = None, reg_tokens: Optional[torch.Tensor] = None,
                pos_embed_covers_prefix: bool = True, tokens_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Conv2d patch embedding + [cls, regs...] prefix + position embedding in one kernel (module docstring).
    ``tokens_dtype``: the tokens' dtype, default the compute dtype; under autocast torch.float32 gives timm's fp32
    residual stream (its fp32 pos_embed add promotes the convolution's output, which still rounds to the compute
    dtype first)."""
    _check_inputs(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix)
    check_kernel_device(OP, images, weight, bias, pos_embed, cls_token, reg_tokens)
    compute_dtype = compute_dtype_for(images)
    _check_float_dtype(compute_dtype)
    if tokens_dtype is not None:
        _check_float_dtype(tokens_dtype, "tokens_dtype")
    return PatchEmbedFunction.apply(images, weight, bias, pos_embed, cls_token, reg_tokens,
                                    pos_embed_covers_prefix, compute_dtype, tokens_dtype)


# ---------------------------------------------------------------------------------------- reference
def patch_embed_ref(images: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pos_embed: torch.Tensor,
                    cls_token: Optional[torch.Tensor] = None, reg_tokens: Optional[torch.Tensor] = None,
                    pos_embed_covers_prefix: bool = True, tokens_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Eager reference (timm PatchEmbed + _pos_embed): conv2d -> flatten -> transpose -> cat -> add,
    returned in ``tokens_dtype``, default the compute dtype (the autocast dtype when autocast is on, else the
    images')."""
    _check_inputs(images, weight, bias, pos_embed, cls_token, reg_tokens, pos_embed_covers_prefix,
                  dtypes=FLOAT_DTYPES + (torch.float64,))
    x = F.conv2d(images, weight, bias, stride=weight.shape[-1]).flatten(2).transpose(1, 2)
    prefix = [t.expand(x.shape[0], -1, -1) for t in (cls_token, reg_tokens) if t is not None]
    if pos_embed_covers_prefix:
        x = torch.cat(prefix + [x], dim=1) + pos_embed
    else:
        x = torch.cat(prefix + [x + pos_embed], dim=1)
    return x.to(tokens_dtype or compute_dtype_for(images))


# ------------------------------------------------------------------------------ ahead-of-time specs
def aot_specs(tokens: int, width: int, dtype: torch.dtype, arch: int, patch_size: int = 16, in_chans: int = 3,
              img_size: int = 224, batch: int = 256, pos_embed_covers_prefix: bool = True,
              param_dtype: torch.dtype = torch.float32, images_dtype: torch.dtype = torch.float32,
              **_) -> list[AotSpec]:
    """Every launch of one training step's patch embedding (forward, dW/dbias partials, reduction, and
    dimages for images that require grad), for contiguous square images of ``img_size`` and a class
    token plus ``tokens - 1 - patches`` register tokens. Defaults: mixed precision (fp32 images and
    parameters, ``dtype`` compute). Integer arguments take the values this launch would pass, so unit
    strides become constexpr 1 and multiples of 16 land in divisible_by_16, as Triton specialises them."""
    P, C, D, T = patch_size, in_chans, width, tokens
    image_strides = dict(b=C * img_size * img_size, c=img_size * img_size, h=img_size, w=1)
    cfg_aligned = images_aligned(image_strides.values())  # images and dimages alike
    cfg = patch_embed_config(arch, dtype, cfg_aligned)
    Wp = img_size // P
    Np = Wp * Wp
    prefix, K, M = T - Np, C * P * P, batch * Np
    cdt, img, par = (TRITON_DTYPE_NAMES[d] for d in (dtype, images_dtype, param_dtype))
    k_tiles = _gemm_launch(cfg.dweight, dtype, P, C)[2]
    splits, per_split = _dweight_split(M, D, k_tiles, cfg.dweight, cfg.num_sms)
    values = dict(  # every integer argument of the four kernels at this launch
        {f"sx{k}": v for k, v in image_strides.items()}, **{f"sg{k}": v for k, v in image_strides.items()},
        swd=K, swc=P * P, swy=P, swx=1, spt=D, spd=1, srt=D, sdb=T * D, sdt=D, sdd=1,
        M=M, D=D, C=C, K=K, Np=Np, Wp=Wp, T=T, prefix=prefix, pos_base=0 if pos_embed_covers_prefix else prefix,
        blocks_per_split=per_split, S=splits, B=batch)
    flags = dict(HAS_BIAS=True, HAS_CLS=int(prefix > 0), HAS_REG=prefix > 1)
    note = f"N={T} D={D} P={P} C={C} {img_size}px {cdt} compute, {img} images, {par} params"
    # tokens: the model's residual stream under autocast (the parameters' dtype, fp32) or the compute dtype
    # (residual_in_fp32=False, the functional alone); the batch sums read their gradient in that dtype
    tokens = sorted({param_dtype, dtype}, key=str)
    kernels = [  # (name, kernel, pointer types, flags, config)
        *(("patch_embed_fwd", _patch_embed_fwd_kernel,
           dict(Out=TRITON_DTYPE_NAMES[out], X=img, W=cdt, Bias=par, Pos=par, Cls=par, Reg=par),
           dict(flags, POS_PREFIX=pos_embed_covers_prefix and prefix > 0),
           patch_embed_config(arch, dtype, cfg_aligned, out).fwd) for out in tokens),
        ("patch_embed_dweight", _patch_embed_dweight_kernel, dict(Part="fp32", DY=cdt, X=img),
         dict(HAS_BIAS=True, ALIGNED_BLOCKS=_aligned_blocks(Np, Wp, cfg.dweight.block_m)), cfg.dweight),
        *(("patch_embed_reduce", _patch_embed_reduce_kernel,
           dict(DW=par, DBias=par, DPos=par, DCls=par, DReg=par, Part="fp32", DY=TRITON_DTYPE_NAMES[dy]),
           dict(flags, HAS_DW=True), cfg.reduce) for dy in tokens),
        ("patch_embed_dimages", _patch_embed_dimages_kernel, dict(DX=img, DY=cdt, W=par), {}, cfg.dimages),
    ]
    specs = []
    for name, fn, pointers, constexprs, launch in kernels:
        if "PATCH" in fn.arg_names:
            constexprs = dict(constexprs, **_gemm_launch(launch, dtype, P, C)[0])
        else:
            constexprs = dict(constexprs, BLOCK=launch.block, BATCH_TILE=launch.batch_tile)
        constexprs.update({a: 1 for a in fn.arg_names if values.get(a) == 1})
        signature = {a: "constexpr" if a in constexprs else "*" + pointers[a] if a in pointers else "i32"
                     for a in fn.arg_names}
        divisible = tuple(a for a, t in signature.items() if t.startswith("*") or (t == "i32" and values[a] % 16 == 0))
        specs.append(AotSpec(name, fn, signature, constexprs, launch.num_warps, launch.num_stages,
                             has_dot=name != "patch_embed_reduce", note=note, divisible_by_16=divisible))
    return specs
