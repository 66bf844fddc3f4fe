"""``HFVisionFamily``: what ``vit_fast.optimize`` returns for a transformers CLIP / SigLIP / Dinov2 vision model,
a look-alike of the source class around a vit_fast VisionTransformer (``.model``), same forward signature
and output type:

  CLIPVisionModel               BaseModelOutputWithPooling(last_hidden_state = the encoder output before
                                post_layernorm, pooler_output = post_layernorm(class token))
  CLIPVisionModelWithProjection CLIPVisionModelOutput(image_embeds = visual_projection(pooled), last_hidden_state)
  SiglipVisionModel             BaseModelOutputWithPooling(last_hidden_state = post_layernorm(encoder output),
                                pooler_output = the attention-pool head's output)
  SiglipForImageClassification  ImageClassifierOutput(loss with labels, logits = classifier(mean of tokens))
  Dinov2Model                   BaseModelOutputWithPooling(last_hidden_state = layernorm(encoder output),
                                pooler_output = its class token)
Hidden states, attention maps, masked-image inputs and interpolate_pos_encoding=True raise a clear error.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..model import VisionTransformer


class HFVisionFamily(nn.Module):
    def __init__(self, source: nn.Module, fast: VisionTransformer):
        super().__init__()
        self.model = fast
        self.config = source.config
        self.source_class = type(source).__name__
        self._loss_function = source.loss_function if self.source_class == "SiglipForImageClassification" else None

    @property
    def vit_fast_model(self) -> VisionTransformer:
        return self.model

    def set_backend(self, backend: str) -> "HFVisionFamily":
        self.model.set_backend(backend)
        return self

    def forward(self, pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None, *,
                return_dict: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                output_attentions: Optional[bool] = None, interpolate_pos_encoding: Optional[bool] = None,
                bool_masked_pos: Optional[torch.Tensor] = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

        unsupported = [name for name, bad in [
            ("output_hidden_states", output_hidden_states), ("output_attentions", output_attentions),
            ("interpolate_pos_encoding", interpolate_pos_encoding), ("bool_masked_pos", bool_masked_pos is not None),
            (f"keyword arguments {sorted(kwargs)}", kwargs),
            ("labels (only SiglipForImageClassification takes them)",
             labels is not None and self._loss_function is None),
        ] if bad]
        if pixel_values is None:
            unsupported.append("pixel_values=None (required)")
        if unsupported:
            raise ValueError(f"{self.source_class} (vit_fast): not supported: {', '.join(unsupported)}")
        m = self.model
        if self.source_class.startswith("CLIP"):
            # last_hidden_state is the stream before post_layernorm; pooled = post_layernorm(class token)
            final, [(patches, prefix)] = m.forward_intermediates(pixel_values, indices=1, output_fmt="NLC",
                                                                 return_prefix_tokens=True)
            sequence, pooled = torch.cat([prefix, patches], dim=1), final[:, 0]
            if self.source_class == "CLIPVisionModelWithProjection":
                from transformers.models.clip.modeling_clip import CLIPVisionModelOutput

                out = CLIPVisionModelOutput(image_embeds=m.head(pooled), last_hidden_state=sequence)
            else:
                out = BaseModelOutputWithPooling(last_hidden_state=sequence, pooler_output=pooled)
        elif self.source_class == "SiglipForImageClassification":
            logits = m(pixel_values)  # global_pool='avg' over the post-layernorm tokens, then the classifier
            loss = self._loss_function(labels, logits, self.config) if labels is not None else None
            out = ImageClassifierOutput(loss=loss, logits=logits)
        else:
            sequence = m.forward_features(pixel_values)
            pooled = m.attn_pool(sequence) if m.attn_pool is not None else (
                sequence[:, 0] if self.source_class == "Dinov2Model" else None)
            out = BaseModelOutputWithPooling(last_hidden_state=sequence, pooler_output=pooled)
        use_dict = return_dict if return_dict is not None else getattr(self.config, "use_return_dict", True)
        return out if use_dict else out.to_tuple()
