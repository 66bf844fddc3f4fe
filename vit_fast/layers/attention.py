"""Multi-head self-attention on the packed qkv: vit_fast's kernels (``attention_linear``), SDPA on the packed
qkv (vit_fast/sdpa.py) or timm's eager ops, as the route says (vit_fast/route.py)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import vit_fast.kernels.attention as attention_kernels
from vit_fast.kernels._utils import compute_dtype_for

from ..adapters import effective_bias, effective_weight, fusable_linear
from ..backend import check_backend, resolve_backend
from ..sdpa import packed_sdpa, split_packed
from .common import bias_left_to_join, dropout_rate, linear_without_bias, own_hooks


class Attention(nn.Module):
    """Multi-head self-attention with a packed qkv projection (timm's layout: [q | k | v] x heads x head_dim)."""

    impl = "fused"  # the route's choice (vit_fast/route.py): 'fused' | 'short' | 'sdpa' | 'eager'
    # timm's switch: False computes the probabilities explicitly and passes them through attn_drop, where a
    # forward hook on it sees them (the usual way to read timm's attention maps)
    fused_attn = True

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

    def has_qk_norm(self) -> bool:
        """A q or k norm (qk_norm's LayerNorm, any module put in their place, or an Identity with a hook or a
        forward of its own) that the reference ops call: the kernels read the raw packed qkv."""
        q_norm, k_norm = self.q_norm, self.k_norm
        return (type(q_norm) is not nn.Identity or type(k_norm) is not nn.Identity or own_hooks(q_norm)
                or own_hooks(k_norm))

    def fused(self, x: torch.Tensor) -> bool:
        """The attention kernel runs (it has no per-head norm: with a q/k norm the reference ops do; a module in
        attn_drop's place other than an Identity is called on the probabilities, as timm's explicit path does)."""
        return (self.impl in ("fused", "short") and self.fused_attn and not self.has_qk_norm()
                and self.attn_drop_rate() is not None and resolve_backend(self.backend, x) == "triton")

    def attn_drop_rate(self) -> Optional[float]:
        """The attention dropout rate the kernels and SDPA apply while this module trains: attn_drop's p, 0 for an
        Identity put in its place, None for another module (called on the explicit path)."""
        if type(self.attn_drop) is nn.Dropout:  # its p, as timm's fused path reads it (a forward replaced on the
            return self.attn_drop.p              # class is not called there either)
        return 0.0 if type(self.attn_drop) is nn.Identity else None

    def kernel_family(self, tokens: int, dtype: torch.dtype) -> str:
        """The attention kernels' family (fused paths only) for a qkv of this many tokens and dtype: 'short' on the
        'short' route where the short kernels run this head, else 'flash'."""
        if self.impl != "short":
            return "flash"
        return attention_kernels.family_for("short", tokens, self.head_dim, dtype)

    def packed_sdpa(self, x: torch.Tensor) -> bool:
        """The 'sdpa' route runs (vit_fast/sdpa.py): SDPA on the packed qkv, no per-head LayerNorm."""
        return (self.impl == "sdpa" and self.fused_attn and not self.has_qk_norm()
                and self.attn_drop_rate() is not None and resolve_backend(self.backend, x) == "triton")

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v from the packed projection; returns (B, N, H*D). Fused path: the
        ``attention`` kernel reads q, k, v through strides of the packed qkv and writes (B, N, H*D)."""
        if self.fused(qkv):
            return attention_kernels.attention(qkv, self.num_heads, self.scale, self.attn_drop_rate(), self.training,
                                               kernel=self.kernel_family(qkv.shape[1], qkv.dtype))
        if self.packed_sdpa(qkv):
            return packed_sdpa(qkv, self.num_heads, self.scale, self.attn_drop_rate(), self.training)
        B, N, _ = qkv.shape
        q, k, v = self.split_heads(qkv)
        if self.fused_attn and self.attn_drop_rate() is not None:
            # a scale set by hand (a temperature) as the kernels apply it; SDPA's own default otherwise
            scale = None if self.scale == self.head_dim ** -0.5 else self.scale
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop_rate() if self.training else 0.0,
                                               scale=scale)
        else:  # timm's explicit path
            x = self.attn_drop(((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)) @ v
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
                                                     self.num_heads, self.scale, self.attn_drop_rate(), self.training,
                                                     query_rows=keep_rows,
                                                     kernel=self.kernel_family(x.shape[1], compute_dtype_for(x)))
        else:
            out = self.attend(self.qkv(x))
            out = out if keep_rows is None else out[:, :keep_rows]
        return linear_without_bias(self.proj, out)

    def join_terms(self) -> tuple[Optional[torch.Tensor], nn.Module]:
        """What the residual join applies to ``branch``'s output: the proj bias, then proj dropout."""
        return bias_left_to_join(self.proj), self.proj_drop

    def draws_row_dropout_masks(self) -> bool:
        """A forward in this mode may draw per-token dropout masks after attention: proj dropout (or a module in
        its place), or a proj module called whole (vit_fast/adapters.py: e.g. LoRA with dropout)."""
        return dropout_rate(self.proj_drop) != 0 or (self.training and not fusable_linear(self.proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        x = self.attend(qkv)
        return self.proj_drop(self.proj(x))
