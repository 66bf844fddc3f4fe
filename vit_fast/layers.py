"""Building blocks of the Vision Transformer, each with a reference and a fused Triton path.

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
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import vit_fast.kernels.attention as attention_kernels
from vit_fast.kernels._utils import compute_dtype_for
from vit_fast.kernels.bias_gelu import bias_dropout_add, bias_gelu
from vit_fast.kernels.layer_norm import add_layer_norm, layer_norm_and_input
from vit_fast.kernels.layer_norm import layer_norm as layer_norm_kernel
from vit_fast.kernels.linear_act import linear_act
from vit_fast.kernels.patch_embed import patch_embed as patch_embed_kernel

from .adapters import effective_bias, effective_weight, fusable_linear
from .backend import BACKENDS, check_backend, check_image_batch, resolve_backend  # noqa: F401  (re-exported)
from .sdpa import packed_sdpa, split_packed


def to_2tuple(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"expected an int or a pair (H, W), got {x!r}")
        return int(x[0]), int(x[1])
    return int(x), int(x)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict) that runs the ``layer_norm`` kernel on the fused path."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: str = "auto"):
        super().__init__(dim, eps=eps)
        self.backend = check_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if resolve_backend(self.backend, x) == "triton":
            return layer_norm_kernel(x, self.weight, self.bias, self.eps)
        return super().forward(x)



def reads_norm(norm: nn.Module) -> bool:
    """Whether the fused kernels may read ``norm``'s parameters in place of calling it: an affine
    nn.LayerNorm (vit_fast's or torch's, e.g. a transformers model's) with its stock forward."""
    return (isinstance(norm, nn.LayerNorm) and type(norm).forward in (nn.LayerNorm.forward, LayerNorm.forward)
            and norm.weight is not None and norm.bias is not None)


def layer_norm_with_input(norm: nn.LayerNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x): the (hidden, residual) pair that enters a chain of fused blocks, in one kernel (the
    hidden half in the autocast dtype, as the GEMM after it wants it)."""
    return layer_norm_and_input(x, norm.weight, norm.bias, norm.eps, compute_dtype_for(x))


def layer_norm(dim: int, eps: float, backend: str = "auto") -> LayerNorm:
    return LayerNorm(dim, eps=eps, backend=backend)


def has_hooks(module: nn.Module, inside: bool = False) -> bool:
    """Whether forward or backward hooks would fire on ``module`` (with ``inside``: on any module below
    it, not counting itself), global module hooks included. The fused paths call GEMMs and kernels
    directly, so modules with hooks (FSDP2's fully_shard registers them) are run through ``__call__``.
    Asked on every forward: a plain walk of the module dicts (Module.modules() costs several times more)."""
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks
            or torch_module._global_backward_pre_hooks or torch_module._global_backward_hooks):
        return True
    stack = list(module._modules.values()) if inside else [module]
    while stack:
        m = stack.pop()
        if m is None:
            continue
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
            return True
        stack.extend(m._modules.values())
    return False


def linear_without_bias(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output GEMM of a part's branch: ``module``'s weight without its bias (the residual join adds
    it); a module the fused path cannot read (vit_fast/adapters.py) is called whole, bias included."""
    return F.linear(x, effective_weight(module)) if fusable_linear(module) else module(x)


def bias_left_to_join(module: nn.Module) -> Optional[torch.Tensor]:
    """The bias ``linear_without_bias`` left out, for the residual join (None when it called the module)."""
    return effective_bias(module) if fusable_linear(module) else None


def residual_join(branch: torch.Tensor, residual: torch.Tensor, bias: Optional[torch.Tensor],
                  gamma: Optional[torch.Tensor], sample_scale: Optional[torch.Tensor], dropout_p: float,
                  training: bool, norm: Optional[nn.LayerNorm],
                  fused: bool = True) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """new_residual = residual + sample_scale[b] * gamma * dropout(branch + bias), and with a following
    LayerNorm also ``norm(new_residual)``, in one kernel: returns (normed or None, new_residual).
    ``fused=False`` (vit_fast.tuning measured eager faster): the same with separate torch ops."""
    if not fused:
        y = branch if bias is None else branch + bias.to(branch.dtype)
        y = F.dropout(y, dropout_p, True) if training and dropout_p > 0 else y
        y = y if gamma is None else y * gamma
        y = y if sample_scale is None else y * sample_scale.view(-1, *([1] * (y.dim() - 1))).to(y.dtype)
        h = residual + y.to(residual.dtype)
        return (None if norm is None else
                F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps).to(branch.dtype)), h
    if norm is None:
        return None, bias_dropout_add(branch, bias, residual, dropout_p, training, gamma=gamma,
                                      sample_scale=sample_scale)
    return add_layer_norm(branch, residual, norm.weight, norm.bias, norm.eps, branch_bias=bias, gamma=gamma,
                          sample_scale=sample_scale, dropout_p=dropout_p, training=training)


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, H/p * W/p, D) with one strided convolution.

    With ``strict_img_size`` the input must be exactly ``img_size``; otherwise any size divisible by the
    patch works (dynamic_img_size). Bad input raises ValueError naming what was expected.
    """

    impl = "fused"  # the route's choice (vit_fast/route.py): 'fused' | 'eager' (the conv path on the GPU too)

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768,
                 bias: bool = True, strict_img_size: bool = True, backend: str = "auto"):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        for s, p in zip(self.img_size, self.patch_size):
            if s % p:
                raise ValueError(f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans = in_chans
        self.embed_dim = embed_dim
        self.strict_img_size = strict_img_size
        self.backend = check_backend(backend)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = nn.Identity()

    def check_input(self, x: torch.Tensor, any_size: bool = False) -> tuple[int, int]:
        """Validate an image batch; returns its patch grid (H/p, W/p). ``any_size``: any size divisible
        by the patch is accepted even with strict_img_size (the caller brings its own position embedding)."""
        check_image_batch(x, self.in_chans)
        B, C, H, W = x.shape
        if C != self.in_chans:
            raise ValueError(f"expected {self.in_chans} input channels (in_chans), got {C} (shape {tuple(x.shape)})")
        ph, pw = self.patch_size
        if H % ph or W % pw:
            raise ValueError(f"expected image height and width divisible by patch size {self.patch_size}, "
                             f"got ({H}, {W})")
        if self.strict_img_size and not any_size and (H, W) != self.img_size:
            raise ValueError(f"expected images of size {self.img_size} (H, W), got ({H}, {W}); "
                             f"create the model with img_size=({H}, {W}) or dynamic_img_size=True")
        return H // ph, W // pw

    def fused(self, x: torch.Tensor) -> bool:
        """The ``patch_embed`` kernel runs: Triton backend, and ``proj`` is a convolution it can read
        (vit_fast/adapters.py) with no hook on it."""
        return (self.impl == "fused" and resolve_backend(self.backend, x) == "triton" and fusable_linear(self.proj)
                and not has_hooks(self, inside=True))

    def forward(self, x: torch.Tensor, any_size: bool = False) -> torch.Tensor:
        grid = self.check_input(x, any_size)
        if self.fused(x):
            # Used alone the kernel adds no tokens and a zero position embedding (the model passes its own).
            zero_pos = x.new_zeros((1, grid[0] * grid[1], self.embed_dim), dtype=self.proj.weight.dtype)
            x = patch_embed_kernel(x, effective_weight(self.proj), effective_bias(self.proj), zero_pos)
        else:
            x = self.proj(x).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        return self.norm(x)


class Attention(nn.Module):
    """Multi-head self-attention with a packed qkv projection (timm's layout: [q | k | v] x heads x head_dim)."""

    impl = "fused"  # the route's choice (vit_fast/route.py): 'fused' | 'sdpa' | 'eager'

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, norm_eps: float = 1e-6, backend: str = "auto"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.backend = check_backend(backend)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        # q/k norms stay reference ops on every backend (the attention kernel reads raw packed qkv)
        self.q_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, 3*H*D) -> q, k, v of shape (B, H, N, D), with q/k norm applied."""
        q, k, v = split_packed(qkv, self.num_heads)
        return self.q_norm(q), self.k_norm(k), v

    def fused(self, x: torch.Tensor) -> bool:
        """The attention kernel runs (it has no per-head LayerNorm: with qk_norm the reference ops do)."""
        return (self.impl == "fused" and not isinstance(self.q_norm, nn.LayerNorm)
                and resolve_backend(self.backend, x) == "triton")

    def packed_sdpa(self, x: torch.Tensor) -> bool:
        """The 'sdpa' route runs (vit_fast/sdpa.py): SDPA on the packed qkv, no per-head LayerNorm."""
        return (self.impl == "sdpa" and not isinstance(self.q_norm, nn.LayerNorm)
                and resolve_backend(self.backend, x) == "triton")

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v from the packed projection; returns (B, N, H*D). Fused path: the
        ``attention`` kernel reads q, k, v through strides of the packed qkv and writes (B, N, H*D)."""
        if self.fused(qkv):
            return attention_kernels.attention(qkv, self.num_heads, self.scale, self.attn_drop.p, self.training)
        if self.packed_sdpa(qkv):
            return packed_sdpa(qkv, self.num_heads, self.scale, self.attn_drop.p, self.training)
        B, N, _ = qkv.shape
        q, k, v = self.split_heads(qkv)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        return x.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim)  # explicit: B may be 0

    def attention_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax attention probabilities (B, H, N, N) for the normalised input x (no dropout)."""
        q, k, _ = self.split_heads(self.qkv(x))
        return ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)

    def branch(self, x: torch.Tensor, keep_rows: Optional[int] = None) -> torch.Tensor:
        """Fused path: ``attention_linear`` (the qkv GEMM with its bias, attention; the bias's gradient
        from the attention backward, no separate reduction over d(qkv)), then the proj GEMM *without*
        its bias (the residual join adds it). ``keep_rows``: only the first tokens' output is wanted;
        attention still reads every token's k and v; the kernels compute only those queries (no output and
        no zero-filled output gradient for the others), the proj GEMM runs on those rows."""
        if self.fused(x) and fusable_linear(self.qkv):
            out = attention_kernels.attention_linear(x, effective_weight(self.qkv), effective_bias(self.qkv),
                                                     self.num_heads, self.scale, self.attn_drop.p, self.training,
                                                     query_rows=keep_rows)
        else:
            out = self.attend(self.qkv(x))
            out = out if keep_rows is None else out[:, :keep_rows]
        return linear_without_bias(self.proj, out)

    def join_terms(self) -> tuple[Optional[torch.Tensor], float]:
        """What the residual join applies to ``branch``'s output: the proj bias, then proj dropout's rate."""
        return bias_left_to_join(self.proj), self.proj_drop.p

    def draws_row_dropout_masks(self) -> bool:
        """A forward in this mode may draw per-token dropout masks after attention: proj dropout, or a
        proj module called whole (vit_fast/adapters.py: e.g. LoRA with dropout)."""
        return self.training and (self.proj_drop.p > 0 or not fusable_linear(self.proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        x = self.attend(qkv)
        return self.proj_drop(self.proj(x))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): OpenAI CLIP's activation (timm / open_clip QuickGELU), in the input's dtype."""
    return x * torch.sigmoid(1.702 * x)


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(x)


