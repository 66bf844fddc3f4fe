"""LayerNorm on the ``layer_norm`` kernel, and the residual join: bias, LayerScale, dropout, drop-path and the
residual add fused with the LayerNorm that follows (``add_layer_norm``), or ``bias_dropout_add`` without one."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..adapters import parametrized, torch_forward_kept
from ..backend import check_backend, resolve_backend
from ..kernels._utils import compute_dtype_for
from ..kernels.bias_gelu import bias_dropout_add
from ..kernels.layer_norm import add_layer_norm, layer_norm_and_input
from ..kernels.layer_norm import layer_norm as layer_norm_kernel


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict) that runs the ``layer_norm`` kernel on the fused path."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: str = "auto"):
        super().__init__(dim, eps=eps)
        self.backend = check_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias  # read once: a parametrized weight is computed at each read
        # the kernel reads an affine norm (a weight or bias set to None by hand: torch's, as reads_norm says)
        if resolve_backend(self.backend, x) == "triton" and weight is not None and bias is not None:
            return layer_norm_kernel(x, weight, bias, self.eps)
        # F.layer_norm itself, as timm's LayerNorm: not nn.LayerNorm.forward, which a library may replace
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def reads_norm(norm: nn.Module) -> bool:
    """Whether the fused kernels may read ``norm``'s parameters in place of calling it: an affine
    nn.LayerNorm (vit_fast's or torch's, e.g. a transformers model's) with its stock forward (torch's not replaced
    on the class by a library)."""
    cls = type(norm)
    if cls is not LayerNorm and not (  # vit_fast's own (a parametrized module has a class of its own)
            isinstance(norm, nn.LayerNorm) and not parametrized(norm) and (cls.forward is LayerNorm.forward or (
                cls.forward is nn.LayerNorm.forward and torch_forward_kept(nn.LayerNorm)))):
        return False
    return norm.weight is not None and norm.bias is not None


def layer_norm_with_input(norm: nn.LayerNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x): the (hidden, residual) pair that enters a chain of fused blocks, in one kernel (the
    hidden half in the autocast dtype, as the GEMM after it wants it)."""
    return layer_norm_and_input(x, norm.weight, norm.bias, norm.eps, compute_dtype_for(x))


def layer_norm(dim: int, eps: float, backend: str = "auto") -> LayerNorm:
    return LayerNorm(dim, eps=eps, backend=backend)


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
