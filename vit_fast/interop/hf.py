"""A transformers ViTModel / ViTForImageClassification that keeps its own modules and runs vit_fast's forward,
what ``vit_fast.optimize`` returns for a transformers source (imports transformers: not on the library floor;
the CLIP / SigLIP / DINOv2 vision classes are done the same way in hf_families.py).

``optimize_hf(source)`` returns a copy of the source whose class is a subclass of the source's class with the
same name (``isinstance(model, transformers.ViTForImageClassification)`` holds, ``config.architectures`` and
``save_pretrained`` are transformers' own), whose module tree is untouched (``model.vit.encoder.layer[i]
.attention.attention.query``: PEFT targets, freezing and per-layer learning rates by name work as on the
source) and whose ``forward`` runs a vit_fast VisionTransformer *linked* to those modules: its parts read
transformers' modules at every call (interop/linked.py; q, k and v are concatenated per step into the
packed qkv the kernels take, vit_fast/adapters.py ``PackedLinear``), so a module PEFT or the user replaces
later is the one that runs. The linked model owns no parameters; it is kept outside the module tree.
As in Liger-Kernel, the layers stay transformers'; only the forward is vit_fast's.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch
import torch.nn as nn
import transformers
from transformers import PreTrainedModel, ViTConfig
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from ..adapters import torch_forwards_kept
from ..layers.common import global_module_hooks
from ..model import VisionTransformer
from .convert import hf_vit_config
from .linked import Layout, ViTLayout, carry_settings, linked_model, links_to, source_hooks_in


def require_local_directory(name_or_path) -> None:
    """A missing local directory, named: transformers takes it for a hub id and reports a malformed repo id.
    Local means a path object, an absolute path or one starting ./ ../ ~; a bare 'org/name' stays a hub id."""
    text = os.fspath(name_or_path)
    local = isinstance(name_or_path, os.PathLike) or os.path.isabs(text) or text.startswith(("./", "../", "~"))
    if local and not os.path.exists(os.path.expanduser(text)):
        raise FileNotFoundError(f"from_pretrained: no such directory {text!r}; expected a saved model directory "
                                f"(config.json and weights) or a hub id such as 'google/vit-base-patch16-224'")


class HFLinked:
    """What every optimized transformers class adds to its source class (a mixin placed before it): the
    linked vit_fast model (``vit_fast_model``, built on first use, so a model transformers constructs or
    loads itself gets one too), checkpointing and backend switches routed to it, the stock class back
    (``to_transformers``), and ``from_pretrained`` that loads with transformers and optimizes.
    A subclass names its ``vit_fast_layout`` and ``vit_fast_config()``."""

    vit_fast_layout: Layout

    def vit_fast_config(self) -> dict:
        raise NotImplementedError

    @property
    def vit_fast_model(self) -> VisionTransformer:
        """The vit_fast VisionTransformer linked to this model's modules (it holds no parameters); linked again
        where this model's layers are no longer the ones it reads (a replica nn.DataParallel made of this
        model, a layer the user replaced or removed)."""
        old = self.__dict__.get("_vit_fast_model")
        if old is not None and links_to(old, self):
            return old
        return _link(self, old)

    def configured_activation(self) -> Optional[type]:
        """The type of the MLP activation module transformers builds from this model's config (None for a callable
        or an unknown name): a layer holding another one runs as transformers' own."""
        from transformers.activations import ACT2FN

        name = getattr(self.config, "hidden_act", None)
        try:
            return type(ACT2FN[name]) if isinstance(name, str) else None
        except KeyError:
            return None

    def linked_in_mode(self) -> VisionTransformer:
        """The linked model in this model's train/eval mode, each of its dropouts with the rate and mode of the
        source's counterpart now (``Layout.follow_regularisation``)."""
        model = self.vit_fast_model
        if model.training != self.training:
            model.train(self.training)
        self.vit_fast_layout.follow_regularisation(model, self)
        return model

    def runs_as_transformers(self) -> bool:
        """Whether this call must run transformers' own forward: a hook (or global module hooks) on a module the
        linked forward does not call, outside the layers (the backbone or encoder container, the embeddings, the
        patch embedding, a position table). Hooks in a layer run that layer as transformers' (``LinkedBlock``); the
        final norm, the head, the pooler and an attention-pool head are called as modules."""
        model = self.vit_fast_model
        layout = self.vit_fast_layout
        called = [layout.layers(self)]  # compared with `is`: an id() would make torch.compile guard on each instance
        for name in ("norm", "head", "attn_pool"):
            if name in model._linked and (name != "norm" or layout.final_norm_called):
                called.append(getattr(model, name))
        for module in (getattr(self, "pooler", None), getattr(layout.encoder(self), "pooler", None)):
            if module is not None:
                called.append(module)
        # global module hooks fire on every module transformers calls; a torch class's forward replaced by a
        # library runs in transformers' modules, where the linked parts' own activation and dropout stand-ins would
        # run it in other places
        return (global_module_hooks() or not torch_forwards_kept()
                or source_hooks_in(self._modules.values(), tuple(called)))

    def transformers_forward(self, *args, **kwargs):
        """transformers' forward of this model's class on its own modules (arguments left as None dropped). Its
        output capturing (hidden states, attentions) looks the class up by name: this class takes the source
        class's entry."""
        try:
            from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
        except ImportError:  # a transformers without the registry records outputs otherwise
            pass
        else:
            if not _CAN_RECORD_REGISTRY.get(self) and getattr(self, "_can_record_outputs", None):
                _CAN_RECORD_REGISTRY[self] = self._can_record_outputs
        return self.stock_class().forward(self, *args, **{k: v for k, v in kwargs.items() if v is not None})

    def embedding_inputs(self, pixel_values: torch.Tensor, resize: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(images, position embedding) for the model's embedding. At the model's own size: the images and None (its
        table). At another size with ``resize`` (transformers' interpolate_pos_encoding=True; DINOv2 always
        resizes): the images cut to whole patches (transformers' stride-p convolution never reads the pixels past
        the last whole patch, so they get a zero gradient there too) and the table as the source's own embeddings
        resize it (their ``interpolate_pos_encoding``: transformers' numerics by construction, gradients reaching
        the table). Without ``resize``: transformers' error naming the argument."""
        model = self.vit_fast_model
        if pixel_values.dim() != 4:
            return pixel_values, None  # the model's input check says what it expected
        height, width = pixel_values.shape[-2:]
        size = tuple(model.patch_embed.img_size)
        if (height, width) == size:
            return pixel_values, None
        if not resize:
            raise ValueError(f"Input image size ({height}*{width}) doesn't match model ({size[0]}*{size[1]}); "
                             "pass interpolate_pos_encoding=True to resize the position embedding, as transformers "
                             "does")
        patch_h, patch_w = model.patch_embed.patch_size
        whole = pixel_values[..., :height - height % patch_h, :width - width % patch_w]
        grid = model.patch_embed.check_input(whole, any_size=True)
        prefix = model.pos_embed.shape[1] - model.patch_embed.num_patches  # class token's row, where it has one
        # transformers reads only the embeddings' shape from its first argument
        tokens = torch.empty((1, prefix + grid[0] * grid[1], model.embed_dim), device="meta")
        return whole, self.vit_fast_layout.encoder(self).embeddings.interpolate_pos_encoding(tokens, height, width)

    @classmethod
    def stock_class(cls) -> type:
        return next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, backend: str = "auto",
                        residual_in_fp32: bool = True, **kwargs):
        """Load with the transformers class this one optimizes, then ``vit_fast.optimize`` it."""
        from .optimize import optimize

        require_local_directory(pretrained_model_name_or_path)
        source = cls.stock_class().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return optimize(source, backend=backend, residual_in_fp32=residual_in_fp32)

    def to_transformers(self) -> PreTrainedModel:
        """The stock transformers class holding these weights (shared, not copied): built on the meta device
        and assigned the tensors."""
        stock_class = self.stock_class()
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            kwargs = dict(add_pooling_layer=getattr(self, "pooler", None) is not None) \
                if stock_class is transformers.ViTModel else {}
            stock = stock_class(copy.deepcopy(self.config), **kwargs)
        stock.load_state_dict(self.state_dict(), strict=True, assign=True)
        for name, buffer in list(stock.named_buffers()):  # non-persistent ones (CLIP's position_ids)
            if buffer.is_meta:
                owner, _, leaf = name.rpartition(".")
                stock.get_submodule(owner).register_buffer(leaf, self.get_buffer(name), persistent=False)
        return stock.train(self.training)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Optional[dict] = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Checkpoint every block (what the Trainer calls for gradient_checkpointing=True). vit_fast's
        checkpointing is non-reentrant; a use_reentrant in the kwargs changes nothing in the results.
        Checkpointing only some blocks and offloading are not implemented (a clear error)."""
        if every_n_layers != 1 or offload:
            raise ValueError(f"vit_fast.optimize'd model: activation checkpointing of every block only (got "
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


class HFViT(HFLinked):
    """What the optimized transformers ViT classes add to the source's class (a mixin placed before it):
    ``forward`` through the linked vit_fast model (``vit_fast_model``) and the HFLinked methods.

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

    vit_fast_layout = ViTLayout()

    def vit_fast_config(self) -> dict:
        return hf_vit_config(self)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, backend: str = "auto",
                        residual_in_fp32: bool = True, **kwargs):
        """Load a ViTModel / ViTForImageClassification directory or hub id (the class named in its
        config.json) with transformers, then ``vit_fast.optimize`` it."""
        from .optimize import optimize

        require_local_directory(pretrained_model_name_or_path)
        config = kwargs.pop("config", None) or ViTConfig.from_pretrained(pretrained_model_name_or_path)
        classifier = "ViTForImageClassification" in (config.architectures or [])
        source_class = transformers.ViTForImageClassification if classifier else transformers.ViTModel
        source = source_class.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        return optimize(source, backend=backend, residual_in_fp32=residual_in_fp32)

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
        model = self.linked_in_mode()
        pixel_values = pixel_values.to(model.patch_embed.projection_weight.dtype)  # as transformers does
        pixel_values, pos_embed = self.embedding_inputs(pixel_values, bool(interpolate_pos_encoding))
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        want_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if want_attentions and self.training and any((blk.attn.attn_drop_rate() or 0) > 0 for blk in model.blocks):
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
            sequence, hidden_states = model.forward_features(pixel_values, pos_embed=pos_embed), None
        if is_classifier:
            logits = model.forward_head(sequence)
            loss_kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            loss = self.loss_function(labels, logits, self.config, **loss_kwargs) if labels is not None else None
            out = ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hidden_states, attentions=attentions)
        else:
            sequence = model.in_layer_norm_dtype(sequence)  # the final layernorm's output, as transformers'
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
        if self.runs_as_transformers():
            return self.transformers_forward(pixel_values, labels=labels,
                                             interpolate_pos_encoding=interpolate_pos_encoding,
                                             attention_mask=attention_mask, **kwargs)
        return self._forward(pixel_values, labels=labels, interpolate_pos_encoding=interpolate_pos_encoding,
                             attention_mask=attention_mask, **kwargs)


