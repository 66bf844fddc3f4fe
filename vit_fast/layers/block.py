"""The pre-norm transformer block, its LayerScale and DropPath, and its fused dataflow (``forward_pair``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..backend import check_backend, resolve_backend
from . import fused_block
from .attention import Attention
from .common import dropout_rate, has_hooks, runs_own_forward
from .mlp import MlpJoin, make_mlp
from .norm import layer_norm, layer_norm_with_input, reads_norm, residual_join


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
    return x * (mask.div_(keep) if keep > 0.0 else mask)  # rate 1: every sample dropped, zeros (as timm), not NaN


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
        mask = branch.new_empty((branch.shape[0],)).bernoulli_(keep)
        return (mask.div_(keep) if keep > 0.0 else mask).float()

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
        self.mlp = make_mlp(mlp_layer, dim, int(dim * mlp_ratio), act, proj_drop, backend=backend)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def fuses(self, x: torch.Tensor) -> bool:
        """The block runs on its kernels (``forward_pair``): the backend resolves to Triton, no hook sits
        on a part of it (hooks fire only when the parts run through their own ``__call__``), its norms
        are LayerNorms the join kernel can read and its attention and MLP are vit_fast's (a wrapped or replaced
        part is called instead)."""
        return (resolve_backend(self.backend, x) == "triton" and self.reads_parts()
                and not has_hooks(self, inside=True))

    def reads_parts(self) -> bool:
        return (reads_norm(self.norm1) and reads_norm(self.norm2) and runs_own_forward(self.attn, Attention)
                and runs_own_forward(self.mlp, MlpJoin))

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
                     keep_rows: Optional[int] = None,
                     one_function: Optional[bool] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The fused dataflow: (hidden = norm1(x), residual = x) -> (next_norm(x'), x'), x' this block's output.

            attention branch (no proj bias) -> join: + proj bias, proj dropout, ls1, drop-path, add, norm2
            MLP branch (no fc2 bias)        -> join: + fc2 bias, drop2, ls2, drop-path, add, next_norm
        Each join is one kernel (``add_layer_norm``; ``bias_dropout_add`` when next_norm is None, and the
        first output is then None). ``keep_rows``: x' of the first tokens only (the last block under
        class-token pooling): every token still enters attention as a key and value; the proj GEMM, both
        joins and the MLP run on the kept rows. Exact: the dropped rows would only get zero gradients.
        ``one_function``: whether the block runs as one Function (``fused_block``), as decided by a caller that
        checkpoints it (``runs_as_one_function`` before the checkpoint: its recomputation takes the same path);
        None decides here, and under saved-tensor hooks (a checkpoint this block did not decide: its forward or
        recomputation; save_on_cpu) it runs per part, which a recomputation repeats whatever ran in between."""
        if resolve_backend(self.backend, residual) == "torch":
            x = self(residual)[:, :keep_rows]
            return (next_norm(x) if next_norm is not None else None), x
        plan, parts, params, signature = fused_block.plan_for(self, hidden, residual, next_norm, keep_rows)
        if one_function is None:
            one_function = plan is not None and not fused_block.saved_tensor_hooks_on() and fused_block.ready(signature)
        if one_function and plan is not None:
            return fused_block.run_block(plan, parts, params, hidden, residual)
        branch = self.attn.branch(hidden, keep_rows)
        residual = residual if keep_rows is None else residual[:, :keep_rows]
        hidden, residual = self._join(branch, residual, self.attn, self.ls1, self.drop_path1, self.norm2)
        branch = self.mlp.branch(hidden)
        out = self._join(branch, residual, self.mlp, self.ls2, self.drop_path2, next_norm)
        if plan is not None:  # the parts' functionals checked this signature
            fused_block.mark_checked(signature)
        return out

    def runs_as_one_function(self, hidden: Optional[torch.Tensor], residual: torch.Tensor,
                             next_norm: Optional[nn.LayerNorm], keep_rows: Optional[int] = None) -> bool:
        """Whether ``forward_pair`` on these inputs would run the block as one Function now: what a caller that
        checkpoints it hands to the forward and so to its recomputation."""
        if hidden is None or resolve_backend(self.backend, residual) == "torch":
            return False
        plan, _, _, signature = fused_block.plan_for(self, hidden, residual, next_norm, keep_rows)
        return plan is not None and fused_block.ready(signature)

    def _join(self, branch: torch.Tensor, residual: torch.Tensor, part: nn.Module, ls: nn.Module, dp: nn.Module,
              norm: Optional[nn.LayerNorm]) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """residual + drop_path(ls(dropout(branch + bias))), and norm of it: ``residual_join`` with the
        part's bias and dropout rate, LayerScale's gamma (None: Identity) and the drop-path scale."""
        bias, dropout = part.join_terms()
        dropout_p = dropout_rate(dropout)
        if dropout_p is None or not fused_block.joins_read(ls, LayerScale) or not fused_block.joins_read(dp, DropPath):
            # a module in the place of the dropout, LayerScale or drop-path (timm's, a subclass, anything): the
            # modules are called on the biased branch and the join only adds
            branch = dp(ls(dropout(branch if bias is None else branch + bias.to(branch.dtype))))
            return residual_join(branch, residual, None, None, None, 0.0, False, norm, self.join_impl == "fused")
        gamma = ls.gamma if isinstance(ls, LayerScale) else None
        sample_scale = dp.sample_scale(branch) if isinstance(dp, DropPath) else None
        return residual_join(branch, residual, bias, gamma, sample_scale, dropout_p, dropout_p > 0, norm,
                             self.join_impl == "fused")


fused_block.register_block_types(LayerScale, DropPath, Block)
