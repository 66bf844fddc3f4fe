"""A transformers ViTModel / ViTForImageClassification that keeps its own modules and runs vit_fast's forward,
what ``vit_fast.optimize`` returns for a transformers source (imports transformers: not on the library floor).

``optimize_hf(source)`` returns a copy of the source whose class is a subclass of the source's class with the
same name (``isinstance(model, transformers.ViTForImageClassification)`` holds, ``config.architectures`` and
``save_pretrained`` are transformers' own), whose module tree is untouched (``model.vit.encoder.layer[i]
.attention.attention.query``: PEFT targets, freezing and per-layer learning rates by name work as on the
source) and whose ``forward`` runs a vit_fast VisionTransformer *linked* to those modules: its parts read
transformers' modules through properties at every call (q, k and v are concatenated per step into the
packed qkv the kernels take, vit_fast/adapters.py ``PackedLinear``), so a module PEFT or the user replaces
later is the one that runs. The linked model owns no parameters; it is kept outside the module tree.
As in Liger-Kernel, the layers stay transformers'; only the forward is vit_fast's.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel, ViTConfig
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from ..adapters import PackedLinear
from ..layers import Attention, Block, Mlp, PatchEmbed, has_hooks
from ..model import VisionTransformer
from ..presets import ViTConfig as VitFastConfig
from .convert import hf_vit_config


class HFViT:
    """What the optimized transformers ViT classes add to the source's class (a mixin placed before it):
    ``forward`` through the linked vit_fast model (``vit_fast_model``), checkpointing and backend switches
    routed to it, and ``from_pretrained`` that loads with transformers and optimizes.

    ``forward`` returns BaseModelOutputWithPooling (ViTModel: last_hidden_state, pooler_output) or
    ImageClassifierOutput (loss when labels are given, logits), or their tuples with return_dict=False.
    Keyword arguments as transformers' TransformersKwargs: ``num_items_in_batch`` goes to the loss function
    (as the source passes it), ``output_hidden_states`` / ``output_attentions`` / ``return_dict`` as the
    source; any other one (non-None) is refused. With output_attentions each block's softmax probabilities
    (B, heads, N, N) are recomputed on the reference path, with gradients (HF's eager attention returns them
    after dropout: with attention dropout active in training this is refused). interpolate_pos_encoding
    resizes the position embedding as transformers does (bicubic, no antialias) for any image size
    divisible by the patch. Masked-patch pre-training inputs and attention masks raise a clear error.
    """

    @property
    def vit_fast_model(self) -> VisionTransformer:
        """The vit_fast VisionTransformer linked to this model's modules (it holds no parameters)."""
        return self.__dict__["_vit_fast_model"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, backend: str = "auto",
                        residual_in_fp32: bool = True, **kwargs):
        """Load a ViTModel / ViTForImageClassification directory or hub id (the class named in its
        config.json) with transformers, then ``vit_fast.optimize`` it."""
        from .optimize import optimize

        config = kwargs.pop("config", None) or ViTConfig.from_pretrained(pretrained_model_name_or_path)
        classifier = "ViTForImageClassification" in (config.architectures or [])
        source_class = transformers.ViTForImageClassification if classifier else transformers.ViTModel
        source = source_class.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        return optimize(source, backend=backend, residual_in_fp32=residual_in_fp32)

    def to_transformers(self) -> PreTrainedModel:
        """The stock transformers class holding these weights (shared, not copied): built on the meta device
        and assigned the tensors."""
        stock_class = next(c for c in type(self).__mro__ if c.__module__.startswith("transformers."))
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            kwargs = {} if stock_class is transformers.ViTForImageClassification else \
                dict(add_pooling_layer=getattr(self, "pooler", None) is not None)
            stock = stock_class(copy.deepcopy(self.config), **kwargs)
        stock.load_state_dict(self.state_dict(), strict=True, assign=True)
        return stock.train(self.training)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Optional[dict] = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Checkpoint every block (what the Trainer calls for gradient_checkpointing=True). vit_fast's
        checkpointing is non-reentrant; a use_reentrant in the kwargs changes nothing in the results.
        Checkpointing only some blocks and offloading are not implemented (a clear error)."""
        if every_n_layers != 1 or offload:
            raise ValueError(f"vit_fast.optimize'd ViT: activation checkpointing of every block only (got "
                             f"every_n_layers={every_n_layers}, offload={offload})")
        self.vit_fast_model.set_grad_checkpointing(True)

    def activation_checkpointing_disable(self) -> None:
        self.vit_fast_model.set_grad_checkpointing(False)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[dict] = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """transformers' older name of ``activation_checkpointing_enable``."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.vit_fast_model.grad_checkpointing

    is_gradient_checkpointing = is_activation_checkpointing

    def set_backend(self, backend: str):
        self.vit_fast_model.set_backend(backend)
        return self

    def _interpolated_pos_embed(self, height: int, width: int) -> Optional[torch.Tensor]:
        """transformers' ViTEmbeddings.interpolate_pos_encoding: the patch grid's position embedding
        resized bicubic (align_corners=False, no antialias, in the parameter's dtype) to this image's
        grid; None (the model's own) where transformers keeps it (same token count, square image)."""
        pos = self.vit_fast_model.pos_embed
        patch_size = self.vit_fast_model.patch_embed.patch_size
        grid = (height // patch_size[0], width // patch_size[1])
        side = math.isqrt(pos.shape[1] - 1)
        if grid[0] * grid[1] == side * side and height == width:
            return None
        patches = pos[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
        return torch.cat([pos[:, :1], patches.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)], dim=1)

    def _forward(self, pixel_values: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
                 interpolate_pos_encoding: Optional[bool] = None, attention_mask: Optional[torch.Tensor] = None,
                 bool_masked_pos: Optional[torch.Tensor] = None, return_dict: Optional[bool] = None,
                 output_hidden_states: Optional[bool] = None, output_attentions: Optional[bool] = None,
                 num_items_in_batch: Optional[torch.Tensor] = None, **kwargs):
        unsupported = [name for name, value in [
            ("bool_masked_pos", bool_masked_pos), ("attention_mask", attention_mask),
        ] + list(kwargs.items()) if value is not None and value is not False]
        if unsupported:
            raise ValueError(f"vit_fast.optimize'd ViT: unsupported arguments {unsupported}; run the original "
                             f"transformers model for these")
        if pixel_values is None:
            raise ValueError("You have to specify pixel_values")
        is_classifier = isinstance(self, transformers.ViTForImageClassification)
        if labels is not None and not is_classifier:
            raise ValueError("labels: a ViTModel has no classifier (use ViTForImageClassification)")
        model = self.vit_fast_model
        if model.training != self.training:  # the linked model's own dropout modules follow this one
            model.train(self.training)
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
        if is_classifier:
            logits = model.forward_head(sequence)
            loss_kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            loss = self.loss_function(labels, logits, self.config, **loss_kwargs) if labels is not None else None
            out = ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hidden_states, attentions=attentions)
        else:
            pooler = getattr(self, "pooler", None)
            pooled = pooler(sequence) if pooler is not None else None
            out = BaseModelOutputWithPooling(last_hidden_state=sequence, pooler_output=pooled,
                                             hidden_states=hidden_states, attentions=attentions)
        want_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if want_dict else out.to_tuple()


