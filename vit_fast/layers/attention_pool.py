"""SigLIP's attention-pool head (timm's ``AttentionPoolLatent``, ``global_pool='map'``): a learned latent query
attends over every token (q from the latent, k and v from one packed ``kv`` GEMM), ``proj``, then
``x + mlp(norm(x))``. Under 1% of the FLOPs: SDPA on both backends; its LayerNorm and MLP are vit_fast's."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backend import check_backend
from .common import trunc_normal_tf_
from .mlp import Mlp
from .norm import LayerNorm


class AttentionPoolLatent(nn.Module):
    """timm's AttentionPoolLatent (SigLIP's 'map' head) with latent_len=1, pool 'token', no position
    embedding: ``x = proj(attn(q(latent), kv(tokens)))``, then ``x + mlp(norm(x))``, returns (B, D)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 norm_eps: float = 1e-6, act: str = "gelu", drop: float = 0.0, backend: str = "auto"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"AttentionPoolLatent: dim {dim} must be divisible by num_heads {num_heads}")
        self.backend = check_backend(backend)
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.latent_len = 1
        self.latent_dim = dim
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.norm = LayerNorm(dim, eps=norm_eps, backend=backend)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act, backend=backend)
        self.init_weights()  # at construction too, as timm's: a seed then draws timm's weights

    def init_weights(self) -> None:
        """timm: latent ~ trunc_normal_tf(std=dim^-0.5), drawn as timm draws it (the Linear layers get the
        model's init)."""
        trunc_normal_tf_(self.latent, std=self.latent_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H, Dh = self.num_heads, self.head_dim
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, H, Dh).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, C)
        y = self.proj_drop(self.proj(y))
        y = y + self.mlp(self.norm(y))
        return y[:, 0]
