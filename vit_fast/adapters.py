"""What the fused path may read in place of calling a Linear or Conv2d module: its effective weight and bias.

The fused kernels take weights, not modules (the qkv GEMM runs inside ``attention_linear``, fc1 inside
``linear_act``, the output biases inside the residual join), so a module that has been replaced or wrapped
(PEFT's LoRA, a subclass with its own forward, a quantised layer) is honoured only if its output is a plain
affine map that can be written as one (weight, bias) pair:

- ``nn.Linear`` / ``nn.Conv2d`` (or a subclass that keeps their forward): its own parameters;
- PEFT LoRA (``peft.tuners.lora.Linear`` / ``Conv2d``) without DoRA or another variant and with no dropout
  active: ``W + sum_a delta_a`` over the active adapters (``get_delta_weight``: ``scaling * B @ A``, PEFT's
  own formula, so autograd carries the gradients to A and B) and the base bias plus ``scaling * B.bias``
  where ``lora_bias`` is on; a merged LoRA reads its base layer, as PEFT's forward does.

- ``PackedLinear`` (transformers' separate query / key / value read as timm's packed qkv): the
  concatenation of its parts' effective weights and biases, when every part qualifies.

Anything else (LoRA dropout active in training, DoRA, adapters disabled while merged, an unknown module)
makes ``fusable_linear`` False: the part then calls the module itself (its reference path), so a wrapper is
never silently skipped.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

_PLAIN = (nn.Linear, nn.Conv2d)


def _torch_forward(cls: type, name: str = "forward"):
    """``cls.<name>`` where it is torch's own (its code in torch/nn/modules), else None (replaced before import)."""
    method = cls.__dict__.get(name)
    code = getattr(method, "__code__", None)
    return method if code is not None and "torch/nn/modules/" in code.co_filename.replace("\\", "/") else None


# torch's forwards of the module classes the fused paths read rather than call, as they were at import
_TORCH_FORWARDS = {cls: _torch_forward(cls) for cls in (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.GELU, nn.SiLU,
                                                         nn.Dropout)}
_CONV_FORWARD = _torch_forward(nn.Conv2d, "_conv_forward")


def torch_forward_kept(cls: type) -> bool:
    """Whether ``cls`` (one of torch's module classes) still has torch's forward: a library may replace
    ``nn.Linear.forward`` (or GELU's, LayerNorm's...) on the class, and a fused path reading the module's weights
    or rate would ignore it."""
    return cls.forward is _TORCH_FORWARDS.get(cls) and (cls is not nn.Conv2d or cls._conv_forward is _CONV_FORWARD)


def parametrized(module: nn.Module) -> bool:
    """``torch.nn.utils.parametrize`` computes a parameter of ``module`` at each read (weight_norm, spectral_norm,
    an orthogonal map): such a module is called, which reads it once per forward as the source does (a fused path
    reads it more often, and spectral_norm's power iteration advances at every read in training)."""
    return "parametrizations" in module._modules


def torch_forwards_kept() -> bool:
    """Every torch module class the fused paths read keeps torch's forward (``torch_forward_kept``)."""
    return all(cls.forward is forward for cls, forward in _TORCH_FORWARDS.items()) and (
        nn.Conv2d._conv_forward is _CONV_FORWARD)


def _is_plain(module: nn.Module) -> bool:
    """An nn.Linear / nn.Conv2d whose forward is torch's (subclasses that only add attributes pass; a Conv2d's
    ``_conv_forward`` too, which weight-standardising subclasses override), not parametrized."""
    cls = type(module)
    if cls is nn.Linear:  # the common case first (a parametrized module has a class of its own)
        return cls.forward is _TORCH_FORWARDS[nn.Linear]
    for plain in _PLAIN:
        if isinstance(module, plain):
            return (not parametrized(module) and cls.forward is plain.forward
                    and (plain is nn.Linear or cls._conv_forward is _CONV_FORWARD) and torch_forward_kept(plain))
    return False


def _is_lora(module: nn.Module) -> bool:
    """PEFT's LoRA Linear / Conv2d (matched by type, so no import of peft is needed)."""
    cls = type(module)
    return cls.__module__.startswith("peft.tuners.lora") and cls.__name__ in ("Linear", "Conv2d")


def _active_adapters(module: nn.Module) -> list[str]:
    return [a for a in module.active_adapters if a in module.lora_A]


