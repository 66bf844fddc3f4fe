"""The MLPs: timm's Mlp (GELU, tanh GELU or QuickGELU) on ``linear_act`` or cuBLAS fc1 + ``bias_gelu``, and
DINOv2-giant's SwiGLU MLPs (timm ``SwiGLUPacked``: one fc1 of 2F outputs, gate first; timm ``SwiGLU``: separate
``fc1_g`` / ``fc1_x``) on cuBLAS GEMMs + the ``swiglu`` kernel. Each ``branch`` returns fc2's output *without*
its bias, for the residual join; the route (vit_fast/route.py) picks the implementation."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..adapters import effective_bias, effective_weight, fusable_linear, torch_forward_kept
from ..backend import check_backend, resolve_backend
from ..kernels._utils import compute_dtype_for
from ..kernels.bias_gelu import bias_gelu
from ..kernels.linear_act import linear_act
from ..kernels.swiglu import swiglu, swiglu_packed
from .common import bias_left_to_join, dropout_rate, has_hooks, linear_without_bias

QUICK_GELU_ALPHA = 1.702


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): OpenAI CLIP's activation (timm / open_clip QuickGELU), in the input's dtype."""
    return x * torch.sigmoid(1.702 * x)


def quick_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d quick_gelu / dx = s + 1.702 x s (1 - s), s = sigmoid(1.702 x): the backward math a fused kernel uses."""
    s = torch.sigmoid(QUICK_GELU_ALPHA * x)
    return s + QUICK_GELU_ALPHA * x * s * (1 - s)


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(x)


def act_is_stock(mlp: nn.Module) -> bool:
    """Whether ``mlp.act`` is the module its constructor built: the fused kernels apply the activation ``act_name``
    names (SiLU for the SwiGLU MLPs), so a module put in its place is called on the reference path instead."""
    act, name = mlp.act, getattr(mlp, "act_name", "silu")
    if name == "quick_gelu":
        return type(act) is QuickGELU
    if name == "silu":
        return type(act) is nn.SiLU and torch_forward_kept(nn.SiLU)
    return (type(act) is nn.GELU and act.approximate == ("tanh" if name == "gelu_tanh" else "none")
            and torch_forward_kept(nn.GELU))


class MlpJoin(nn.Module):
    """What every MLP kind (Mlp, the SwiGLU MLPs) gives the block's fused residual join, around its own
    ``hidden`` (fc1 -> activation -> drop1 -> norm) and ``branch`` (fc2 without its bias)."""

    impl = "fused"  # the route's choice (vit_fast/route.py): 'fused' | 'bias_gelu' | 'eager'

    def join_terms(self) -> tuple[Optional[torch.Tensor], nn.Module]:
        """What the residual join applies to ``branch``'s output: the fc2 bias, then drop2."""
        return bias_left_to_join(self.fc2), self.drop2

    def draws_row_dropout_masks(self) -> bool:
        """A forward in this mode may draw per-token dropout masks: drop1, drop2, or a projection called
        whole (vit_fast/adapters.py: e.g. LoRA with dropout)."""
        projections = [m for m in (getattr(self, n, None) for n in ("fc1", "fc1_g", "fc1_x", "fc2")) if m is not None]
        return (dropout_rate(self.drop1) != 0 or dropout_rate(self.drop2) != 0
                or (self.training and not all(fusable_linear(m) for m in projections)))

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
                or has_hooks(self.act) or type(self.act) is not nn.GELU or not act_is_stock(self)
                or not fusable_linear(self.fc1)):
            return self.norm(self.drop1(self.act(self.fc1(x))))
        x = bias_gelu(F.linear(x, effective_weight(self.fc1)), effective_bias(self.fc1), self.act.approximate)
        if dropout_rate(self.drop1) != 0 or has_hooks(self.drop1):  # a hook on it fires, as on timm
            x = self.drop1(x)
        return self.norm(x)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """Fused path, fc2 *without* its bias (the residual join adds it, then drop2): ``linear_act`` (fc1
        as a Triton GEMM with bias + activation in its epilogue, fc2 on cuBLAS, act' in the epilogue of fc2's
        dgrad GEMM). With drop1 active or an MLP norm the hidden activation goes through ``hidden`` then
        the fc2 GEMM."""
        if (self.impl == "fused" and resolve_backend(self.backend, x) == "triton" and isinstance(self.norm, nn.Identity)
                and dropout_rate(self.drop1) == 0 and act_is_stock(self) and fusable_linear(self.fc1)
                and fusable_linear(self.fc2)):
            return linear_act(x.to(compute_dtype_for(x)), effective_weight(self.fc1), effective_bias(self.fc1),
                              effective_weight(self.fc2), self.act_name)
        return linear_without_bias(self.fc2, self.hidden(x))


def fuses_swiglu(mlp: MlpJoin, x: torch.Tensor) -> bool:
    """The ``swiglu`` kernel replaces SiLU(gate) * value: Triton backend, the MLP's fused choice on
    (any route but 'eager', vit_fast/route.py) and the stock SiLU module, without hooks."""
    return (mlp.impl != "eager" and resolve_backend(mlp.backend, x) == "triton" and act_is_stock(mlp)
            and not has_hooks(mlp.act))


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

    def init_weights(self) -> None:
        """timm's GluMlp init after the model's Linear init: fc1's second half (whichever side gates) weights
        ~ N(0, 1e-6^2), biases 1, drawn as timm draws them."""
        half = self.fc1.weight.shape[0] // 2
        with torch.no_grad():
            if self.fc1.bias is not None:
                self.fc1.bias[half:].fill_(1.0)
            self.fc1.weight[half:].normal_(std=1e-6)

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

    def init_weights(self) -> None:
        """timm's SwiGLU init after the model's Linear init: the gate's weights ~ N(0, 1e-6^2), its biases 1."""
        with torch.no_grad():
            if self.fc1_g.bias is not None:
                self.fc1_g.bias.fill_(1.0)
            self.fc1_g.weight.normal_(std=1e-6)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        g, v = self.fc1_g(x), self.fc1_x(x)
        return self.norm(self.drop1(swiglu(g, v) if fuses_swiglu(self, x) else self.act(g) * v))

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return linear_without_bias(self.fc2, self.hidden(x))


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