class HFViTModel(HFViT):
    def forward(self, pixel_values: Optional[torch.Tensor] = None, bool_masked_pos: Optional[torch.Tensor] = None,
                interpolate_pos_encoding: Optional[bool] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs):
        if kwargs.get("labels") is not None:
            raise ValueError("labels: a ViTModel has no classifier (use ViTForImageClassification)")
        if self.runs_as_transformers():
            return self.transformers_forward(pixel_values, bool_masked_pos=bool_masked_pos,
                                             interpolate_pos_encoding=interpolate_pos_encoding,
                                             attention_mask=attention_mask, **kwargs)
        return self._forward(pixel_values, bool_masked_pos=bool_masked_pos,
                             interpolate_pos_encoding=interpolate_pos_encoding, attention_mask=attention_mask, **kwargs)


# The optimized classes carry the source classes' names (config.architectures, save_pretrained and the Hub
# see transformers' names); module-level so that pickling finds them.
class ViTForImageClassification(HFViTForImageClassification, transformers.ViTForImageClassification):
    pass


class ViTModel(HFViTModel, transformers.ViTModel):
    pass


@torch.compiler.disable(reason="vit_fast: the optimized transformers model's layers changed (added, removed, replaced "
                        "or wrapped) since its last call, and the model it links to them is rebuilt outside the "
                        "compiled graph: under fullgraph=True call the model once outside torch.compile after "
                        "editing its layers (or read model.vit_fast_model), then the compiled model")
