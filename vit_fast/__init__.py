"""vit_fast: a drop-in faster Vision Transformer for GPU training.

A timm-compatible ViT (same parameter names, same numbers) whose building blocks switch between a
pure-PyTorch reference path (backend='torch') and fused Triton kernels (backend='triton' / 'auto').
"""
from ._compat import install_inductor_fallbacks
from .interop.convert import (
                      CheckpointError,
                      CheckpointNotFoundError,
                      from_hf,
                      from_open_clip,
                      from_timm,
                      from_torchvision,
                      load_checkpoint,
                      save_checkpoint,
)
from .interop.optimize import optimize
from .layers import Attention, Block, DropPath, LayerScale, Mlp, PatchEmbed, resample_abs_pos_embed
from .model import VisionTransformer, count_params, create_model, forward_flops
from .presets import PRESETS, ViTConfig, get_config, list_models
from .route import Route, apply_route, default_route, route_of

install_inductor_fallbacks()  # torch.compile of a fused model must not stall in inductor (see the function)

__version__ = "0.1.0"


def __getattr__(name: str):
    # HFViT needs transformers, which the library itself does not: imported on first use only
    if name == "HFViT":
        from .interop.hf import HFViT

        return HFViT
    raise AttributeError(f"module 'vit_fast' has no attribute {name!r}")

__all__ = [
    "Attention", "Block", "CheckpointError", "CheckpointNotFoundError", "from_hf", "from_open_clip", "from_timm",
    "from_torchvision",
    "load_checkpoint", "save_checkpoint", "DropPath", "LayerScale", "Mlp", "PatchEmbed", "PRESETS", "ViTConfig",
    "VisionTransformer", "count_params", "create_model", "forward_flops", "get_config", "list_models", "optimize",
    "resample_abs_pos_embed", "Route", "apply_route", "default_route", "route_of", "__version__",
]
