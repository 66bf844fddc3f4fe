"""Block sizes of the attention kernels: the flash family's ``AttentionConfig`` (forward tile, backward phases)
and the short-sequence family's ``ShortConfig``, each picked by one function from a small explicit table."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .._utils import cdiv, next_power_of_2
from .._utils import input_precision as dot_input_precision
from .common import MAX_GRID


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


@dataclass(frozen=True)
class StoredDsConfig:
    """The backward in two launches, a candidate of the autotuner: dK, dV with dS stored for every (q row, key)
    (``_attention_bwd_dkdv_kernel``, ``dkdv``'s tiles), then dQ = scale * dS K from the stored dS
    (``_attention_bwd_dq_stored_kernel``, ``dq``'s: block_m q rows owned, block_n keys per step). S and dP are
    computed once per tile pair instead of in both phases; dS costs a (q_len x N) workspace per head in the inputs'
    dtype (rows padded to ``stored_ds_row``), written once and read once. Offered where the workspace stays small
    (``stored_ds_fits``)."""

    dkdv: Tile
    dq: Tile

    @staticmethod
    def of(cfg: AttentionConfig) -> "StoredDsConfig":
        return StoredDsConfig(cfg.dkdv, cfg.dq)


# The stored-dS backward's limits: ViT lengths (224 px at patch 14 / 16, 384 px at patch 16: up to 577 tokens) and
# a workspace of at most 512 MiB, held through the backward of one block (ViT-B/16 at batch 256: 256 x 12 x 197 x
# 208 bf16 = 252 MB; 384 px at batch 64: 64 x 12 x 577 x 592 bf16 = 525 MB).
STORED_DS_MAX_TOKENS = 640
STORED_DS_MAX_BYTES = 512 << 20


def stored_ds_row(seq_len: int) -> int:
    """The dS workspace's row length: the keys rounded up to 16, so every row starts 16-element aligned and the
    kernels store and load it in vectors (at N = 197 unpadded rows make every access 2 bytes wide: the dK/dV loop
    compiles to 422 instructions per step on sm_90 against 273 padded, the dQ loop 175 against 94)."""
    return cdiv(seq_len, 16) * 16


def stored_ds_fits(batch_heads: int, q_len: int, seq_len: int, element_size: int) -> bool:
    """Whether the stored-dS backward is offered for this launch (``StoredDsConfig``)."""
    workspace = batch_heads * q_len * stored_ds_row(seq_len) * element_size
    return seq_len <= STORED_DS_MAX_TOKENS and workspace <= STORED_DS_MAX_BYTES


def attention_config(seq_len: int, head_dim: int, dtype: torch.dtype, arch: int,
                     input_precision: str | None = None, dropout: bool = False) -> AttentionConfig:
    """Block sizes per (N, D, dtype, arch, dropout on or off): a small explicit table, no autotuning.

    ``vit-fast report`` compiles every entry for sm_80 and sm_90, with and without dropout, and prints its
    registers and spills. The tiles were sized when the kernels still added the qkv bias and wrote its
    gradient's partials themselves (the notes below are from then); they now hold fewer live values, and
    larger tiles are worth timing on a GPU before any change. fp32 depends on the dot
    precision (default: the torch tf32 flag): IEEE fp32 dots run on the FMA units and need smaller
    tiles than tf32 ones. The backward's two phases share one launch, hence one warp count.
    Short sequences clamp the tiles to N rounded up to a power of two (>= 16), which only lowers
    register use.

    16-bit backward on sm_90, head_dim <= 64: each program owns 128 rows (two warpgroups, 8 warps, 2 stages)
    and steps over 32 q rows in dK/dV and 64 keys in dQ, so every dot is a wgmma of N >= 32 (the former
    64 rows owned with 16-row steps gave 64x16 wgmma tiles; its main loops read 53-56% in ``vit-fast
    report``'s SASS ceiling, these 86-92% without dropout and 44-46% with it, no spills at 173-246
    registers; with the full tiles unmasked, 100% and 50-59%). 64x64 steps at 4 warps spilled with the
    partials, at 8 warps they split into 64x32 wgmma tiles (68%); 128x64 steps spill with dropout. Wider heads
    keep the small tiles: 64-row steps with a 128-wide head spill hundreds of bytes.

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


# ---------------------------------------------------------------------------- short-sequence family
# What one program of the short kernels holds in registers, without and with attention dropout: at most this many
# padded rows (``short_segments``) and rows x BLOCK_D elements (q, dO and the fp32 dQ of the whole head in the
# backward; the per-row scores of every segment grow with the rows alone): the largest held without spilling on
# sm_80 and sm_90 (`vit-fast report`; tests/test_attention_short.py compiles the edges). ViT-B/16's 197 tokens pad
# to 208 rows. Beyond it the forward is the flash kernels' and the backward streams the q rows (``dq_workspace``).
# With dropout 128 rows: 144 (128 + 16) spill 8 B on sm_80 under triton 3.6 with the bias partials, the seed being
# read from the device.
SHORT_CAPACITY = {False: (208, 208 * 64), True: (128, 128 * 64)}
# The streamed backward's limit: N rounded up to 16 at most 640 rows, and those rows times BLOCK_D at most 640 x 64
# elements (640 tokens up to head_dim 64, 320 up to 128: 257 at 224 px / patch 14, 577 at 384 px / patch 16). Each
# program in flight keeps its head's fp32 dQ workspace (N x BLOCK_D x 4 B, 148 KB at 577 x 64) re-read once per key
# block, so the heads in flight (about two per SM) stay inside a 50 MB L2 only up to about this size; longer heads
# run the flash kernels, whose dQ stays in registers.
SHORT_STREAMED = (640, 640 * 64)
SHORT_DTYPES = (torch.float16, torch.bfloat16)  # fp32 tiles take twice the registers: the flash kernels run them


@dataclass(frozen=True)
class ShortConfig:
    segments: tuple[int, ...]  # 1 to 3 powers of two (>= 16) covering N: keys in the forward, q rows in the backward
    # block_m q rows per program, block_n the keys held (sum of the segments); no loop, one stage. None: the head
    # does not fit (``SHORT_CAPACITY``) and the flash forward runs
    fwd: Tile | None
    # held (``fwd`` given): block_m the q rows held (one program per (image, head)), block_n keys per step;
    # streamed (``dq_workspace``): block_n keys held per outer step, block_m q rows per inner step
    bwd: Tile

    @property
    def dq_workspace(self) -> bool:
        """The backward streams the q rows and sums dQ in an fp32 workspace (the head does not fit one program)."""
        return self.fwd is None

    def segment_constexprs(self, prefix: str) -> dict[str, int]:
        """The segments as the kernels' constexprs PREFIX0..2 (KEYS in the forward, ROWS in the backward), 0 where
        absent."""
        segments = self.segments + (0,) * (3 - len(self.segments))
        return {f"{prefix}{i}": s for i, s in enumerate(segments)}


def short_segments(seq_len: int) -> tuple[int, ...]:
    """N rounded up to 16, as at most three powers of two, largest first: 197 -> (128, 64, 16), 50 -> (64,); a
    remainder that would need a fourth is rounded up (240 -> (128, 64, 64)). Every segment but the last ends at
    least 16 rows before N rounded up to 16, so inside N."""
    rest, segments = cdiv(seq_len, 16) * 16, []
    while rest and len(segments) < 2:
        segment = 1 << (rest.bit_length() - 1)
        segments.append(segment)
        rest -= segment
    if rest:
        segments.append(next_power_of_2(rest))
    return tuple(segments)


def short_held(seq_len: int, head_dim: int, dropout: bool = False) -> bool:
    """Whether one program holds the whole head in registers (``SHORT_CAPACITY``): the short forward runs and the
    backward keeps dQ on chip; else the flash forward and the streamed backward."""
    rows, elements = SHORT_CAPACITY[bool(dropout)]
    held = sum(short_segments(seq_len))
    return held <= rows and held * _block_d(head_dim) <= elements


def short_supported(seq_len: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the short kernels run this attention: 16-bit inputs, N rounded up to 16 and that times head_dim
    rounded up to a power of two within ``SHORT_STREAMED`` (the same on sm_80 and sm_90, with or without dropout,
    which only moves the switch from held to streamed: ``short_held``). Elsewhere the flash kernels run."""
    rows, elements = SHORT_STREAMED
    padded = cdiv(seq_len, 16) * 16
    return dtype in SHORT_DTYPES and padded <= rows and padded * _block_d(head_dim) <= elements


def short_refusal(seq_len: int, head_dim: int, dtype: torch.dtype) -> str:
    """Why the short kernels cannot run this attention ('' where ``short_supported``): what they expected."""
    if short_supported(seq_len, head_dim, dtype):
        return ""
    rows, elements = SHORT_STREAMED
    return (f"attention: the short-sequence kernels run one program per head: expected fp16 or bf16 inputs, N "
            f"rounded up to 16 at most {rows} and that times head_dim rounded up to a power of two at most "
            f"{elements} ({rows} tokens up to head_dim 64, {elements // 128} up to 128); got N={seq_len}, "
            f"head_dim={head_dim} ({cdiv(seq_len, 16) * 16} x {_block_d(head_dim)}), {dtype}. The flash kernels "
            f"(kernel='flash') run any N")


@functools.lru_cache(maxsize=None)
def short_config(seq_len: int, head_dim: int, dtype: torch.dtype, arch: int, dropout: bool = False) -> ShortConfig:
    """Static sizes of the short kernels (not yet timed on a GPU; their registers, spills and SASS ceilings are in
    docs/gpu-readiness.md). Raises ValueError outside ``short_supported``. Where one program holds the head
    (``short_held``): the forward takes 64 q rows per program (fewer for fewer tokens), on 8 warps where the head is
    large; the backward's program of 8 warps steps over 32 keys at a time up to 128 rows, else (and with dropout)
    over 16, which is what fits the registers; sm_90 prefetches no k/v tile ahead (one stage reads a higher SASS
    ceiling there than two; a GPU decides which is faster). Beyond it the flash forward runs and the streamed
    backward holds 128 keys at head_dim 33-64 (64 otherwise, 32 for wide heads with dropout on sm_80) and steps
    over 16 q rows on 8 warps; on sm_90 at head_dim > 32, 32 rows (but 16 for wide heads without dropout); one
    stage with dropout at head_dim > 32: the largest steps without spills."""
    refusal = short_refusal(seq_len, head_dim, dtype)
    if refusal:
        raise ValueError(refusal)
    segments = short_segments(seq_len)
    if not short_held(seq_len, head_dim, dropout):
        block_d = _block_d(head_dim)
        # sm_80 32 x 128: 8-80 B spills; sm_90 with dropout: 16-row steps read 39-40%, two stages spill 8 B
        rows = 32 if arch >= 90 and block_d >= 64 and (dropout or block_d == 64) else 16
        stages = 1 if dropout and block_d >= 64 else 2  # sm_80 with dropout at 2 stages: 8 B spills on triton 3.6
        # heads narrower than 64 hold 64 keys too: at 128 their dropout builds spill 144-240 B on sm_90
        keys = 128 if block_d == 64 else 64
        if arch < 90 and dropout and block_d > 64:  # 64 keys: 8 B spills with the bias partials on triton 3.6
            keys = 32
        return ShortConfig(segments=segments, fwd=None, bwd=Tile(rows, keys, 8, stages))
    rows = sum(segments)
    held = rows * _block_d(head_dim)
    keys = 32 if not dropout and rows <= 128 else 16
    return ShortConfig(segments=segments,
                       fwd=Tile(min(64, next_power_of_2(rows)), rows, 4 if held <= 128 * 64 else 8, 1),
                       bwd=Tile(rows, keys, 8, 2 if not dropout and arch < 90 else 1))
