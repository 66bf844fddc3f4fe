"""One-line drop-in: ``vit_fast.optimize(model)`` turns an existing ViT into a vit_fast model.

    model = timm.create_model("vit_base_patch16_224", pretrained=True).cuda()
    model = vit_fast.optimize(model)            # same weights, same head, same forward signature

Accepted sources and what comes back (same device, dtype, train/eval mode and requires_grad flags):
  - timm VisionTransformer        -> vit_fast.VisionTransformer (timm's own module and parameter names;
                                     forward / forward_features / forward_head as timm's);
  - torchvision VisionTransformer -> vit_fast.VisionTransformer (forward(x) -> logits);
  - open_clip VisionTransformer   -> vit_fast.VisionTransformer that also answers open_clip's tower methods
                                     (interop/open_clip_tower.py), to put back in ``model.visual``;
  - transformers ViTModel / ViTForImageClassification, CLIPVisionModel(WithProjection), SiglipVisionModel,
    SiglipForImageClassification, Dinov2Model -> a copy of it that keeps transformers' class (a subclass
    of the same name), module tree, config and save_pretrained, with vit_fast's forward reading those
    modules (interop/hf.py, hf_families.py; ``isinstance(model, vit_fast.interop.hf.HFLinked)``);
  - a vit_fast VisionTransformer  -> the same object, switched to ``backend``.
A source using a feature vit_fast does not implement raises one ValueError listing every such feature:
the result is never a silently different model.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..backend import check_backend, kernels_can_run_on
from ..layers.common import own_hooks
from ..model import VisionTransformer
from .convert import (
    HF_FAMILY_CLASSES,
    _from_open_clip,
    from_timm,
    from_torchvision,
    timm_unsupported,
    torchvision_to_timm_state_dict,
)
from .families import open_clip_to_timm
from .open_clip_tower import PREPROCESS_ATTRIBUTES, OpenCLIPVisionTransformer


def optimize(model: nn.Module, backend: str = "auto", residual_in_fp32: bool = True,
             tune: bool | None = None) -> nn.Module:
    """A vit_fast model with ``model``'s weights, head and forward signature, running ``backend``
    ('auto': the Triton kernels on CUDA tensors, the PyTorch reference elsewhere; 'triton'; 'torch').
    Draws nothing from the global random generators (torch, numpy, random): the same seed gives the same
    run as with the source model.
    ``residual_in_fp32=False`` keeps the residual stream in the autocast dtype under autocast (fewer bytes
    per step; numerics then differ from the source's fp32 stream). ``tune`` (vit_fast/tuning.py): True
    applies the measured choice per fusion (fused kernel or eager path) from the cache that
    `vit-fast tune` writes, measuring it here first on a GPU if it is missing; False keeps the static
    kernel configs and every fusion, process-wide (bitwise-reproducible runs across machines; same as
    VIT_FAST_AUTOTUNE=0); None (default) leaves both as they are."""
    check_backend(backend)
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise ValueError("optimize: pass the bare model and wrap the result in DistributedDataParallel/"
                         "DataParallel afterwards (got a wrapped model)")
    if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
        raise ValueError("optimize: pass the model before torch.compile and compile the result instead")
    kind = source_kind(model)
    if kind == "hf_optimized":
        return _apply_tune(_set_residual_dtype(model.set_backend(backend), residual_in_fp32), tune)
    if (kind in ("hf", "hf_family") and backend != "triton"
            and any(own_hooks(module) for module in model.modules())):  # offloaded by accelerate: its modules, kept
        return _optimize_transformers(model, backend, residual_in_fp32, tune)  # with their hooks, hold no device
    device, dtype = _device_and_dtype(model)
    if backend == "triton" and not kernels_can_run_on(device):
        raise RuntimeError(f"optimize: backend='triton' needs a model on CUDA (or CPU with TRITON_INTERPRET=1); "
                           f"the model is on {device}. Use backend='auto' or 'torch'.")
    if kind == "vit_fast":
        return _apply_tune(_set_residual_dtype(model.set_backend(backend), residual_in_fp32), tune)
    if device.type == "meta":   # converting copies the weights: there are none to copy
        raise ValueError(f"optimize: the {kind} model is on the meta device (no weight data to convert); "
                         f"materialise it first (model.to_empty(device=...) and load its weights), or create "
                         f"the vit_fast model directly on meta with vit_fast.create_model under torch.device('meta')")
    hooked = [name or "the model itself" for name, module in model.named_modules() if own_hooks(module)]
    if hooked and kind in ("timm", "open_clip", "torchvision"):  # new modules: nothing set on the old ones carries
        raise ValueError(f"optimize: the {kind} model has hooks or a forward set on the instance on "
                         f"{', '.join(repr(n) for n in hooked[:4])}{' ...' if len(hooked) > 4 else ''}; the optimized "
                         "model is built of new modules, which would not run them: optimize first, then register "
                         "them on the optimized model's modules")
    if kind == "timm":
        problems = timm_unsupported(model)
        if problems:
            raise ValueError("optimize: this timm model uses features vit_fast does not implement:\n  - "
                             + "\n  - ".join(problems))
        fast = from_timm(model)
        fast.set_grad_checkpointing(bool(getattr(model, "grad_checkpointing", False)))
        if getattr(model, "distilled_training", False):
            fast.set_distilled_training(True)
        names = {k: k for k in dict(model.named_parameters())}
    elif kind == "open_clip":  # open_clip's tower methods too (lock, its forward_intermediates, image_size)
        fast = _from_open_clip(model, OpenCLIPVisionTransformer, {})
        fast.set_grad_checkpointing(bool(getattr(model.transformer, "grad_checkpointing", False)))
        for name in PREPROCESS_ATTRIBUTES:
            if hasattr(model, name):
                setattr(fast, name, copy.deepcopy(getattr(model, name)))
        names = _family_names(model, open_clip_to_timm)
    elif kind == "torchvision":
        fast = from_torchvision(model)
        names = _mapped_names(model, torchvision_to_timm_state_dict)
    else:
        return _optimize_transformers(model, backend, residual_in_fp32, tune)
    fast = fast.to(device=device, dtype=dtype)
    _copy_requires_grad(model, fast, names)
    fast.train(model.training)
    return _apply_tune(_set_residual_dtype(fast.set_backend(backend), residual_in_fp32), tune)


def _optimize_transformers(model: nn.Module, backend: str, residual_in_fp32: bool, tune: bool | None) -> nn.Module:
    """A transformers ViT, CLIP, SigLIP or DINOv2: the same modules, vit_fast's forward (interop/hf.py)."""
    from .hf import optimize_hf  # imports transformers

    fast = optimize_hf(model)
    return _apply_tune(_set_residual_dtype(fast.set_backend(backend), residual_in_fp32), tune)


def _apply_tune(fast: nn.Module, tune: bool | None) -> nn.Module:
    if tune is None:
        return fast
    from .. import tuning

    tuning.set_autotune(bool(tune))
    if tune:
        tuning.tune_model(fast)
    else:
        tuning.set_static_route(fast)
    return fast


def vit_fast_model_of(model: nn.Module) -> VisionTransformer:
    """The vit_fast VisionTransformer that runs ``model``: itself, or the one an optimized transformers
    model links to (``vit_fast_model``)."""
    vit = model if isinstance(model, VisionTransformer) else getattr(model, "vit_fast_model", None)
    if not isinstance(vit, VisionTransformer):
        raise TypeError(f"expected a vit_fast VisionTransformer or a model vit_fast.optimize returned, "
                        f"got {type(model).__name__}")
    return vit


def _set_residual_dtype(fast: nn.Module, residual_in_fp32: bool) -> nn.Module:
    vit = vit_fast_model_of(fast)
    vit.residual_in_fp32 = vit.config.residual_in_fp32 = bool(residual_in_fp32)
    return fast


# What timm's VisionTransformer / VisionTransformerDistilled build that vit_fast converts (presets: vit_fast/presets.py)
TIMM_FAMILIES = "ViT, DeiT, DeiT III, DeiT distilled, CLIP, SigLIP and DINOv2"


def source_kind(model: nn.Module) -> str:
    """'vit_fast' | 'timm' | 'torchvision' | 'hf' | 'hf_family' | 'open_clip' | 'hf_optimized' for a supported
    ViT class, else a ValueError (naming a supported module inside the model, where there is one)."""
    kind = _kind(model)
    if kind:
        return kind
    cls = type(model)
    inner = _supported_submodule(model)
    hint = (f". Its {inner} is one: optimize that in place (model.{inner} = vit_fast.optimize(model.{inner})); the "
            f"rest of the model stays as it is") if inner else ""
    if cls.__module__.startswith("timm."):   # Eva, Beit, VisionTransformerRelPos...: say which timm classes it takes
        raise ValueError(f"optimize: {cls.__module__}.{cls.__qualname__} is a timm model family vit_fast does not "
                         f"implement; optimize takes timm's VisionTransformer and VisionTransformerDistilled, the "
                         f"{TIMM_FAMILIES} families (README: Model families and sources){hint}")
    raise ValueError(f"optimize: expected a timm VisionTransformer (or VisionTransformerDistilled), a torchvision "
                     f"VisionTransformer, a transformers ViTModel / ViTForImageClassification / "
                     f"{' / '.join(HF_FAMILY_CLASSES)}, an open_clip VisionTransformer (model.visual) or a vit_fast "
                     f"VisionTransformer; got {cls.__module__}.{cls.__qualname__}{hint}")


def _kind(model: nn.Module) -> str:
    """``source_kind``'s answer, '' for a class optimize does not take."""
    if isinstance(model, VisionTransformer):
        return "vit_fast"
    if hasattr(model, "vit_fast_model"):  # already optimized (interop/hf.py)
        return "hf_optimized"
    cls = type(model)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if where in ("timm.models.vision_transformer.VisionTransformer", "timm.models.deit.VisionTransformerDistilled"):
        return "timm"
    if where == "torchvision.models.vision_transformer.VisionTransformer":
        return "torchvision"
    if where in ("transformers.models.vit.modeling_vit.ViTModel",
                 "transformers.models.vit.modeling_vit.ViTForImageClassification"):
        return "hf"
    if where.startswith("transformers.models.") and cls.__name__ in HF_FAMILY_CLASSES:
        return "hf_family"
    if where == "open_clip.transformer.VisionTransformer":
        return "open_clip"
    return ""


def _supported_submodule(model: nn.Module, depth: int = 2) -> str:
    """The dotted name of the first module below ``model`` (at most ``depth`` levels) that optimize takes, '' if none:
    transformers' Dinov2ForImageClassification holds a Dinov2Model, open_clip's CLIP its visual tower."""
    for name, child in model.named_children():
        if _kind(child):
            return name
        found = _supported_submodule(child, depth - 1) if depth > 1 else ""
        if found:
            return f"{name}.{found}"
    return ""


def _device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    tensors = list(model.parameters()) + list(model.buffers())
    devices = {t.device for t in tensors}
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(devices) != 1 or len(dtypes) != 1:
        raise ValueError(f"optimize: expected every parameter on one device with one floating dtype, got devices "
                         f"{sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}; move the model with "
                         f".to(device, dtype) first")
    return devices.pop(), dtypes.pop()


def _mapped_names(model: nn.Module, to_timm) -> dict[str, str]:
    """Source parameter name -> vit_fast name: the converter's key map run on one-element index tensors
    (q, k and v fused into one qkv all map onto the qkv name; dropped keys such as the pooler map to none)."""
    names = [name for name, _ in model.named_parameters()]
    mapped = to_timm({name: torch.tensor([float(i)]) for i, name in enumerate(names)})
    return {names[int(i)]: new for new, index in mapped.items() for i in index.tolist()}


def _family_names(model: nn.Module, to_timm) -> dict[str, list[str]]:
    """Source parameter name -> the vit_fast names it feeds (``_mapped_names`` for the family mappings, which
    also split a packed in_proj in two: SigLIP's head q | kv; those get a (3, 1) index tensor)."""
    names = [name for name, _ in model.named_parameters()]
    index = {name: torch.full((3, 1) if "in_proj" in name else (1,), float(i)) for i, name in enumerate(names)}
    out: dict[str, list[str]] = {}
    for new, t in to_timm(index).items():
        for i in t.flatten().unique().tolist():
            out.setdefault(names[int(i)], []).append(new)
    return out


def _copy_requires_grad(source: nn.Module, fast: nn.Module, names: dict[str, str]) -> None:
    """Frozen source parameters stay frozen (a fused qkv is trainable if any of q, k, v was)."""
    trainable: dict[str, bool] = {}
    for name, p in source.named_parameters():
        for new in ([names[name]] if isinstance(names.get(name), str) else names.get(name, ())):
            trainable[new] = trainable.get(new, False) or p.requires_grad
    for name, p in fast.named_parameters():
        if name in trainable and p.requires_grad:  # keep frozen-by-design params (sin-cos pos_embed) frozen
            p.requires_grad_(trainable[name])
