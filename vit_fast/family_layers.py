"""Layers of the fine-tuning families beyond the original ViT: CLIP's QuickGELU, SigLIP's attention-pool
head and DINOv2-giant's SwiGLU MLP. Module and parameter names are timm's (``attn_pool.latent``,
``attn_pool.kv``, ``mlp.fc1_g`` ...), so timm state dicts load unchanged.

- ``quick_gelu(x) = x * sigmoid(1.702 x)`` (OpenAI CLIP): the reference math, with ``QuickGELU``.
- ``AttentionPoolLatent`` (timm's, ``global_pool='map'``): a learned latent query attends over every token
  (q from the latent, k and v from one packed ``kv`` GEMM), ``proj``, then ``x + mlp(norm(x))``. It is
  under 1% of the FLOPs: the attention is SDPA on both backends; its LayerNorm and MLP are vit_fast's
  (kernels on the fused path).
- ``SwiGLUPackedMlp`` (timm ``SwiGLUPacked`` = ``GluMlp(act=SiLU, gate_last=False)``: one fc1 of 2F outputs,
  gate first) and ``SwiGLUMlp`` (timm ``SwiGLU``: separate ``fc1_g`` / ``fc1_x``). Fused path: the fc1 GEMM(s)
  with their bias in cuBLAS, then the ``swiglu`` kernel (SiLU once per element per pass, the packed halves
  read in place), then fc2. ``branch`` returns fc2's output *without* its bias, for the residual join.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .backend import check_backend, resolve_backend
from .kernels.swiglu import swiglu, swiglu_packed
from .layers import (  # noqa: F401  (re-exported)
    LayerNorm,
    Mlp,
    MlpJoin,
    QuickGELU,
    has_hooks,
    linear_without_bias,
    quick_gelu,
)

QUICK_GELU_ALPHA = 1.702


def quick_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d quick_gelu / dx = s + 1.702 x s (1 - s), s = sigmoid(1.702 x): the backward math a fused kernel uses."""
    s = torch.sigmoid(QUICK_GELU_ALPHA * x)
    return s + QUICK_GELU_ALPHA * x * s * (1 - s)


def fuses_swiglu(mlp: MlpJoin, x: torch.Tensor) -> bool:
    """The ``swiglu`` kernel replaces SiLU(gate) * value: Triton backend, the MLP's fused choice on
    (any route but 'eager', vit_fast/route.py) and no hook on the activation module."""
    return mlp.impl != "eager" and resolve_backend(mlp.backend, x) == "triton" and not has_hooks(mlp.act)


class SwiGLUPackedMlp(MlpJoin):
    """fc1 (2F outputs: [gate | value]) -> SiLU(gate) * value -> drop1 -> norm -> fc2 -> drop2 (timm GluMlp
    names). ``hidden_features`` is fc1's width 2F, as timm's argument."""

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0, bias: bool = True,
                 backend: str = "auto"):
        super().__init__()
        if hidden_features % 2:
            raise ValueError(f"SwiGLUPackedMlp: hidden_features (fc1 width, gate + value) must be even, "
                             f"got {hidden_features}")
        self.backend = check_backend(backend)
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features // 2, in_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if fuses_swiglu(self, x):
            y = swiglu_packed(h)
        else:
            x1, x2 = h.chunk(2, dim=-1)
            y = self.act(x1) * x2
        return self.norm(self.drop1(y))

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """fc2's output without its bias (the fused residual join adds it, then drop2)."""
        return linear_without_bias(self.fc2, self.hidden(x))



class SwiGLUMlp(MlpJoin):
    """fc1_g (gate) and fc1_x (value) -> SiLU(gate) * value -> drop1 -> norm -> fc2 -> drop2 (timm SwiGLU
    names); ``hidden_features`` is the gated width F."""

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0, bias: bool = True,
                 backend: str = "auto"):
        super().__init__()
        self.backend = check_backend(backend)
        self.fc1_g = nn.Linear(in_features, hidden_features, bias=bias)
        self.fc1_x = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        g, v = self.fc1_g(x), self.fc1_x(x)
        return self.norm(self.drop1(swiglu(g, v) if fuses_swiglu(self, x) else self.act(g) * v))

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return linear_without_bias(self.fc2, self.hidden(x))



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

    def init_weights(self) -> None:
        """timm: latent ~ trunc_normal_tf(std=dim^-0.5) (the Linear layers get the model's init)."""
        std = self.latent_dim ** -0.5
        nn.init.trunc_normal_(self.latent, std=std, a=-2.0 * std, b=2.0 * std)

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


def make_mlp(kind: str, dim: int, hidden: int, act: str, drop: float, bias: bool = True,
             backend: str = "auto") -> nn.Module:
    """The block's MLP by kind: 'mlp' (GELU / tanh GELU / QuickGELU), 'swiglu_packed' (fc1 width ``hidden``,
    2F), 'swiglu' (gated width ``hidden``)."""
    if kind == "swiglu_packed":
        return SwiGLUPackedMlp(dim, hidden, drop=drop, bias=bias, backend=backend)
    if kind == "swiglu":
        return SwiGLUMlp(dim, hidden, drop=drop, bias=bias, backend=backend)
    if kind != "mlp":
        raise ValueError(f"mlp_layer must be 'mlp', 'swiglu_packed' or 'swiglu', got {kind!r}")
    return Mlp(dim, hidden, act=act, drop=drop, backend=backend)


__all__ = ["AttentionPoolLatent", "QuickGELU", "SwiGLUMlp", "SwiGLUPackedMlp", "make_mlp", "quick_gelu",
           "quick_gelu_grad", "QUICK_GELU_ALPHA"]

