"""A vit_fast VisionTransformer *linked* to another library's model: built on meta from the same config, its
parts read the source's modules and parameters at every access (``FromSource`` attributes), so it owns no
parameters and a module PEFT or the user replaces in the source later is the one that runs.

Where each part lives in the source is a ``Layout`` (one per family: transformers ViT, CLIP, SigLIP,
DINOv2). Only the parts the vit_fast model really has are linked (a CLIP model's ``norm_pre``, a DINOv2
block's LayerScale); the rest keep vit_fast's placeholders (Identity, None). Imports nothing from
transformers: the layouts only follow attribute names.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn

from ..adapters import PackedLinear
from ..layers import Attention, Block, DropPath, LayerScale, Mlp, PatchEmbed, SwiGLUPackedMlp, has_hooks
from ..model import VisionTransformer
from ..presets import ViTConfig


class FromSource:
    """A linked part's attribute read from the source through its layout (``<kind>_<name>``) when linked,
    else the part's own module or parameter (a placeholder the source has no counterpart for)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, part, owner=None):
        if part is None:
            return self
        if self.name in part._linked:
            return getattr(part._layout, f"{part._kind}_{self.name}")(part._hf)
        return nn.Module.__getattr__(part, self.name)


def own_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks)


class LinkedVisionTransformer(VisionTransformer):
    _kind = "model"
    cls_token = FromSource()
    pos_embed = FromSource()
    norm_pre = FromSource()
    norm = FromSource()
    attn_pool = FromSource()
    head = FromSource()

    def _fuses_across_blocks(self, x: torch.Tensor) -> bool:
        return super()._fuses_across_blocks(x) and not has_hooks(self._layout.layers(self._hf))


class LinkedPatchEmbed(PatchEmbed):
    _kind = "patch_embed"
    proj = FromSource()

    def fused(self, x: torch.Tensor) -> bool:
        return super().fused(x) and not has_hooks(self._hf) and not has_hooks(self.proj)


