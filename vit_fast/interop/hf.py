"""``HFViT``: a transformers ViTModel / ViTForImageClassification look-alike around a vit_fast model,
what ``vit_fast.optimize`` returns for a transformers source."""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import VisionTransformer


class HFViT(nn.Module):
    """A transformers ViTModel / ViTForImageClassification look-alike around a vit_fast model.

    ``forward(pixel_values, labels=None, return_dict=None, output_hidden_states=None,
    output_attentions=None)`` returns BaseModelOutputWithPooling (ViTModel: last_hidden_state,
    pooler_output) or ImageClassifierOutput (loss when labels are given, logits), or their tuples with
    return_dict=False. With output_attentions the blocks run one by one and each block's softmax
    probabilities (B, heads, N, N) are recomputed on the reference path, with gradients (HF's eager
    attention returns them after dropout: with attention dropout active in training this is refused).
    interpolate_pos_encoding resizes the position embedding as transformers does (bicubic, no
    antialias) for any image size divisible by the patch. Masked-patch pre-training inputs, attention
    masks and head masks raise a clear error.
    """

    def __init__(self, source: nn.Module, fast: VisionTransformer):
        super().__init__()
        self.model = fast
        self.config = source.config
        self.is_classifier = hasattr(source, "classifier")
        pooler = None if self.is_classifier else getattr(source, "pooler", None)
        self.pooler = copy.deepcopy(pooler)  # ViTModel's dense + tanh on the first token (None when absent)
        self._loss_function = source.loss_function if self.is_classifier else None

    def _interpolated_pos_embed(self, height: int, width: int) -> Optional[torch.Tensor]:
        """transformers' ViTEmbeddings.interpolate_pos_encoding: the patch grid's position embedding
        resized bicubic (align_corners=False, no antialias, in the parameter's dtype) to this image's
        grid; None (the model's own) where transformers keeps it (same token count, square image)."""
        pos = self.model.pos_embed
        patch_size = self.model.patch_embed.patch_size
        grid = (height // patch_size[0], width // patch_size[1])
        side = math.isqrt(pos.shape[1] - 1)
        if grid[0] * grid[1] == side * side and height == width:
            return None
        patches = pos[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
        return torch.cat([pos[:, :1], patches.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)], dim=1)

    # What the source classes expose besides forward
    @property
    def classifier(self) -> nn.Module:
        return self.model.head

    def set_backend(self, backend: str) -> "HFViT":
        self.model.set_backend(backend)
        return self

    def gradient_checkpointing_enable(self, **_) -> None:
        self.model.set_grad_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self.model.set_grad_checkpointing(False)

    def forward(self, pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                *, return_dict: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                output_attentions: Optional[bool] = None, interpolate_pos_encoding: Optional[bool] = None,
                bool_masked_pos: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                head_mask: Optional[torch.Tensor] = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

        unsupported = [name for name, value in [
            ("bool_masked_pos", bool_masked_pos), ("attention_mask", attention_mask), ("head_mask", head_mask),
        ] + list(kwargs.items()) if value is not None and value is not False]
        if unsupported:
            raise ValueError(f"vit_fast.optimize'd ViT: unsupported arguments {unsupported}; run the original "
                             f"transformers model for these")
        if pixel_values is None:
            raise ValueError("You have to specify pixel_values")
        if labels is not None and not self.is_classifier:
            raise ValueError("labels: a ViTModel has no classifier (use ViTForImageClassification)")
        model = self.model
        pixel_values = pixel_values.to(model.patch_embed.proj.weight.dtype)  # as transformers does
        pos_embed = self._interpolated_pos_embed(*pixel_values.shape[-2:]) if interpolate_pos_encoding else None
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        want_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if want_attentions and self.training and any(blk.attn.attn_drop.p > 0 for blk in model.blocks):
            raise ValueError("output_attentions: vit_fast returns the probabilities before dropout, transformers "
                             "after it; with attention dropout in training run the original model, or call eval()")
        attentions = None
        if want_hidden or want_attentions:
            x = model.embed(pixel_values, pos_embed)
            outputs: list[torch.Tensor] = []
            sequence = model._forward_blocks(x, outputs=outputs)
            hidden_states = (x, *outputs)
            if want_attentions:
                attentions = tuple(blk.attn.attention_probs(blk.norm1(h))
                                   for blk, h in zip(model.blocks, hidden_states))
            hidden_states = hidden_states if want_hidden else None
        else:
            sequence, hidden_states = model.forward_features(pixel_values, pos_embed), None
        if self.is_classifier:
            logits = model.forward_head(sequence)
            loss = self._loss_function(labels, logits, self.config) if labels is not None else None
            out = ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hidden_states, attentions=attentions)
        else:
            pooled = self.pooler(sequence) if self.pooler is not None else None
            out = BaseModelOutputWithPooling(last_hidden_state=sequence, pooler_output=pooled,
                                             hidden_states=hidden_states, attentions=attentions)
        want_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if want_dict else out.to_tuple()