class HFViTForImageClassification(HFViT):
    def forward(self, pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                interpolate_pos_encoding: Optional[bool] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs):
        return self._forward(pixel_values, labels=labels, interpolate_pos_encoding=interpolate_pos_encoding,
                             attention_mask=attention_mask, **kwargs)


class HFViTModel(HFViT):
    def forward(self, pixel_values: Optional[torch.Tensor] = None, bool_masked_pos: Optional[torch.Tensor] = None,
                interpolate_pos_encoding: Optional[bool] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs):
        if kwargs.get("labels") is not None:
            raise ValueError("labels: a ViTModel has no classifier (use ViTForImageClassification)")
        return self._forward(pixel_values, bool_masked_pos=bool_masked_pos,
                             interpolate_pos_encoding=interpolate_pos_encoding, attention_mask=attention_mask, **kwargs)


# The optimized classes carry the source classes' names (config.architectures, save_pretrained and the Hub
# see transformers' names); module-level so that pickling finds them.
class ViTForImageClassification(HFViTForImageClassification, transformers.ViTForImageClassification):
    pass


class ViTModel(HFViTModel, transformers.ViTModel):
    pass


# ------------------------------------------------------------------------------ the linked vit_fast model
class _LinkedPatchEmbed(PatchEmbed):
    proj = property(lambda self: self._hf.projection)

    def fused(self, x: torch.Tensor) -> bool:
        return super().fused(x) and not has_hooks(self._hf)


