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
from typing import Optional

import torch
import torch.nn as nn

from ..adapters import PackedLinear
from ..layers import Attention, Block, DropPath, LayerScale, Mlp, PatchEmbed, SwiGLUPackedMlp, has_hooks
from ..layers.common import global_module_hooks, instance_forward
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


def _is_capture_hook(hook) -> bool:
    """transformers 5's own output-capturing hooks (installed for output_hidden_states and kept): inactive outside
    transformers' forward, which records through them; the linked forward gives those outputs itself."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def own_source_hooks(module: nn.Module) -> bool:
    """Whether hooks other than transformers' capture hooks, or a forward set on the instance (accelerate's
    hooks: ``device_map``, offloading), sit on ``module`` itself."""
    if instance_forward(module):
        return True
    for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                  module._backward_hooks):
        if hooks and not all(_is_capture_hook(h) for h in hooks.values()):
            return True
    return False


def source_hooks(module: nn.Module) -> bool:
    """Whether hooks other than transformers' capture hooks, or a forward set on an instance, sit on ``module`` or
    below it, global module hooks included."""
    return global_module_hooks() or source_hooks_in((module,))


def source_hooks_in(modules, skip: tuple = ()) -> bool:
    """``source_hooks`` of ``modules`` and what is below them, without the modules in ``skip`` and below them
    (compared with ``is``), global hooks not asked: a recursive walk that makes calls only for modules with
    children or with hooks (most are leaves without)."""
    for m in modules:
        if m is None or (skip and any(m is s for s in skip)):
            continue
        if ((m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
             or "forward" in m.__dict__) and own_source_hooks(m)):  # the cheap test first
            return True
        children = m._modules
        if children and source_hooks_in(children.values(), skip):
            return True
    return False


class LinkedVisionTransformer(VisionTransformer):
    _kind = "model"
    cls_token = FromSource()
    pos_embed = FromSource()
    norm_pre = FromSource()
    norm = FromSource()
    attn_pool = FromSource()
    head = FromSource()

    def _fuses_across_blocks(self, x: torch.Tensor) -> bool:
        return all(block.reads_source() for block in self.blocks) and super()._fuses_across_blocks(x)


class LinkedPatchEmbed(PatchEmbed):
    _kind = "patch_embed"
    proj = FromSource()

    def fused(self, x: torch.Tensor) -> bool:
        return super().fused(x) and not has_hooks(self._hf) and not has_hooks(self.proj)


class LinkedBlock(Block):
    """A block linked to a source layer. ``_fixed``: (parent, name, module) of every module of the layer that the
    linked parts do not read afresh at each call (containers, the activation, dropouts, layer scales), as they were
    when linked; ``_stock``: whether the layer's activation was the one its config names then; ``_dropouts``: where
    each of its dropouts reads its rate and mode (``Layout.block_dropouts``); ``_masks``: how many mask arguments
    (None) the layer is called with when it runs as transformers' own."""
    _kind = "block"
    norm1 = FromSource()
    norm2 = FromSource()

    def reads_source(self) -> bool:
        """Whether the linked parts compute what the layer computes: no hook on it or in it (a hook on its attention,
        MLP or a dropout would not fire: the parts call only the leaf modules; FSDP2's fully_shard on the layer must
        run around it), none of its fixed modules replaced (an activation, a wrapped attention, a layer scale
        put in by hand) and its attention's scale the one the kernels apply. Otherwise the layer runs as
        transformers' own module."""
        scale = self._scale
        return (self._stock and all(parent._modules.get(name) is module for parent, name, module in self._fixed)
                and (scale is None or getattr(*scale) == self.attn.scale) and not source_hooks(self._hf))

    def fuses(self, x: torch.Tensor) -> bool:
        return self.reads_source() and super().fuses(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reads_source():
            out = self._hf(x, *[None] * self._masks)
            return out[0] if isinstance(out, tuple) else out
        return super().forward(x)


@functools.lru_cache(maxsize=None)
def _mask_arguments(layer_class: type) -> Optional[int]:
    """How many required arguments a transformers layer's forward takes after the hidden states (its masks:
    attention_mask, and causal_attention_mask in transformers 4's CLIP), each passed as None; None for a forward
    taking ``*args`` (a wrapper: it gets what the source's own layers take)."""
    params = list(inspect.signature(layer_class.forward).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    params = params[1:]  # after the hidden states
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


def linked_model(source: nn.Module, config: dict, layout: "Layout",
                 activation: Optional[type] = None) -> VisionTransformer:
    """A vit_fast VisionTransformer (``config``: ViTConfig fields) with no parameters of its own that
    computes ``source``'s forward from ``source``'s modules, found through ``layout``: as many blocks as the source
    has layers now (a layer removed or appended by hand, as transformers runs them). ``activation``: the type of the
    MLP activation module the config names (a layer holding another runs as transformers' own)."""
    layers = layout.layers(source)
    with torch.device("meta"):
        model = VisionTransformer(ViTConfig(**{**config, "depth": len(layers), "weight_init": "skip"}))
    _link(model, LinkedVisionTransformer, source, layout)
    _link(model.patch_embed, LinkedPatchEmbed, layout.patch_embed(source), layout)
    masks = [_mask_arguments(type(layer)) for layer in layers]
    stock_masks = max((n for n in masks if n is not None), default=0)
    for block, layer, n in zip(model.blocks, layers, masks):
        _link(block, LinkedBlock, layer, layout)
        object.__setattr__(block, "_masks", stock_masks if n is None else n)
        object.__setattr__(block, "_scale", None)
        try:
            act, fixed, scales = layout.mlp_activation(layer), _fixed_modules(layer, layout), layout.layer_scales(layer)
        except AttributeError:  # a layer wrapped or rebuilt by hand: it runs as its own module, nothing read
            object.__setattr__(block, "_stock", False)
            object.__setattr__(block, "_fixed", ())
            for part in block.modules():
                part._parameters.clear()
                part._buffers.clear()
            continue
        object.__setattr__(block, "_stock", activation is None or act is None or type(act) is activation)
        object.__setattr__(block, "_fixed", fixed)
        object.__setattr__(block, "_scale", layout.attention_scale(layer))
        _link(block.attn, LinkedAttention, layer, layout)
        _link(block.mlp, _LINKED_MLP[type(block.mlp)], layer, layout)
        for ls, scale in zip((block.ls1, block.ls2), scales):
            if isinstance(ls, LayerScale):
                _link(ls, LinkedLayerScale, scale, layout)
    layout.set_regularisation(model, source)  # first: DINOv2's drop paths are put in place there
    for block, layer in zip(model.blocks, layers):
        object.__setattr__(block, "_dropouts", layout.block_dropouts(block, layer) if block._stock else ())
    layout.follow_regularisation(model, source)
    leftover = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    if leftover:
        raise RuntimeError(f"vit_fast: the linked model kept tensors of its own: {leftover}")
    return model


def _fixed_modules(layer: nn.Module, layout: "Layout") -> tuple:
    """(parent, name, module) for every module inside ``layer`` except the parts the linked block reads at each
    call (q, k, v, the output projection, fc1, fc2, the norms: PEFT or the user may replace those) and theirs."""
    read = set(map(id, layout.read_parts(layer)))
    fixed, stack = [], [layer]
    while stack:
        parent = stack.pop()
        for name, module in parent._modules.items():
            if module is not None and id(module) not in read:
                fixed.append((parent, name, module))
                stack.append(module)
    return tuple(fixed)


def _follow(dropout: nn.Module, rate: float, training: bool) -> None:
    """A linked model's dropout (or DropPath) module takes the source's rate and train/eval mode."""
    name = "drop_prob" if isinstance(dropout, DropPath) else "p"
    if getattr(dropout, name) != rate:
        setattr(dropout, name, float(rate))
    if dropout.training != training:
        dropout.training = training


def _module_rate(module: Optional[nn.Module]) -> tuple[float, bool]:
    """(rate, training) of a source's dropout module (nn.Dropout's p, a drop path's drop_prob; 0 for anything
    else, e.g. an Identity put in its place)."""
    if module is None:
        return 0.0, False
    return float(getattr(module, "p", getattr(module, "drop_prob", 0.0))), module.training


# ---------------------------------------------------------------------------------------------- layouts
class Layout:
    """Where a source family keeps each part: ``<kind>_<name>(module)`` returns the source's counterpart
    of a vit_fast part's attribute, given the source module linked to that part (the model: the source
    itself; the patch embedding: ``patch_embed(source)``; a block, its attention and MLP: the layer; a
    LayerScale: ``layer_scales(layer)``)."""

    # whether the linked forward calls the final norm as transformers does (CLIP's post_layernorm: it normalises the
    # class token alone there, so a hook on it runs transformers' forward)
    final_norm_called = True

    def encoder(self, source: nn.Module) -> nn.Module:
        return source

    def layers(self, source: nn.Module) -> nn.ModuleList:
        raise NotImplementedError

    def patch_embed(self, source: nn.Module) -> nn.Module:
        raise NotImplementedError

    def layer_scales(self, layer: nn.Module) -> tuple:
        return (None, None)

    def set_regularisation(self, model: VisionTransformer, source: nn.Module) -> None:
        """Dropout and stochastic-depth modules where the family applies them elsewhere than timm's blocks do (the
        config gives timm's placement). Nothing to change by default (CLIP, SigLIP: attention dropout only)."""

    def follow_regularisation(self, model: VisionTransformer, source: nn.Module) -> None:
        """Every dropout and drop path of the linked model takes the rate and the train/eval mode the source's
        counterpart has now (read before each forward: a rate set or a submodule put in eval by hand after
        optimize, e.g. a backbone in eval under a training classifier, is the source's): the embeddings' here,
        each block's from the holders found when it was linked (``block_dropouts``)."""
        self.follow_embeddings_dropout(model, source)
        for block in model.blocks:
            for dropout, holder, rate_name, mode_also in block._dropouts:
                # no holder (none in the source, an Identity): rate 0 in the linked model's own mode
                rate, training = (float(getattr(holder, rate_name) or 0.0), holder.training) if holder is not None \
                    else (0.0, dropout.training)
                _follow(dropout, rate, training)
                if mode_also is not None and mode_also.training != training:
                    mode_also.training = training

    def follow_embeddings_dropout(self, model: VisionTransformer, source: nn.Module) -> None:
        """None by default (CLIP, SigLIP)."""

    def block_dropouts(self, block: nn.Module, layer: nn.Module) -> tuple:
        """(linked dropout, the source module holding its rate and mode or None for 0, the rate's attribute, a linked
        module that also takes the mode) per dropout of a block. By default (CLIP, SigLIP) attention dropout only:
        the attention module's float rate, applied while it trains."""
        return (self.attention_dropout(block, layer.self_attn, "dropout"),)

    @staticmethod
    def attention_dropout(block: nn.Module, attention: nn.Module, rate_name: str) -> tuple:
        """transformers 5's attention modules hold their dropout as a float applied while the module trains;
        transformers 4's ViT / DINOv2 a Dropout module (``attention.dropout``). The attention kernels apply
        attn_drop's rate while the linked attention trains: it takes the mode too."""
        holder = getattr(attention, rate_name, None)
        if isinstance(holder, nn.Module):
            return block.attn.attn_drop, holder, "p", block.attn
        return block.attn.attn_drop, attention, rate_name, block.attn

    def read_parts(self, layer: nn.Module) -> list:
        """The modules of a layer the linked parts read at each call (``_fixed_modules``)."""
        parts = []
        for part in (self.attn_qkv(layer), self.attn_proj(layer), self.mlp_fc1(layer), self.mlp_fc2(layer),
                     self.block_norm1(layer), self.block_norm2(layer)):
            parts.extend(part.parts if isinstance(part, PackedLinear) else (part,))
        return parts

    def attention_scale(self, layer: nn.Module) -> Optional[tuple]:
        """(module, attribute) holding the scale transformers 5's attention applies (``scaling``; CLIP and SigLIP
        ``scale``), None where there is none to read (transformers 4)."""
        for holder in ("attention", "self_attn"):
            module = layer._modules.get(holder)
            if module is not None:
                for name in ("scaling", "scale"):
                    if isinstance(getattr(module, name, None), float):
                        return module, name
        return None

    def mlp_activation(self, layer: nn.Module) -> Optional[nn.Module]:
        """The layer's MLP activation module (transformers 5: mlp.activation_fn; 4: intermediate.intermediate_act_fn),
        None where the MLP has none of these (a SwiGLU)."""
        for holder, name in (("mlp", "activation_fn"), ("intermediate", "intermediate_act_fn")):
            module = layer._modules.get(holder)
            if module is not None and name in module._modules:
                return module._modules[name]
        return None

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

    def follow_embeddings_dropout(self, model, source):
        _follow(model.pos_drop, *_module_rate(self.encoder(source).embeddings._modules.get("dropout")))

    def block_dropouts(self, block, layer):
        """The attention's; after the attention output and the MLP the layer's one ``dropout`` module (transformers
        5) or attention.output's and output's (transformers 4)."""
        attention = layer.attention
        if "attention" in attention._modules:  # transformers 4
            return (self.attention_dropout(block, attention.attention, "dropout"),
                    (block.attn.proj_drop, attention.output._modules.get("dropout"), "p", None),
                    (block.mlp.drop2, layer.output._modules.get("dropout"), "p", None))
        dropout = layer._modules.get("dropout")
        return (self.attention_dropout(block, attention, "attention_dropout"),
                (block.attn.proj_drop, dropout, "p", None), (block.mlp.drop2, dropout, "p", None))


class CLIPLayout(Layout):
    """transformers CLIPVisionModel / CLIPVisionModelWithProjection (class token and position table kept
    as a vector and an Embedding: read as timm's (1, 1, D) and (1, N, D) views)."""

    final_norm_called = False

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

    final_norm_called = True  # over every token, as transformers

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
        for block in model.blocks:
            block.mlp.drop1.p = block.mlp.drop2.p = 0.0
            block.drop_path1, block.drop_path2 = DropPath(), DropPath()  # rates: follow_regularisation

    def follow_embeddings_dropout(self, model, source):
        _follow(model.pos_drop, *_module_rate(self.encoder(source).embeddings._modules.get("dropout")))

    def block_dropouts(self, block, layer):
        """The attention's, transformers 4's after the attention output, and the layer's drop path on both
        branches."""
        attention, drop_path = layer.attention, layer._modules.get("drop_path")
        drop_path = drop_path if hasattr(drop_path, "drop_prob") else None  # Identity: no drop path
        paths = ((block.drop_path1, drop_path, "drop_prob", None), (block.drop_path2, drop_path, "drop_prob", None))
        if "attention" in attention._modules:  # transformers 4
            output = attention._modules.get("output")
            return (self.attention_dropout(block, attention.attention, "dropout"),
                    (block.attn.proj_drop, output._modules.get("dropout") if output is not None else None, "p",
                     None), *paths)
        return (self.attention_dropout(block, attention, "attention_dropout"), (block.attn.proj_drop, None, "p", None),
                *paths)
