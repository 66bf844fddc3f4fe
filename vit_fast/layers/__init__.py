"""Building blocks of the Vision Transformer, each with a reference and a fused Triton path, one file per part:
norm.py (LayerNorm, the residual join), patch_embed.py, attention.py, mlp.py (Mlp and the SwiGLU MLPs),
block.py (Block, LayerScale, DropPath), attention_pool.py (SigLIP's head), pos_embed.py, common.py. Which
implementation each part runs is the model's route (vit_fast/route.py), handed to the parts in one place.

Module and parameter names follow timm exactly (patch_embed.proj, blocks.N.attn.qkv, mlp.fc1, ls1.gamma,
...) so timm state dicts load unchanged. Every module takes ``backend`` ('auto' | 'triton' | 'torch', see
vit_fast/backend.py) and keeps it in ``self.backend``; the path is chosen per call from the input tensor.

The fused path (GEMMs stay in torch / cuBLAS, every elementwise and normalisation step is a kernel):
  - PatchEmbed: one ``patch_embed`` launch (conv as an im2col GEMM + bias);
  - LayerNorm: ``layer_norm``; ``LayerNorm.join`` = residual join + this norm in one ``add_layer_norm``;
  - Attention: ``attention_linear``: the qkv GEMM (its bias in cuBLAS's epilogue) -> ``attention`` straight
    on the packed (B, N, 3HD) qkv, whose backward also returns the qkv bias's gradient -> proj GEMM;
  - Mlp: ``linear_act``: fc1 as a Triton GEMM with bias + activation (and its derivative) in the epilogue, once
    per element; fc2 and the weight gradients on cuBLAS; the activation's derivative multiplies in the epilogue
    of fc2's dgrad GEMM, which also writes the fc1 bias's gradient partials;
  - Block.forward_pair(hidden, residual, next_norm): blocks pass (hidden = the next LayerNorm's output,
    residual = the stream) between them, as FlashAttention's ViT does. Each part's ``branch`` stops before
    its output bias; the bias and dropout rate (the part's ``join_terms``), LayerScale's gamma and the
    per-sample drop-path scale ride in the residual-join kernel, which also computes the following
    LayerNorm (norm2, then the next block's norm1 or the final norm).
Routed through reference ops, also on the fused path (documented, never silently different):
qk_norm attention (split heads + q/k LayerNorm + SDPA), Mlp drop1 > 0 (``bias_gelu``, F.dropout, fc2 GEMM),
a non-Identity Mlp norm, attention maps (``Attention.attention_probs``); at model level pos_drop > 0
(F.dropout on the tokens), pooling, fc_norm (the layer_norm kernel) and the head.
Drop-path: the per-sample keep decision is drawn in torch (``DropPath.sample_scale``, B values) and
applied inside the join kernel. torch.compile(fullgraph=True) traces all of it (the kernels are torch
custom ops), dropout included: the kernels' seed is a CPU tensor drawn in the graph from torch's
generator (a fresh mask per call, reproducible under torch.manual_seed), read only inside the ops.
"""
from .attention import Attention
from .attention_pool import AttentionPoolLatent
from .block import Block, DropPath, LayerScale, drop_path
from .common import (
    bias_left_to_join,
    has_hooks,
    init_weights_vit_timm,
    linear_without_bias,
    named_apply,
    to_2tuple,
    trunc_normal_,
)
from .mlp import (
    QUICK_GELU_ALPHA,
    Mlp,
    MlpJoin,
    QuickGELU,
    SwiGLUMlp,
    SwiGLUPackedMlp,
    fuses_swiglu,
    make_mlp,
    quick_gelu,
    quick_gelu_grad,
)
from .norm import LayerNorm, layer_norm, layer_norm_with_input, reads_norm, residual_join
from .patch_embed import PatchEmbed
from .pos_embed import resample_abs_pos_embed, sincos_2d_pos_embed

__all__ = [
    "Attention", "AttentionPoolLatent", "Block", "DropPath", "LayerNorm", "LayerScale", "Mlp", "MlpJoin", "PatchEmbed",
    "QUICK_GELU_ALPHA", "QuickGELU", "SwiGLUMlp", "SwiGLUPackedMlp", "bias_left_to_join", "drop_path", "fuses_swiglu",
    "has_hooks", "init_weights_vit_timm", "layer_norm", "layer_norm_with_input", "linear_without_bias", "make_mlp",
    "named_apply", "quick_gelu", "quick_gelu_grad", "reads_norm", "resample_abs_pos_embed", "residual_join",
    "sincos_2d_pos_embed", "to_2tuple", "trunc_normal_",
]