class MlpJoin(nn.Module):
    """What every MLP kind (Mlp, the SwiGLU MLPs) gives the block's fused residual join, around its own
    ``hidden`` (fc1 -> activation -> drop1 -> norm) and ``branch`` (fc2 without its bias)."""

    impl = "fused"  # the route's choice (vit_fast/route.py): 'fused' | 'bias_gelu' | 'eager'

    def join_terms(self) -> tuple[Optional[torch.Tensor], float]:
        """What the residual join applies to ``branch``'s output: the fc2 bias, then drop2's rate."""
        return bias_left_to_join(self.fc2), self.drop2.p

    def draws_row_dropout_masks(self) -> bool:
        """A forward in this mode may draw per-token dropout masks: drop1, drop2, or a projection called
        whole (vit_fast/adapters.py: e.g. LoRA with dropout)."""
        projections = [m for m in (getattr(self, n, None) for n in ("fc1", "fc1_g", "fc1_x", "fc2")) if m is not None]
        return self.training and (self.drop1.p > 0 or self.drop2.p > 0
                                  or not all(fusable_linear(m) for m in projections))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.hidden(x)))


class Mlp(MlpJoin):
    """fc1 -> GELU (exact / tanh) or QuickGELU -> dropout -> (norm) -> fc2 -> dropout, as timm's Mlp.
    On the fused path all three activations run in ``linear_act``'s epilogues; only with drop1 active or an
    MLP norm is the hidden activation materialised (QuickGELU then in torch ops)."""

    def __init__(self, in_features: int, hidden_features: int, act: str = "gelu", drop: float = 0.0,
                 backend: str = "auto"):
        super().__init__()
        if act not in ("gelu", "gelu_tanh", "quick_gelu"):
            raise ValueError(f"act must be 'gelu' (exact erf), 'gelu_tanh' or 'quick_gelu', got {act!r}")
        self.backend = check_backend(backend)
        self.act_name = act  # 'gelu' | 'gelu_tanh' | 'quick_gelu': the fused kernels' activation switch
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = QuickGELU() if act == "quick_gelu" else nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(drop)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """fc1 -> GELU -> drop1 -> norm: the input of fc2. Fused path: fc1 GEMM without bias, then
        ``bias_gelu``; drop1 (p > 0) and a non-Identity norm run as reference ops after it."""
        if (self.impl == "eager" or resolve_backend(self.backend, x) == "torch" or has_hooks(self.fc1)
                or has_hooks(self.act) or isinstance(self.act, QuickGELU) or not fusable_linear(self.fc1)):
            return self.norm(self.drop1(self.act(self.fc1(x))))
        x = bias_gelu(F.linear(x, effective_weight(self.fc1)), effective_bias(self.fc1), self.act.approximate)
        if self.drop1.p > 0 and self.training:
            x = self.drop1(x)
        return self.norm(x)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """Fused path, fc2 *without* its bias (the residual join adds it, then drop2): ``linear_act`` (fc1
        as a Triton GEMM with bias + activation in its epilogue, fc2 on cuBLAS, act' in the epilogue of fc2's
        dgrad GEMM). With drop1 active or an MLP norm the hidden activation goes through ``hidden`` then
        the fc2 GEMM."""
        if (self.impl == "fused" and resolve_backend(self.backend, x) == "triton" and isinstance(self.norm, nn.Identity)
                and not (self.drop1.p > 0 and self.training) and fusable_linear(self.fc1)
                and fusable_linear(self.fc2)):
            return linear_act(x.to(compute_dtype_for(x)), effective_weight(self.fc1), effective_bias(self.fc1),
                              effective_weight(self.fc2), self.act_name)
        return linear_without_bias(self.fc2, self.hidden(x))



