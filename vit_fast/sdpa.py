"""The attention part's library route: torch's scaled_dot_product_attention (cuDNN / flash / memory-efficient
backends on a GPU, the math backend on CPU) on the packed qkv, with none of the copies eager timm pays for
the packing.

Forward: q, k and v are strided (B, H, N, D) views of the packed (B, N, 3 * H * D) qkv (no copy in); the
output comes back as (B, N, H * D), a free view where the backend writes (B, N, H, D) (flash, cuDNN).
Backward: the three gradients are asked of SDPA's own backward separately and written into one packed
d(qkv) in one pass (eager's autograd stacks them, then copies the permuted stack again to reshape it).
The qkv bias gradient stays the Linear's column sum. Dropout uses torch's generator and SDPA's masks (not
vit_fast's Philox scheme); activation checkpointing restores that generator, so recomputed masks match.
Not bitwise repeatable on CUDA where the backend's backward accumulates with atomics (vit_fast.route says
so and never makes it a default). Under torch.compile, and where saved-tensor hooks are active (non-reentrant
activation checkpointing, save_on_cpu: they must see every saved tensor), the same ops run as plain torch calls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels._utils import first_order_only


def split_packed(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, N, 3 * H * D) -> q, k, v as (B, H, N, D) strided views (timm's [q | k | v] x heads layout)."""
    B, N, width = qkv.shape
    return qkv.reshape(B, N, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _sdpa(q, k, v, scale: float, dropout_p: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)


class PackedSDPAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float) -> torch.Tensor:
        with torch.enable_grad():  # SDPA's own graph, kept for the backward (its saved tensors, as eager's)
            q, k, v = split_packed(qkv.detach().requires_grad_(), num_heads)
            out = _sdpa(q, k, v, scale, dropout_p)
        ctx.graph = (q, k, v, out)
        B, H, N, D = out.shape
        return out.detach().transpose(1, 2).reshape(B, N, H * D)

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.graph is None:
            raise RuntimeError("vit_fast's SDPA route (vit_fast/sdpa.py): trying to backward through the attention a "
                               "second time; its inner graph is freed by the first backward (retain_graph is not "
                               "supported on this route: use the 'fused' or 'eager' attention route)")
        q, k, v, out = ctx.graph
        ctx.graph = None  # the inner graph's saved tensors go with the first backward, as a plain graph's do
        B, H, N, D = out.shape
        grads = torch.autograd.grad(out, (q, k, v), grad_out.view(B, N, H, D).transpose(1, 2))
        dqkv = torch.stack([g.transpose(1, 2) for g in grads], dim=2)  # (B, N, 3, H, D), one pass
        return dqkv.view(B, N, 3 * H * D), None, None, None


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are installed (non-reentrant activation checkpointing, save_on_cpu): the
    Function keeps SDPA's inner graph on its context, out of their reach, so the plain ops run instead."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: the plain ops are always safe
    try:
        return top(True) is not None
    except TypeError:
        return top() is not None


def packed_sdpa(qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float = 0.0,
                training: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v from the packed (B, N, 3 * H * D) qkv -> (B, N, H * D), through SDPA."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(f"packed_sdpa: expected qkv of shape (B, N, 3 * heads * head_dim) with {num_heads} heads, "
                         f"got {tuple(qkv.shape)}")
    p = float(dropout_p) if training else 0.0
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled() or not qkv.requires_grad
            or _saved_tensor_hooks_active()):
        B, N, _ = qkv.shape
        out = _sdpa(*split_packed(qkv, num_heads), scale, p)
        return out.transpose(1, 2).reshape(B, N, -1)
    return PackedSDPAFunction.apply(qkv, num_heads, float(scale), p)
