"""What ``vit_fast.optimize`` returns for an open_clip image tower: the vit_fast model (timm's parameter names) that
also answers what an open_clip ``CLIP`` model and open_clip's helpers ask of ``model.visual``: ``lock`` (behind
``CLIP.lock_image_tower``, LiT), ``forward_intermediates`` with open_clip's arguments and dict (behind
``CLIP.forward_intermediates``), ``image_size`` / ``patch_size`` and the preprocessing attributes
(``open_clip.get_model_preprocess_cfg``). ``from_open_clip`` returns the plain vit_fast model."""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..model import VisionTransformer

# the source tower's attributes open_clip.set_model_preprocess_cfg writes and get_model_preprocess_cfg reads
PREPROCESS_ATTRIBUTES = ("preprocess_cfg", "image_mean", "image_std")


class OpenCLIPVisionTransformer(VisionTransformer):
    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(self.patch_embed.img_size)

    @property
    def patch_size(self) -> tuple[int, int]:
        return tuple(self.patch_embed.patch_size)

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """open_clip's: freeze the tower but its last ``unlocked_groups`` groups: the embedding (patch
        projection, class token, position embedding, pre-norm), each block but the last, the last block with the
        final norm, the projection. ``freeze_bn_stats``: no batch norm here, as in open_clip's ViT."""
        self.requires_grad_(False)
        if unlocked_groups == 0:
            return
        groups = [[self.patch_embed, self.cls_token, self.pos_embed, self.norm_pre], *self.blocks[:-1],
                  [self.blocks[-1], self.norm], self.head]
        for group in groups[-unlocked_groups:]:
            for part in group if isinstance(group, list) else [group]:
                if isinstance(part, nn.Parameter):
                    part.requires_grad_(True)
                elif isinstance(part, nn.Module):
                    part.requires_grad_(True)

    def prune_intermediate_layers(self, indices: Union[int, list[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """open_clip's: ``prune_head`` drops the projection only (open_clip's ``proj = None``: forward returns the
        normed class token), not the pooling as timm's (every token)."""
        take = super().prune_intermediate_layers(indices, prune_norm=prune_norm, prune_head=False)
        if prune_head:
            self.reset_classifier(0)
        return take

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, list[int]]] = None,
                              stop_early: bool = False, normalize_intermediates: bool = False,
                              intermediates_only: bool = False, output_fmt: str = "NCHW",
                              output_extra_tokens: bool = False) -> dict:
        """open_clip's arguments and result: {'image_intermediates': the chosen blocks' patch tokens (NCHW maps or
        NLC), 'image_intermediates_prefix': their class tokens (``output_extra_tokens``), 'image_features': the
        embedding (``forward``'s, after the blocks run; not with ``intermediates_only``)}."""
        result = super().forward_intermediates(x, indices, return_prefix_tokens=output_extra_tokens,
                                               norm=normalize_intermediates, stop_early=stop_early,
                                               output_fmt=output_fmt, intermediates_only=intermediates_only,
                                               output_dict=True)
        if not intermediates_only:
            result["image_features"] = self.forward_head(result["image_features"])
        return result
