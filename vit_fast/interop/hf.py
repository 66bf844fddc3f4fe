"""``HFViT``: a transformers ViTModel / ViTForImageClassification look-alike around a vit_fast model,
what ``vit_fast.optimize`` returns for a transformers source (imports transformers: not on the library floor).

It is a transformers ``PreTrainedModel`` (so the Trainer saves it with ``save_pretrained``) whose
``save_pretrained`` writes the source class's own files (config.json + weights under transformers' key names,
through a stock model on the meta device): stock ``ViTForImageClassification.from_pretrained(dir)`` loads them
exactly, and ``HFViT.from_pretrained(dir)`` loads them back into vit_fast.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel, ViTConfig, ViTForImageClassification, ViTModel
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from ..model import VisionTransformer
from .convert import hf_to_timm_state_dict


class HFViT(PreTrainedModel):
    """A transformers ViTModel / ViTForImageClassification look-alike around a vit_fast model (``model``);
    ``hf_wrap(source, fast)`` picks the subclass whose ``forward`` has the source class's signature
    (``HFViTForImageClassification`` / ``HFViTModel``), so the Trainer's loss-kwargs detection and column
    filtering see the same arguments as for the source.

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

    config_class = ViTConfig
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    # whatever attention implementation the source's config names is accepted (vit_fast runs its own):
    # the shared config object is left as it is
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def __init__(self, source: nn.Module, fast: VisionTransformer):
        super().__init__(source.config)
        self.model = fast
        self.is_classifier = hasattr(source, "classifier")
        pooler = None if self.is_classifier else getattr(source, "pooler", None)
        self.pooler = copy.deepcopy(pooler)  # ViTModel's dense + tanh on the first token (None when absent)

    # ------------------------------------------------------------------------ transformers' model protocol
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, backend: str = "auto",
                        residual_in_fp32: bool = True, **kwargs) -> "HFViT":
        """Load a ViTModel / ViTForImageClassification directory or hub id (the class named in its
        config.json) with transformers, then ``vit_fast.optimize`` it."""
        from .optimize import optimize

        config = kwargs.pop("config", None) or ViTConfig.from_pretrained(pretrained_model_name_or_path)
        classifier = "ViTForImageClassification" in (config.architectures or [])
        source_class = ViTForImageClassification if classifier else ViTModel
        source = source_class.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        return optimize(source, backend=backend, residual_in_fp32=residual_in_fp32)

    def to_transformers(self, state_dict: Optional[dict] = None) -> PreTrainedModel:
        """The source class (stock transformers) holding these weights (or ``state_dict``, this module's
        keys), built on the meta device and assigned the tensors: no copy, no random init."""
        sd = self.state_dict() if state_dict is None else state_dict
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            if self.is_classifier:
                stock = ViTForImageClassification(copy.deepcopy(self.config))
            else:
                stock = ViTModel(copy.deepcopy(self.config), add_pooling_layer=self.pooler is not None)
        stock.load_state_dict(self._to_hf_keys(sd, list(stock.state_dict())), strict=True, assign=True)
        return stock.eval() if not self.training else stock

    def save_pretrained(self, save_directory, state_dict: Optional[dict] = None, **kwargs) -> None:
        """config.json and the weights under transformers' key names (the source class's files, written
        by its own save_pretrained; kwargs such as safe_serialization / max_shard_size go to it)."""
        self.to_transformers(state_dict).save_pretrained(save_directory, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """This module's keys, or a transformers-keyed state dict (what save_pretrained wrote: the Trainer
        reloads its checkpoints this way)."""
        if any(k.startswith(("vit.", "embeddings.", "layers.", "encoder.")) for k in state_dict):
            state_dict = {**{"model." + k: v for k, v in hf_to_timm_state_dict(state_dict).items()},
                          **{k: v for k, v in state_dict.items() if k.startswith("pooler.")}}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @staticmethod
    def _to_hf_keys(sd: dict, hf_keys: list[str]) -> dict[str, torch.Tensor]:
        """This module's state dict under the transformers names ``hf_keys``: the converter's own key map
        run on one-element index tensors says which vit_fast tensor (and which third of a fused qkv) each
        transformers key holds."""
        index = hf_to_timm_state_dict({k: torch.tensor([float(i)]) for i, k in enumerate(hf_keys)})
        out = {k: sd[k] for k in hf_keys if k.startswith("pooler.")}
        for name, positions in index.items():
            if name.startswith("pooler."):
                continue
            parts = positions.tolist()
            value = sd["model." + name]
            for i, chunk in zip(parts, value.chunk(len(parts), dim=0) if len(parts) > 1 else [value]):
                out[hf_keys[int(i)]] = chunk
        return out

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Optional[dict] = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Checkpoint every block (what the Trainer calls for gradient_checkpointing=True). vit_fast's
        checkpointing is non-reentrant; a use_reentrant in the kwargs changes nothing in the results.
        Checkpointing only some blocks and offloading are not implemented (a clear error)."""
        if every_n_layers != 1 or offload:
            raise ValueError(f"vit_fast.optimize'd ViT: activation checkpointing of every block only (got "
                             f"every_n_layers={every_n_layers}, offload={offload})")
        self.model.set_grad_checkpointing(True)

    def activation_checkpointing_disable(self) -> None:
        self.model.set_grad_checkpointing(False)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[dict] = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """transformers' older name of ``activation_checkpointing_enable``."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.model.grad_checkpointing

    is_gradient_checkpointing = is_activation_checkpointing

    def get_input_embeddings(self) -> nn.Module:
        """The patch embedding (the source returns its ViTPatchEmbeddings)."""
        return self.model.patch_embed

    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the source model: nothing is initialised here."""

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
            loss_kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            loss = self.loss_function(labels, logits, self.config, **loss_kwargs) if labels is not None else None
            out = ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hidden_states, attentions=attentions)
        else:
            pooled = self.pooler(sequence) if self.pooler is not None else None
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


def hf_wrap(source: nn.Module, fast: VisionTransformer) -> HFViT:
    """The HFViT subclass for the source's class around ``fast``."""
    wrapper = HFViTForImageClassification if hasattr(source, "classifier") else HFViTModel
    return wrapper(source, fast)