def _link(model: nn.Module, old: Optional[VisionTransformer]) -> VisionTransformer:
    """Link ``model`` (an optimized transformers model) to a new vit_fast VisionTransformer, carrying ``old``'s
    settings. Not traced: dynamo breaks the graph here and runs it (building modules cannot be traced), so a
    compiled model follows an edit; under fullgraph=True its error gives the reason above."""
    try:
        linked = linked_model(model, model.vit_fast_config(), model.vit_fast_layout, model.configured_activation())
    except AttributeError as e:  # raised inside a property it would read as "no vit_fast_model"
        raise RuntimeError(f"vit_fast: {type(model).__name__}'s modules do not follow "
                           f"{type(model.vit_fast_layout).__name__}: {e}") from e
    if old is not None:  # what was set on the previous link: backend, checkpointing, stream dtype, route
        carry_settings(old, linked)
    object.__setattr__(model, "_vit_fast_model", linked)
    return linked


def optimized_class(source: nn.Module) -> type:
    """The optimized class for a transformers source: the same-name subclass of its class."""
    from . import hf_families

    for cls in type(source).__mro__:
        if cls.__module__.startswith("transformers."):
            found = {"ViTForImageClassification": ViTForImageClassification, "ViTModel": ViTModel,
                     **hf_families.OPTIMIZED_CLASSES}.get(cls.__name__)
            if found is not None and issubclass(found, cls):
                return found
    raise ValueError(f"optimize: no vit_fast counterpart for {type(source).__qualname__}")


def optimize_hf(source: nn.Module) -> HFLinked:
    """A copy of ``source`` (a transformers ViT, CLIP, SigLIP or DINOv2 vision model) whose forward is
    vit_fast's, see the module docstring; the source is left as it was."""
    model = copy.deepcopy(source)
    model.__class__ = optimized_class(source)
    model.__dict__.pop("_vit_fast_model", None)
    model.vit_fast_model  # built now: a layout or config the source does not fit fails here, not in forward
    return model