def _dropout_active(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0


class PackedLinear:
    """Linear modules on the same input read as one whose output is theirs concatenated (a view, not a
    module: the parts stay where their model keeps them, so replacing one there is seen here)."""

    def __init__(self, *parts: nn.Module):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([part.weight for part in self.parts])

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return _cat_biases([part.bias for part in self.parts], self.parts)

    @property
    def out_features(self) -> int:
        return sum(part.weight.shape[0] for part in self.parts)


def _cat_biases(biases: list, parts) -> Optional[torch.Tensor]:
    """The parts' biases end to end (zeros for a part without one), None when no part has one."""
    if all(b is None for b in biases):
        return None
    ref = next(b for b in biases if b is not None)
    return torch.cat([b if b is not None else ref.new_zeros(p.weight.shape[0]) for b, p in zip(biases, parts)])


def fusable_linear(module: nn.Module) -> bool:
    """Whether ``effective_weight`` / ``effective_bias`` reproduce ``module(x)`` exactly (up to rounding)."""
    if _is_plain(module):
        return True
    if isinstance(module, PackedLinear):
        return all(fusable_linear(part) for part in module.parts)
    if not _is_lora(module) or not _is_plain(module.base_layer) or getattr(module, "fan_in_fan_out", False):
        return False
    if module.disable_adapters:
        return not module.merged  # disabled and merged: PEFT's forward unmerges first
    if module.merged:
        return True
    for adapter in _active_adapters(module):
        if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
            return False
        dropout = module.lora_dropout[adapter]
        if not (isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and not _dropout_active(dropout))):
            return False
    return True


def _applies_adapters(module: nn.Module) -> bool:
    return _is_lora(module) and not module.disable_adapters and not module.merged


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight of the affine map ``module`` computes (call only where ``fusable_linear`` holds)."""
    if type(module) in _PLAIN:
        return module.weight
    if isinstance(module, PackedLinear):
        return torch.cat([effective_weight(part) for part in module.parts])
    if not _is_lora(module):
        return module.weight
    weight = module.base_layer.weight
    if _applies_adapters(module):
        for adapter in _active_adapters(module):
            weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
    return weight


def effective_bias(module: nn.Module) -> Optional[torch.Tensor]:
    """The bias of the affine map ``module`` computes, or None (call only where ``fusable_linear`` holds)."""
    if type(module) in _PLAIN:
        return module.bias
    if isinstance(module, PackedLinear):
        return _cat_biases([effective_bias(part) for part in module.parts], module.parts)
    if not _is_lora(module):
        return module.bias
    bias = module.base_layer.bias
    if _applies_adapters(module):
        for adapter in _active_adapters(module):
            if module.lora_bias.get(adapter, False):
                bias = bias + module.lora_B[adapter].bias.to(bias.dtype) * module.scaling[adapter]
    return bias



def encoder_layer_problems(attn: nn.MultiheadAttention, norms: tuple, batch_first: bool = True) -> list[str]:
    """What a torchvision / open_clip layer's ``attn`` and ``norms`` hold that their conversion (qkv and proj with
    biases, affine LayerNorms) would drop or misread, one line each. ``batch_first``: the layout the layer's input
    has (an attention of the other layout attends across the batch)."""
    problems = []
    if attn.in_proj_bias is None or attn.out_proj.bias is None:
        problems.append("attention without biases")
    if attn.add_zero_attn or attn.bias_k is not None:
        problems.append("attention with add_zero_attn or add_bias_kv")
    if attn.batch_first != batch_first:
        problems.append(f"attention with batch_first={attn.batch_first} in a transformer with "
                        f"batch_first={batch_first}")
    for norm in norms:
        if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
            problems.append(f"norm layer {type(norm).__name__} (vit_fast's norms are affine LayerNorms)")
    return problems


def patchify_problem(conv: nn.Module, patch: tuple[int, int]) -> Optional[str]:
    """Why the convolution ``conv`` (a Conv2d, or a LoRA around one) is not the patch embedding's patchify, one
    token per non-overlapping ``patch`` (kernel = stride = patch, no padding, dilation or groups), which the
    ``patch_embed`` kernel and the converters assume; None where it is."""
    base = conv.base_layer if _is_lora(conv) else conv
    if not isinstance(base, nn.Conv2d):
        return None  # a module of another kind is called, never read as a patchify
    patch = tuple(patch)
    padding = base.padding if isinstance(base.padding, tuple) else (0, 0) if base.padding == "valid" else None
    if (tuple(base.kernel_size), tuple(base.stride), padding, tuple(base.dilation), base.groups) != (
            patch, patch, (0, 0), (1, 1), 1):
        return (f"a patch convolution other than kernel = stride = {patch} without padding, dilation or groups "
                f"(kernel {tuple(base.kernel_size)}, stride {tuple(base.stride)}, padding {base.padding!r}, "
                f"dilation {tuple(base.dilation)}, groups {base.groups})")
    return None
