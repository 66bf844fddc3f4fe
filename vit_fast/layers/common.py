"""What every part uses: argument helpers, hook detection, the output GEMM without its bias (the residual
join adds it), and timm's weight init."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..adapters import effective_bias, effective_weight, fusable_linear, torch_forward_kept


def to_2tuple(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"expected an int or a pair (H, W), got {x!r}")
        return int(x[0]), int(x[1])
    return int(x), int(x)


def global_module_hooks() -> bool:
    """Whether global module hooks (``torch.nn.modules.module.register_module_forward_hook`` and its kin) are set:
    they fire on every module called."""
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_backward_pre_hooks or torch_module._global_backward_hooks)


def has_hooks(module: nn.Module, inside: bool = False) -> bool:
    """Whether calling ``module`` (with ``inside``: any module below it, not counting itself) would do more than its
    class's forward: forward or backward hooks on it, global module hooks included, or a forward set on the
    instance (accelerate's hooks, which move offloaded weights in, and a user's patch). The fused paths call
    GEMMs and kernels directly, so such modules (FSDP2's fully_shard registers hooks) are run through ``__call__``.
    Asked on every forward: a plain walk of the module dicts (Module.modules() costs several times more)."""
    if global_module_hooks():
        return True
    return _any_hooks(module._modules.values() if inside else (module,))


def _any_hooks(modules) -> bool:
    """``has_hooks`` below the global hooks: a recursive walk that makes calls only for modules with children (most
    of a ViT's modules are leaves)."""
    for m in modules:
        if m is None:
            continue
        if (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
                or ("forward" in m.__dict__ and instance_forward(m))):
            return True
        children = m._modules
        if children and _any_hooks(children.values()):
            return True
    return False


def runs_own_forward(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` whose forward is vit_fast's (the class's own or a vit_fast subclass's, such as a linked
    part): the fused paths may call its other methods in its place. A subclass with a forward of its own (a user's,
    timm's) is called."""
    return isinstance(module, cls) and type(module).forward.__module__.startswith("vit_fast.")


def own_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself (not what is below it) holds forward or backward hooks or a forward set on the
    instance (``has_hooks``)."""
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks or ("forward" in module.__dict__ and instance_forward(module)))


def instance_forward(module: nn.Module) -> bool:
    """Whether a forward set on ``module`` itself (accelerate's hooks, a user's patch) replaces its class's: not
    the class's own forward bound to it, which accelerate's ``remove_hook_from_module`` leaves there."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    own = getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward
    return not own


def dropout_rate(module: nn.Module) -> Optional[float]:
    """The rate a dropout module of a part applies now, by its own mode as torch's: an ``nn.Dropout``'s p while it
    trains (else 0: a module put in eval by hand, or one left training in an eval model for MC dropout, is obeyed),
    0 for an Identity; None for another module, which the fused paths cannot read and call instead."""
    if type(module) is nn.Dropout and torch_forward_kept(nn.Dropout):
        return module.p if module.training else 0.0
    return 0.0 if type(module) is nn.Identity else None


def linear_without_bias(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output GEMM of a part's branch: ``module``'s weight without its bias (the residual join adds
    it); a module the fused path cannot read (vit_fast/adapters.py) is called whole, bias included."""
    return F.linear(x, effective_weight(module)) if fusable_linear(module) else module(x)


def bias_left_to_join(module: nn.Module) -> Optional[torch.Tensor]:
    """The bias ``linear_without_bias`` left out, for the residual join (None when it called the module)."""
    return effective_bias(module) if fusable_linear(module) else None


def trunc_normal_(tensor: torch.Tensor, std: float = 0.02, a: float = -2.0, b: float = 2.0) -> torch.Tensor:
    """timm's default: normal(0, std) truncated at [a, b] (absolute: +-100 std for std=0.02), drawn as timm draws it
    (one uniform per element mapped through the inverse normal CDF), so a seed gives timm's weights."""
    def cdf(value: float) -> float:
        return (1.0 + math.erf(value / std / math.sqrt(2.0))) / 2.0

    with torch.no_grad():
        tensor.uniform_(2 * cdf(a) - 1, 2 * cdf(b) - 1)
        tensor.erfinv_().mul_(std * math.sqrt(2.0))
        return tensor.clamp_(min=a, max=b)


def trunc_normal_tf_(tensor: torch.Tensor, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> torch.Tensor:
    """timm's 'tf' variant: the standard normal truncated at [a, b], then scaled by std (the bounds in units of
    std), drawn as timm draws it."""
    with torch.no_grad():
        return trunc_normal_(tensor, std=1.0, a=a, b=b).mul_(std)


def init_weights_vit_timm(module: nn.Module, name: str = "", needs_reset: bool = True) -> None:
    """timm's 'timm' init: Linear weights trunc_normal(std .02), biases zero; a module's own init_weights
    (LayerScale to init_values); with ``needs_reset`` any other module's reset_parameters (conv, LayerNorm)."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()
    elif needs_reset and hasattr(module, "reset_parameters"):
        module.reset_parameters()


def named_apply(fn: Callable[[nn.Module, str], None], module: nn.Module, name: str = "") -> None:
    """Apply fn to every descendant of module (children before parents), not to module itself."""
    for child_name, child in module.named_children():
        child_full = f"{name}.{child_name}" if name else child_name
        named_apply(fn, child, child_full)
        fn(child, child_full)