class LayerScale(nn.Module):
    """Per-channel learnable scale (CaiT / DeiT-III): x * gamma, gamma initialised to init_values."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def init_weights(self) -> None:
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """Stochastic depth per sample, kept samples scaled by 1/keep (timm's scale_by_keep=True)."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def sample_scale(self, branch: torch.Tensor) -> Optional[torch.Tensor]:
        """The per-sample factor (B,) fp32 (0 or 1/keep) the fused join applies, or None when inactive.
        Drawn like ``drop_path`` (same generator, dtype and count as for the branch tensor), so a fixed
        seed gives the reference and the fused path the same drop decisions."""
        if self.drop_prob == 0.0 or not self.training:
            return None
        keep = 1.0 - self.drop_prob
        return branch.new_empty((branch.shape[0],)).bernoulli_(keep).div_(keep).float()

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)), each with LayerScale and DropPath."""

    join_impl = "fused"  # the route's choice for the joins (vit_fast/route.py): 'fused' | 'eager' (torch ops)

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_norm: bool = False, init_values: Optional[float] = None, proj_drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float = 0.0, norm_eps: float = 1e-6, act: str = "gelu",
                 backend: str = "auto", mlp_layer: str = "mlp"):
        super().__init__()
        self.backend = check_backend(backend)
        self.norm1 = layer_norm(dim, norm_eps, backend)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop,
                              proj_drop=proj_drop, norm_eps=norm_eps, backend=backend)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = layer_norm(dim, norm_eps, backend)
        if mlp_layer == "mlp":
            self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act, drop=proj_drop, backend=backend)
        else:  # SwiGLU (DINOv2-g); vit_fast/family_layers.py imports this module
            from .family_layers import make_mlp

            self.mlp = make_mlp(mlp_layer, dim, int(dim * mlp_ratio), act, proj_drop, backend=backend)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def fuses(self, x: torch.Tensor) -> bool:
        """The block runs on its kernels (``forward_pair``): the backend resolves to Triton, no hook sits
        on a part of it (hooks fire only when the parts run through their own ``__call__``) and its norms
        are vit_fast LayerNorms the join kernel can read (a wrapped or replaced norm is called instead)."""
        return (resolve_backend(self.backend, x) == "triton" and self.reads_norms()
                and not has_hooks(self, inside=True))

    def reads_norms(self) -> bool:
        return reads_norm(self.norm1) and reads_norm(self.norm2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuses(x):
            return self.forward_pair(*layer_norm_with_input(self.norm1, x), next_norm=None)[1]
        # reference: module by module (each part on its own kernels where it has them). .to(x.dtype): the
        # stream keeps its dtype (a no-op unless it is half under autocast, residual_in_fp32=False, where
        # the fp32 LayerScale output would promote it)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x)))).to(x.dtype)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))).to(x.dtype)
        return x

    def draws_row_dropout_masks(self) -> bool:
        """True when a forward in the current mode draws per-token dropout masks after attention (the
        parts' proj / MLP dropout): those draws depend on how many rows run. Attention dropout (drawn over
        every token) and drop-path (one value per image) do not."""
        return self.attn.draws_row_dropout_masks() or self.mlp.draws_row_dropout_masks()

    def forward_pair(self, hidden: torch.Tensor, residual: torch.Tensor, next_norm: Optional[nn.LayerNorm],
                     keep_rows: Optional[int] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The fused dataflow: (hidden = norm1(x), residual = x) -> (next_norm(x'), x'), x' this block's output.

            attention branch (no proj bias) -> join: + proj bias, proj dropout, ls1, drop-path, add, norm2
            MLP branch (no fc2 bias)        -> join: + fc2 bias, drop2, ls2, drop-path, add, next_norm
        Each join is one kernel (``add_layer_norm``; ``bias_dropout_add`` when next_norm is None, and the
        first output is then None). ``keep_rows``: x' of the first tokens only (the last block under
        class-token pooling): every token still enters attention as a key and value; the proj GEMM, both
        joins and the MLP run on the kept rows. Exact: the dropped rows would only get zero gradients."""
        if resolve_backend(self.backend, residual) == "torch":
            x = self(residual)[:, :keep_rows]
            return (next_norm(x) if next_norm is not None else None), x
        branch = self.attn.branch(hidden, keep_rows)
        residual = residual if keep_rows is None else residual[:, :keep_rows]
        hidden, residual = self._join(branch, residual, self.attn, self.ls1, self.drop_path1, self.norm2)
        branch = self.mlp.branch(hidden)
        return self._join(branch, residual, self.mlp, self.ls2, self.drop_path2, next_norm)

    def _join(self, branch: torch.Tensor, residual: torch.Tensor, part: nn.Module, ls: nn.Module, dp: nn.Module,
              norm: Optional[nn.LayerNorm]) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """residual + drop_path(ls(dropout(branch + bias))), and norm of it: ``residual_join`` with the
        part's bias and dropout rate, LayerScale's gamma (None: Identity) and the drop-path scale."""
        bias, dropout_p = part.join_terms()
        gamma = ls.gamma if isinstance(ls, LayerScale) else None
        sample_scale = dp.sample_scale(branch) if isinstance(dp, DropPath) else None
        return residual_join(branch, residual, bias, gamma, sample_scale, dropout_p, self.training, norm,
                             self.join_impl == "fused")


