"""What ``vit_fast.optimize`` returns for a transformers CLIP / SigLIP / DINOv2 vision model: a copy of it whose
class is a same-name subclass of the source's (``isinstance`` holds, ``config``, ``save_pretrained``, module
tree and parameter names are transformers' own: PEFT targets ``q_proj`` / ``v_proj``, freezing and
per-layer learning rates by name work as on the source), whose forward is a vit_fast VisionTransformer
linked to those modules (interop/linked.py; the layouts there say where each family keeps each part).
Same forward signature and output type as the source:

  CLIPVisionModel               BaseModelOutputWithPooling(last_hidden_state = the encoder output before
                                post_layernorm, pooler_output = post_layernorm(class token))
  CLIPVisionModelWithProjection CLIPVisionModelOutput(image_embeds = visual_projection(pooled), last_hidden_state)
  SiglipVisionModel             BaseModelOutputWithPooling(last_hidden_state = post_layernorm(encoder output),
                                pooler_output = the attention-pool head's output)
  SiglipForImageClassification  ImageClassifierOutput(loss with labels, logits = classifier(mean of tokens))
  Dinov2Model                   BaseModelOutputWithPooling(last_hidden_state = layernorm(encoder output),
                                pooler_output = its class token)
Images of another size than the config's: the position table resized by the source's own embeddings, with
interpolate_pos_encoding=True (CLIP, SigLIP) or always (DINOv2), as transformers does. Hidden states, attention
maps and masked-image inputs raise a clear error.
"""
from __future__ import annotations

from typing import Optional

import torch
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from ..backend import check_model_input
from .families import hf_config
from .hf import HFLinked
from .linked import CLIPLayout, Dinov2Layout, SiglipLayout


class HFVisionFamily(HFLinked):
    """The forward of the optimized CLIP / SigLIP / DINOv2 vision classes (see the module docstring)."""

    def vit_fast_config(self) -> dict:
        return hf_config(self)

    def _forward(self, pixel_values: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None, *,
                 return_dict: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                 output_attentions: Optional[bool] = None, interpolate_pos_encoding: Optional[bool] = None,
                 bool_masked_pos: Optional[torch.Tensor] = None, **kwargs):
        source_class = self.stock_class().__name__
        classifier = source_class == "SiglipForImageClassification"
        # the Trainer's num_items_in_batch: these classes pass it down unused, as transformers' do (their losses do
        # not take it); None or False for any other argument asks for nothing (a wrapping classifier passes
        # attention_mask=None)
        kwargs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch" and v is not None and v is not False}
        # left as None, transformers takes these from the config of the vision tower that records them (a classifier's
        # config.vision_config): set there, it asks for them too
        config = getattr(self.vit_fast_layout.encoder(self), "config", self.config)
        outputs = [(name, value) if value is not None else
                   (f"{name} (set in the config: pass {name}=False, or set config.{name} = False)",
                    getattr(config, name, False))
                   for name, value in (("output_hidden_states", output_hidden_states),
                                       ("output_attentions", output_attentions))]
        unsupported = [name for name, bad in [
            *outputs,
            ("bool_masked_pos", bool_masked_pos is not None),
            (f"keyword arguments {sorted(kwargs)}", kwargs),
            ("labels (only SiglipForImageClassification takes them)", labels is not None and not classifier),
        ] if bad]
        if pixel_values is None:
            unsupported.append("pixel_values=None (required)")
        if unsupported:
            raise ValueError(f"{source_class} (vit_fast): not supported: {', '.join(unsupported)}")
        m = self.linked_in_mode()
        pixel_values = pixel_values.to(m.patch_embed.projection_weight.dtype)  # as transformers does
        pixel_values, pos_embed = self.embedding_inputs(
            pixel_values, resize=bool(interpolate_pos_encoding) or source_class == "Dinov2Model")
        if source_class.startswith("CLIP"):
            # last_hidden_state is the stream before post_layernorm; pooled = post_layernorm(class token)
            check_model_input(pixel_values, m.patch_embed.projection_weight, m.patch_embed.in_chans)
            streams: list[torch.Tensor] = []
            final = m._forward_blocks(m.embed(pixel_values, pos_embed), outputs=streams)
            sequence, pooled = streams[-1], final[:, 0]
            if source_class == "CLIPVisionModelWithProjection":
                from transformers.models.clip.modeling_clip import CLIPVisionModelOutput

                out = CLIPVisionModelOutput(image_embeds=m.head(pooled), last_hidden_state=sequence)
            else:
                out = BaseModelOutputWithPooling(last_hidden_state=sequence,
                                                 pooler_output=m.in_layer_norm_dtype(pooled))
        elif classifier:
            # global_pool='avg' over the post-layernorm tokens, then the classifier
            logits = m.forward_head(m.forward_features(pixel_values, pos_embed=pos_embed))
            loss = self.loss_function(labels, logits, self.config) if labels is not None else None
            out = ImageClassifierOutput(loss=loss, logits=logits)
        else:
            sequence = m.forward_features(pixel_values, pos_embed=pos_embed)
            pooled = m.attn_pool(sequence) if m.attn_pool is not None else None
            sequence = m.in_layer_norm_dtype(sequence)  # post_layernorm's / layernorm's output, as transformers'
            pooled = sequence[:, 0] if source_class == "Dinov2Model" else pooled
            out = BaseModelOutputWithPooling(last_hidden_state=sequence, pooler_output=pooled)
        use_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if use_dict else out.to_tuple()


class _WithImageSize(HFVisionFamily):
    def forward(self, pixel_values: Optional[torch.Tensor] = None, interpolate_pos_encoding: Optional[bool] = None,
                **kwargs):
        if self.runs_as_transformers():
            return self.transformers_forward(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)
        return self._forward(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)


# Same names as the source classes (config.architectures and save_pretrained see transformers' names);
# module-level so that pickling finds them.
class CLIPVisionModel(_WithImageSize, transformers.CLIPVisionModel):
    vit_fast_layout = CLIPLayout()


class CLIPVisionModelWithProjection(_WithImageSize, transformers.CLIPVisionModelWithProjection):
    vit_fast_layout = CLIPLayout()


class SiglipVisionModel(_WithImageSize, transformers.SiglipVisionModel):
    vit_fast_layout = SiglipLayout()


class SiglipForImageClassification(HFVisionFamily, transformers.SiglipForImageClassification):
    vit_fast_layout = SiglipLayout()

    def forward(self, pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                interpolate_pos_encoding: Optional[bool] = None, **kwargs):
        if self.runs_as_transformers():
            return self.transformers_forward(pixel_values, labels, interpolate_pos_encoding=interpolate_pos_encoding,
                                             **kwargs)
        return self._forward(pixel_values, labels, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)


class Dinov2Model(HFVisionFamily, transformers.Dinov2Model):
    vit_fast_layout = Dinov2Layout()

    def forward(self, pixel_values: Optional[torch.Tensor] = None, bool_masked_pos: Optional[torch.Tensor] = None,
                **kwargs):
        if self.runs_as_transformers():
            return self.transformers_forward(pixel_values, bool_masked_pos=bool_masked_pos, **kwargs)
        return self._forward(pixel_values, bool_masked_pos=bool_masked_pos, **kwargs)


OPTIMIZED_CLASSES = {cls.__name__: cls for cls in (CLIPVisionModel, CLIPVisionModelWithProjection, SiglipVisionModel,
                                                   SiglipForImageClassification, Dinov2Model)}