class LinkedBlock(Block):
    _kind = "block"
    norm1 = FromSource()
    norm2 = FromSource()

    def fuses(self, x: torch.Tensor) -> bool:
        return super().fuses(x) and not has_hooks(self._hf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if own_hooks(self._hf):  # e.g. FSDP2's fully_shard on the layer: its hooks must run around it
            out = self._hf(x, *[None] * _mask_arguments(type(self._hf)))
            return out[0] if isinstance(out, tuple) else out
        return super().forward(x)


@functools.lru_cache(maxsize=None)
def _mask_arguments(layer_class: type) -> int:
    """How many required arguments a transformers layer's forward takes after the hidden states (its masks:
    attention_mask, and causal_attention_mask in transformers 4's CLIP), each passed as None."""
    params = list(inspect.signature(layer_class.forward).parameters.values())[2:]
    return sum(1 for p in params if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


class LinkedAttention(Attention):
    _kind = "attn"
    qkv = FromSource()
    proj = FromSource()


class LinkedMlpParts:
    _kind = "mlp"
    fc1 = FromSource()
    fc2 = FromSource()


class LinkedMlp(LinkedMlpParts, Mlp):
    pass


class LinkedSwiGLUPackedMlp(LinkedMlpParts, SwiGLUPackedMlp):
    """fc1 is the packed [gate | value] projection (DINOv2-g)."""


class LinkedLayerScale(LayerScale):
    _kind = "ls"
    gamma = FromSource()


_LINKED_MLP = {Mlp: LinkedMlp, SwiGLUPackedMlp: LinkedSwiGLUPackedMlp}


def _has_part(part: nn.Module, name: str) -> bool:
    value = part._parameters.get(name, part._modules.get(name, part.__dict__.get(name)))
    return value is not None and not isinstance(value, nn.Identity)


def _link(part: nn.Module, cls: type, source_module: nn.Module, layout: "Layout") -> None:
    """Make ``part`` read ``source_module`` (a plain attribute, outside the module tree) through the
    attributes of ``cls`` it really has (not None, not Identity), dropping the placeholders they shadow."""
    linked = frozenset(name for klass in cls.__mro__ for name, value in vars(klass).items()
                       if isinstance(value, FromSource) and _has_part(part, name))
    part.__class__ = cls
    for name, value in (("_hf", source_module), ("_layout", layout), ("_linked", linked)):
        object.__setattr__(part, name, value)
    for name in linked:
        if not hasattr(layout, f"{cls._kind}_{name}"):
            raise RuntimeError(f"vit_fast: {type(layout).__name__} has no counterpart for {cls._kind}.{name}")
        part._modules.pop(name, None)
        part._parameters.pop(name, None)
        part.__dict__.pop(name, None)


def links_to(model: VisionTransformer, source: nn.Module) -> bool:
    """Whether ``model`` (a linked model) reads ``source`` and its current layers and patch embedding."""
    layout = model._layout
    layers = layout.layers(source)
    return (model._hf is source and model.patch_embed._hf is layout.patch_embed(source)
            and len(layers) == len(model.blocks) and all(b._hf is layer for b, layer in zip(model.blocks, layers)))


def carry_settings(old: VisionTransformer, new: VisionTransformer) -> None:
    """The switches set on a previous linked model, on its replacement."""
    from ..route import apply_route

    new.set_backend(old.backend)
    new.set_grad_checkpointing(old.grad_checkpointing)
    new.residual_in_fp32 = new.config.residual_in_fp32 = old.residual_in_fp32
    apply_route(new, old.route, explicit=old.route_explicit)
    new._route_device = old._route_device
    new.train(old.training)


def linked_model(source: nn.Module, config: dict, layout: "Layout") -> VisionTransformer:
    """A vit_fast VisionTransformer (``config``: ViTConfig fields) with no parameters of its own that
    computes ``source``'s forward from ``source``'s modules, found through ``layout``."""
    with torch.device("meta"):
        model = VisionTransformer(ViTConfig(**{**config, "weight_init": "skip"}))
    _link(model, LinkedVisionTransformer, source, layout)
    _link(model.patch_embed, LinkedPatchEmbed, layout.patch_embed(source), layout)
    layers = layout.layers(source)
    if len(layers) != len(model.blocks):
        raise RuntimeError(f"vit_fast: the source has {len(layers)} layers, its config {len(model.blocks)}")
    for block, layer in zip(model.blocks, layers):
        _link(block, LinkedBlock, layer, layout)
        _link(block.attn, LinkedAttention, layer, layout)
        _link(block.mlp, _LINKED_MLP[type(block.mlp)], layer, layout)
        for ls, scale in zip((block.ls1, block.ls2), layout.layer_scales(layer)):
            if isinstance(ls, LayerScale):
                _link(ls, LinkedLayerScale, scale, layout)
    layout.set_regularisation(model, source)
    leftover = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    if leftover:
        raise RuntimeError(f"vit_fast: the linked model kept tensors of its own: {leftover}")
    return model


# ---------------------------------------------------------------------------------------------- layouts
class Layout:
    """Where a source family keeps each part: ``<kind>_<name>(module)`` returns the source's counterpart
    of a vit_fast part's attribute, given the source module linked to that part (the model: the source
    itself; the patch embedding: ``patch_embed(source)``; a block, its attention and MLP: the layer; a
    LayerScale: ``layer_scales(layer)``)."""

    def encoder(self, source: nn.Module) -> nn.Module:
        return source

    def layers(self, source: nn.Module) -> nn.ModuleList:
        raise NotImplementedError

    def patch_embed(self, source: nn.Module) -> nn.Module:
        raise NotImplementedError

    def layer_scales(self, layer: nn.Module) -> tuple:
        return (None, None)

    def set_regularisation(self, model: VisionTransformer, source: nn.Module) -> None:
        """Dropout and stochastic-depth rates where the family applies them elsewhere than timm's blocks do (the
        config gives timm's placement); the rates are read from the source's modules. Nothing to change by
        default (CLIP, SigLIP: attention dropout only)."""

    # the attention and MLP of transformers' pre-norm layers (CLIP, SigLIP; ViT and DINOv2 override)
    def attn_qkv(self, layer: nn.Module) -> PackedLinear:
        return PackedLinear(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)

    def attn_proj(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn.out_proj

    def mlp_fc1(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.fc1

    def mlp_fc2(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.fc2

    def block_norm1(self, layer: nn.Module) -> nn.Module:
        return layer.layer_norm1

    def block_norm2(self, layer: nn.Module) -> nn.Module:
        return layer.layer_norm2

    def __reduce__(self):  # the layouts hold no state: unpickle to the same singleton
        return (type(self), ())


class ViTLayout(Layout):
    """transformers ViTModel / ViTForImageClassification. transformers 5 names a layer's parts
    attention.{q,k,v,o}_proj and mlp.fc1 / fc2; transformers 4 attention.attention.{query,key,value},
    attention.output.dense, intermediate.dense and output.dense: whichever the layer has."""

    def encoder(self, source):
        return getattr(source, "vit", source)

    def layers(self, source):
        vit = self.encoder(source)
        return vit.layers if "layers" in vit._modules else vit.encoder.layer

    def patch_embed(self, source):
        return self.encoder(source).embeddings.patch_embeddings

    def patch_embed_proj(self, patch):
        return patch.projection

    def model_cls_token(self, source):
        return self.encoder(source).embeddings.cls_token

    def model_pos_embed(self, source):
        return self.encoder(source).embeddings.position_embeddings

    def model_norm(self, source):
        return self.encoder(source).layernorm

    def model_head(self, source):
        return source.classifier

    def attn_qkv(self, layer):
        a = layer.attention
        if "q_proj" in a._modules:
            return PackedLinear(a.q_proj, a.k_proj, a.v_proj)
        return PackedLinear(a.attention.query, a.attention.key, a.attention.value)

    def attn_proj(self, layer):
        return layer.attention.o_proj if "o_proj" in layer.attention._modules else layer.attention.output.dense

    def mlp_fc1(self, layer):
        return layer.mlp.fc1 if "mlp" in layer._modules else layer.intermediate.dense

    def mlp_fc2(self, layer):
        return layer.mlp.fc2 if "mlp" in layer._modules else layer.output.dense

    def block_norm1(self, layer):
        return layer.layernorm_before

    def block_norm2(self, layer):
        return layer.layernorm_after

    def set_regularisation(self, model, source):
        """transformers' ViT drops after the attention output and after the MLP (hidden_dropout_prob), not after
        the GELU as timm's Mlp also does (drop1)."""
        for block in model.blocks:
            block.mlp.drop1.p = 0.0


class CLIPLayout(Layout):
    """transformers CLIPVisionModel / CLIPVisionModelWithProjection (class token and position table kept
    as a vector and an Embedding: read as timm's (1, 1, D) and (1, N, D) views)."""

    def encoder(self, source):
        return getattr(source, "vision_model", source)

    def layers(self, source):
        return self.encoder(source).encoder.layers

    def patch_embed(self, source):
        return self.encoder(source).embeddings.patch_embedding

    def patch_embed_proj(self, conv):
        return conv

    def model_cls_token(self, source):
        return self.encoder(source).embeddings.class_embedding.view(1, 1, -1)

    def model_pos_embed(self, source):
        return self.encoder(source).embeddings.position_embedding.weight.unsqueeze(0)

    def model_norm_pre(self, source):
        return self.encoder(source).pre_layrnorm

    def model_norm(self, source):
        return self.encoder(source).post_layernorm

    def model_head(self, source):
        return source.visual_projection


class SiglipLayout(CLIPLayout):
    """transformers SiglipVisionModel / SiglipForImageClassification: no class token; the attention-pool
    head runs as transformers' own module (it is not one of the fused parts)."""

    def model_attn_pool(self, source):
        return self.encoder(source).head

    def model_head(self, source):
        return source.classifier


class Dinov2Layout(ViTLayout):
    """transformers Dinov2Model: ViT's embeddings, attention and final norm; LayerScale's ``lambda1``; the
    SwiGLU MLP's gate and value projections read as timm's packed [gate | value] fc1 (transformers 5:
    gate_proj / up_proj / down_proj; 4.x: weights_in / weights_out)."""

    def layer_scales(self, layer):
        return (layer.layer_scale1, layer.layer_scale2)

    def ls_gamma(self, scale):
        return scale.lambda1

    def mlp_fc1(self, layer):
        mlp = layer.mlp
        if "gate_proj" in mlp._modules:
            return PackedLinear(mlp.gate_proj, mlp.up_proj)
        return mlp.weights_in if "weights_in" in mlp._modules else mlp.fc1

    def mlp_fc2(self, layer):
        mlp = layer.mlp
        for name in ("down_proj", "weights_out", "fc2"):
            if name in mlp._modules:
                return mlp._modules[name]
        raise AttributeError(f"vit_fast: no output projection in {type(mlp).__name__}")

    def block_norm1(self, layer):
        return layer.norm1

    def block_norm2(self, layer):
        return layer.norm2

    def set_regularisation(self, model, source):
        """transformers' DINOv2 drops (hidden_dropout_prob) after the embeddings only, and gives every layer the
        same stochastic depth (drop_path_rate), where timm ramps it from 0 over the blocks; transformers 4 also
        dropped after the attention output (its attention.output.dropout)."""
        model.pos_drop.p = self.encoder(source).embeddings.dropout.p
        for block, layer in zip(model.blocks, self.layers(source)):
            output = getattr(layer.attention, "output", None)
            block.attn.proj_drop.p = output.dropout.p if isinstance(getattr(output, "dropout", None), nn.Dropout) \
                else 0.0
            block.mlp.drop1.p = block.mlp.drop2.p = 0.0
            rate = float(getattr(layer.drop_path, "drop_prob", 0.0))
            block.drop_path1, block.drop_path2 = ((DropPath(rate), DropPath(rate)) if rate > 0
                                                  else (nn.Identity(), nn.Identity()))