# transformers 5 names a layer's parts attention.{q,k,v,o}_proj and mlp.fc1 / fc2; transformers 4 (and
# checkpoints' old names) attention.attention.{query,key,value}, attention.output.dense, intermediate.dense
# and output.dense. Looked up at each call: whichever the model has, and whatever has replaced it since.
def _qkv(attention: nn.Module) -> PackedLinear:
    if "q_proj" in attention._modules:
        return PackedLinear(attention.q_proj, attention.k_proj, attention.v_proj)
    return PackedLinear(attention.attention.query, attention.attention.key, attention.attention.value)


def _out_proj(attention: nn.Module) -> nn.Module:
    return attention.o_proj if "o_proj" in attention._modules else attention.output.dense


def _fc1(layer: nn.Module) -> nn.Module:
    return layer.mlp.fc1 if "mlp" in layer._modules else layer.intermediate.dense


def _fc2(layer: nn.Module) -> nn.Module:
    return layer.mlp.fc2 if "mlp" in layer._modules else layer.output.dense


def _layers(vit: nn.Module) -> nn.ModuleList:
    return vit.layers if "layers" in vit._modules else vit.encoder.layer


class _LinkedAttention(Attention):
    qkv = property(lambda self: _qkv(self._hf))
    proj = property(lambda self: _out_proj(self._hf))


class _LinkedMlp(Mlp):
    fc1 = property(lambda self: _fc1(self._hf))
    fc2 = property(lambda self: _fc2(self._hf))


class _LinkedBlock(Block):
    norm1 = property(lambda self: self._hf.layernorm_before)
    norm2 = property(lambda self: self._hf.layernorm_after)

    def fuses(self, x: torch.Tensor) -> bool:
        return super().fuses(x) and not has_hooks(self._hf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _own_hooks(self._hf):  # e.g. FSDP2's fully_shard on the layer: its hooks must run around it
            out = self._hf(x)
            return out[0] if isinstance(out, tuple) else out
        return super().forward(x)


class _LinkedVisionTransformer(VisionTransformer):
    cls_token = property(lambda self: self._hf.embeddings.cls_token)
    pos_embed = property(lambda self: self._hf.embeddings.position_embeddings)
    norm = property(lambda self: self._hf.layernorm)
    head = property(lambda self: self._head_owner.classifier if self._head_owner is not None
                    else self._modules["head"])

    def _fuses_across_blocks(self, x: torch.Tensor) -> bool:
        return super()._fuses_across_blocks(x) and not has_hooks(_layers(self._hf))


def _own_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks)


def _link(part: nn.Module, cls: type, hf_module: nn.Module, shadowed: tuple[str, ...]) -> None:
    """Make ``part`` read ``hf_module`` (kept as a plain attribute, outside the module tree) through the
    properties of ``cls``, dropping the placeholders those properties shadow."""
    part.__class__ = cls
    object.__setattr__(part, "_hf", hf_module)
    for name in shadowed:
        part._modules.pop(name, None)
        part._parameters.pop(name, None)


def linked_model(source: nn.Module) -> VisionTransformer:
    """A vit_fast VisionTransformer (no parameters of its own) that computes ``source``'s forward from
    ``source``'s modules."""
    vit = getattr(source, "vit", source)
    with torch.device("meta"):
        model = VisionTransformer(VitFastConfig(**hf_vit_config(source), weight_init="skip"))
    classifier = getattr(source, "classifier", None)
    _link(model, _LinkedVisionTransformer, vit, ("cls_token", "pos_embed", "norm")
          + (("head",) if classifier is not None else ()))
    object.__setattr__(model, "_head_owner", source if classifier is not None else None)
    _link(model.patch_embed, _LinkedPatchEmbed, vit.embeddings.patch_embeddings, ("proj",))
    for block, layer in zip(model.blocks, _layers(vit)):
        _link(block, _LinkedBlock, layer, ("norm1", "norm2"))
        _link(block.attn, _LinkedAttention, layer.attention, ("qkv", "proj"))
        _link(block.mlp, _LinkedMlp, layer, ("fc1", "fc2"))
    leftover = [name for name, _ in model.named_parameters()]
    if leftover:
        raise RuntimeError(f"vit_fast: the linked model kept parameters of its own: {leftover}")
    return model


def optimize_hf(source: nn.Module) -> HFViT:
    """A copy of ``source`` (ViTModel / ViTForImageClassification) whose forward is vit_fast's, see the
    module docstring; the source is left as it was."""
    model = copy.deepcopy(source)
    model.__class__ = ViTForImageClassification if isinstance(source, transformers.ViTForImageClassification) \
        else ViTModel
    object.__setattr__(model, "_vit_fast_model", linked_model(model))
    return model
