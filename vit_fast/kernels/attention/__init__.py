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
detached; its gradient d(b) = sum over batch and tokens of d(qkv) is torch's fp32 column sum of the
backward's d(qkv), returned by the attention Function in the bias's dtype, as eager's addmm backward sums
it (one extra read of d(qkv)). Written by the kernels' epilogues as per-tile partials instead, the same sums
cost 0.29 ms against 0.075 per ViT-B/16 b256 block (H200, torch 2.11, triton 3.6, 2026-11-27).

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
    _attention_bwd_dkdv_kernel, _attention_bwd_dq_stored_kernel
                             the stored-dS backward (``StoredDsConfig``, an autotuning candidate up to 640
                             tokens): the dK/dV phase writing dS to a (B * H, q_len, N) workspace, then dQ from
                             it, one dot per key step (flash_bwd.py)
    _attention_probs_kernel  attention maps: exp(S - lse) for chosen query rows, outside training
Every loop runs its full tiles without key or row masks, then what is left as one masked step, 16 wide
when at most 16 are left (ViT's 197 tokens = 3 x 64 + 5 run 208 keys per query row, not 256).
``query_rows`` = M < N (``attention_linear``; the last block under class-token pooling, M = 1) computes the
first M queries only: the forward writes (B, M, C) and lse (B, H, M), the dK/dV loop steps over M query
rows, dQ tiles past M skip their loop and write zeros.
No atomics and no program reads what another writes in the same launch: gradients are bitwise
reproducible. Launches: 1 forward, 1 backward (2 with dS stored; plus torch's column sum for the qkv bias's gradient).

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
twice the loop without dropout. The seed is a 1-element int64 tensor drawn on the
tensors' device by ``_utils.next_seed`` (``torch.manual_seed``, checkpointing and CUDA-graph replays all handle
it as any device draw), read by the kernels through a pointer (no host sync; torch.compile traces the draw, no
graph break) and saved for backward.

Limits: any N >= 1 (the last tile is masked; padded keys get exactly zero probability), head_dim
1..128 (a non-power-of-two D is padded inside the kernel with masked loads, never in memory; a 16-bit
D = 72 runs as 64 + 16 columns, see ``attention_config``).

Memory and bytes: the forward allocates only the output and the fp32 lse (B * H * N); nothing grows
with N^2 except the stored-dS backward's workspace (below). HBM traffic per token and layer,
C = H * D, e = bytes per element, counting each kernel's first touch (re-reads of one head's rows
across its tiles hit L2 at ViT sizes: the head's q, k, v, out, dO are 5 * N * D * e, 123 KB for
ViT-B):
    forward   read q, k, v (3C e), write out (C e) + lse (4H)              = 4C e + 4H   (1 launch)
    backward  read q, k, v, out, dO (5C e) + lse (4H), write dq, dk, dv (3C e) = 8C e + 4H (1 launch)
ViT-B/16 in bf16 (C = 768, H = 12): 6.2 KB per token forward, 12.3 KB backward (FlashAttention-2's
delta pre-pass, separate dK/dV and dQ kernels: 20.2 KB, 3 launches).
With the qkv bias's gradient, the column sum reads d(qkv) once more (3C e = 4.6 KB per token, as eager's
addmm backward). The forward's bias costs nothing here: it rides in the qkv GEMM's epilogue.
The stored-dS backward (``StoredDsConfig``) writes dS and reads it back: 2 * H * N' * e more per token (N' = N
rounded up to 16; ViT-B/16 bf16: 10 KB) in 2 launches, with a (B * H, q_len, N') workspace alive during the
block's backward (252 MB at ViT-B/16 b256; offered up to 512 MiB and 640 tokens).

Files (split by pass, as FlashAttention-4's flash_fwd / flash_bwd / interface):
    common.py     limits and the jit helpers every kernel shares (program map, strided head tiles)
    flash_fwd.py  the flash forward (any N), the attention-map and dropout-mask kernels
    flash_bwd.py  the flash backward, and the stored-dS backward's two kernels
    short_fwd.py  the short-sequence forward: a whole head's K and V on chip, no online softmax
    short_bwd.py  the short-sequence backwards: one program per (image, head), S and dP once per tile pair,
                  dQ held in registers or streamed through an fp32 workspace
    config.py     block sizes of both families (``AttentionConfig``, ``ShortConfig``)
    interface.py  validation, launchers, custom ops, autograd Functions, functionals, references, aot_specs
The functionals take ``kernel="flash"`` (default) or ``kernel="short"``; the attention part's route
(vit_fast/route.py) picks the family per model.

The short-sequence family (ViT lengths up to 640 tokens at head_dim 64; fp16/bf16, ``short_supported``): where a
head fits one program (``short_held``: 208 padded rows, ViT-B/16's 197 tokens), the forward holds every key of its
head in up to three power-of-two segments (197 -> 128 + 64 + 16 rows) and takes a plain softmax, and the backward
runs one program per (image, head): q, dO, lse and delta of every row loaded once, dQ of the whole head kept in
fp32, the keys stepped over with S and dP computed once per tile pair (the flash backward computes them in both of
its phases). Counted bytes: that backward reads qkv, out, dO and lse once and writes d(qkv) once (8C e + 4H per
token, with no re-reads of a head across programs); the forward re-reads k and v once per 64-row q tile. Longer
heads (257 tokens at 224 px / patch 14, 577 at 384 px / patch 16) run the flash forward and the streamed backward:
still one program per (image, head) and each tile pair once, but keys outer and q rows streamed, dQ accumulated in
an fp32 workspace that only its program touches (q, dO, lse re-read once per 128-key block). Same dropout bits and
lse as the flash kernels; no atomics; one launch per pass.
"""
from .config import (
    AttentionConfig,
    ShortConfig,
    StoredDsConfig,
    Tile,
    attention_config,
    attention_grid,
    short_config,
    short_held,
    short_supported,
)
from .interface import (
    KERNELS,
    aot_specs,
    attention,
    attention_dropout_mask,
    attention_linear,
    attention_linear_ref,
    attention_probs,
    attention_qkv,
    attention_qkv_ref,
    attention_ref,
    attention_with_lse,
    family_for,
)

__all__ = ["KERNELS", "AttentionConfig", "ShortConfig", "StoredDsConfig", "Tile", "aot_specs", "attention",
           "attention_config", "attention_dropout_mask", "attention_grid", "attention_linear", "attention_linear_ref",
           "attention_probs", "attention_qkv", "attention_qkv_ref", "attention_ref", "attention_with_lse",
           "family_for", "short_config", "short_held", "short_supported"]