def resample_abs_pos_embed(posemb: torch.Tensor, new_size: tuple[int, int], old_size: tuple[int, int] | None = None,
                           num_prefix_tokens: int = 1, interpolation: str = "bicubic",
                           antialias: bool = True) -> torch.Tensor:
    """Resize a (1, prefix + h*w, D) position embedding to a new grid, exactly as timm does it:
    prefix tokens kept, the grid interpolated in float32 (bicubic, antialias), cast back."""
    num_new_tokens = new_size[0] * new_size[1] + num_prefix_tokens
    if num_new_tokens == posemb.shape[1]:
        if old_size is not None and tuple(old_size) == tuple(new_size):
            return posemb
        if old_size is None and new_size[0] == new_size[1]:
            return posemb
    if old_size is None:
        hw = int(math.sqrt(posemb.shape[1] - num_prefix_tokens))
        old_size = hw, hw
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim, dtype = posemb.shape[-1], posemb.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(new_size), mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, grid], dim=1) if num_prefix_tokens else grid


def sincos_2d_pos_embed(grid_size: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding (MAE / DeiT-III style), shape (h*w, dim).

    The first half of the channels encodes the row, the second half the column; each half is
    [sin(pos * w_i), cos(pos * w_i)] with w_i = temperature ** (-i / (dim/4)), i < dim/4.
    """
    if dim % 4:
        raise ValueError(f"sin-cos 2-D position embedding needs embed dim divisible by 4, got {dim}")
    omega = temperature ** -(torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows = torch.arange(grid_size[0], dtype=torch.float64)[:, None].expand(grid_size).reshape(-1)
    cols = torch.arange(grid_size[1], dtype=torch.float64)[None, :].expand(grid_size).reshape(-1)
    parts = []
    for pos in (rows, cols):
        angles = pos[:, None] * omega[None, :]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()


def trunc_normal_(tensor: torch.Tensor, std: float = 0.02) -> torch.Tensor:
    """timm's default: normal(0, std) truncated at +-2 (absolute, i.e. +-100 std for std=0.02)."""
    return nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-2.0, b=2.0)


def init_weights_vit_timm(module: nn.Module, name: str = "") -> None:
    """timm's 'timm' init: Linear weights trunc_normal(std .02), biases zero; LayerScale to init_values;
    conv and LayerNorm keep PyTorch's defaults."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()


def named_apply(fn: Callable[[nn.Module, str], None], module: nn.Module, name: str = "") -> None:
    """Apply fn to every descendant of module (children before parents), not to module itself."""
    for child_name, child in module.named_children():
        child_full = f"{name}.{child_name}" if name else child_name
        named_apply(fn, child, child_full)
        fn(child, child_full)
