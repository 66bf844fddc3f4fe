"""Model configuration and the preset table.

``ViTConfig`` holds every hyper-parameter of ``VisionTransformer``; a preset is a named set of overrides
of it, with the exact values of the timm model of the same name (the tests compare them against timm).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

from .backend import check_backend
from .family_presets import FAMILY_DATA_CFG, FAMILY_PRESETS
from .layers import to_2tuple

GLOBAL_POOLS = ("token", "avg", "avgmax", "max", "map", "")
ACTS = ("gelu", "gelu_tanh", "quick_gelu")
MLP_LAYERS = ("mlp", "swiglu_packed", "swiglu")
POS_EMBEDS = ("learn", "sincos", "none")
WEIGHT_INITS = ("", "skip")


def mlp_ratio_for(hidden: int, dim: int) -> float:
    """The mlp_ratio whose ``int(dim * mlp_ratio)`` (timm's rounding, ``ViTConfig.mlp_hidden``) is ``hidden``, for a
    width read from a source's tensors: ``hidden / dim`` can land a float below it (1414 / 1408 * 1408 < 1414)."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


@dataclass
class ViTConfig:
    img_size: Union[int, tuple[int, int]] = 224
    patch_size: Union[int, tuple[int, int]] = 16
    in_chans: int = 3
    num_classes: int = 1000           # 0: no head, the model returns pooled features
    global_pool: str = "token"        # 'token' | 'avg' | 'avgmax' | 'max' | 'map' (attention pool, SigLIP) |
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False
    init_values: Optional[float] = None  # LayerScale init; None disables LayerScale
    class_token: bool = True
    reg_tokens: int = 0
    no_embed_class: bool = False      # position embedding covers patches only (DeiT-III, register models)
    pos_embed: str = "learn"          # 'learn' | 'sincos' (fixed 2-D sin-cos, not trained) | 'none'
    fc_norm: Optional[bool] = None    # None: norm after pooling iff global_pool is avg/avgmax/max (timm)
    final_norm: bool = True
    dynamic_img_size: bool = False    # accept any size divisible by the patch; pos-embed resampled bicubic
    drop_rate: float = 0.0            # head dropout
    pos_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0       # stochastic depth, linear 0 -> rate over depth
    norm_eps: float = 1e-6            # timm/torchvision 1e-6; Hugging Face 1e-12
    act: str = "gelu"                 # 'gelu' (exact erf) | 'gelu_tanh' | 'quick_gelu' (x*sigmoid(1.702x), CLIP)
    mlp_layer: str = "mlp"            # 'mlp' | 'swiglu_packed' (timm SwiGLUPacked, DINOv2-g) | 'swiglu' (SwiGLU)
    pre_norm: bool = False            # LayerNorm norm_pre before block 0 (CLIP); the patch conv then has no bias
    head_bias: bool = True            # False: a bias-free output projection (CLIP proj / visual_projection)
    distilled: bool = False           # DeiT distillation token dist_token and second head head_dist
    weight_init: str = ""             # '' timm init | 'skip' (weights loaded right after)
    backend: str = "auto"             # Triton kernels on CUDA (or under TRITON_INTERPRET=1), else the reference
    residual_in_fp32: bool = True     # under autocast: residual stream in fp32 as timm; False: in the autocast
                                      # dtype (FlashAttention's residual_in_fp32=False), fewer bytes per step

    def __post_init__(self) -> None:
        self.img_size = to_2tuple(self.img_size)
        self.patch_size = to_2tuple(self.patch_size)
        check_backend(self.backend)
        self._check_sizes()
        checks = [  # (holds, what is expected, the fields the message shows)
            (self.global_pool in GLOBAL_POOLS, f"global_pool must be one of {GLOBAL_POOLS}", ("global_pool",)),
            (self.pos_embed in POS_EMBEDS, f"pos_embed must be one of {POS_EMBEDS}", ("pos_embed",)),
            (self.weight_init in WEIGHT_INITS, f"weight_init must be one of {WEIGHT_INITS}", ("weight_init",)),
            (self.act in ACTS, f"act must be one of {ACTS}", ("act",)),
            (self.mlp_layer in MLP_LAYERS, f"mlp_layer must be one of {MLP_LAYERS}", ("mlp_layer",)),
            (self.mlp_layer == "mlp" or self.act == "gelu", "act applies to mlp_layer='mlp' (SwiGLU gates with SiLU)",
             ("mlp_layer", "act")),
            (not self.distilled or (self.class_token and self.reg_tokens == 0 and self.global_pool == "token"),
             "distilled=True needs class_token=True, reg_tokens=0 and global_pool='token' (timm's DeiT)",
             ("distilled", "class_token", "reg_tokens", "global_pool")),
            (self.class_token or self.global_pool != "token", "global_pool='token' needs class_token=True",
             ("global_pool", "class_token")),
            (self.embed_dim % self.num_heads == 0, "embed_dim must be divisible by num_heads",
             ("embed_dim", "num_heads")),
            (all(s % p == 0 for s, p in zip(self.img_size, self.patch_size)),
             "img_size must be divisible by patch_size", ("img_size", "patch_size")),
        ]
        for ok, message, fields in checks:
            if not ok:
                got = ", ".join(f"{f}={getattr(self, f)!r}" for f in fields)
                raise ValueError(f"ViTConfig: {message}; got {got}")

    def _check_sizes(self) -> None:
        """Integer sizes and positive rates before anything divides by them: a clear error, not a ZeroDivisionError
        or a build that fails at the first forward."""
        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_number(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

        positive = {"embed_dim": self.embed_dim, "num_heads": self.num_heads, "in_chans": self.in_chans,
                    "img_size": self.img_size, "patch_size": self.patch_size}
        for name, value in positive.items():
            if not all(is_int(v) and v >= 1 for v in (value if isinstance(value, (tuple, list)) else (value,))):
                pair = " (or a pair of them)" if name in ("img_size", "patch_size") else ""
                raise ValueError(f"ViTConfig: {name} must be an integer >= 1{pair}, got {value!r}")
        for name in ("depth", "num_classes", "reg_tokens"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"ViTConfig: {name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name in ("mlp_ratio", "norm_eps"):
            if not (is_number(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"ViTConfig: {name} must be a finite number > 0, got {getattr(self, name)!r}")

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1]

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + int(self.distilled) + self.reg_tokens

    @property
    def num_tokens(self) -> int:
        """Sequence length the blocks see at img_size."""
        return self.grid_size[0] * self.grid_size[1] + self.num_prefix_tokens

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def use_fc_norm(self) -> bool:
        return self.global_pool in ("avg", "avgmax", "max") if self.fc_norm is None else self.fc_norm

    def replace(self, **overrides) -> "ViTConfig":
        """A new config with some fields changed (always a copy, also with no overrides)."""
        check_fields(overrides)
        return dataclasses.replace(self, **overrides)


def check_fields(overrides: dict) -> None:
    valid = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise TypeError(f"unknown ViTConfig field(s) {unknown}; valid fields: {sorted(valid)}")


_TI, _S, _B, _L, _H = (
    dict(embed_dim=192, depth=12, num_heads=3),
    dict(embed_dim=384, depth=12, num_heads=6),
    dict(embed_dim=768, depth=12, num_heads=12),
    dict(embed_dim=1024, depth=24, num_heads=16),
    dict(embed_dim=1280, depth=32, num_heads=16),
)

# name -> overrides of ViTConfig, values identical to timm's model of the same name (timm 1.0.x).
PRESETS: dict[str, dict] = {
    "vit_tiny_patch16_224": dict(_TI, patch_size=16, img_size=224),
    "vit_tiny_patch16_384": dict(_TI, patch_size=16, img_size=384),
    "vit_small_patch16_224": dict(_S, patch_size=16, img_size=224),
    "vit_small_patch16_384": dict(_S, patch_size=16, img_size=384),
    "vit_small_patch32_224": dict(_S, patch_size=32, img_size=224),
    "vit_base_patch8_224": dict(_B, patch_size=8, img_size=224),
    "vit_base_patch16_224": dict(_B, patch_size=16, img_size=224),
    "vit_base_patch16_384": dict(_B, patch_size=16, img_size=384),
    "vit_base_patch32_224": dict(_B, patch_size=32, img_size=224),
    "vit_base_patch32_384": dict(_B, patch_size=32, img_size=384),
    "vit_large_patch14_224": dict(_L, patch_size=14, img_size=224),
    "vit_large_patch16_224": dict(_L, patch_size=16, img_size=224),
    "vit_large_patch16_384": dict(_L, patch_size=16, img_size=384),
    # timm's default weights for ViT-H/14 are the in21k feature extractor: no classifier head.
    "vit_huge_patch14_224": dict(_H, patch_size=14, img_size=224, num_classes=0),
    "deit3_base_patch16_224": dict(_B, patch_size=16, img_size=224, no_embed_class=True, init_values=1e-6),
    "vit_base_patch16_reg4_gap_256": dict(_B, patch_size=16, img_size=256, class_token=False, reg_tokens=4,
                                          no_embed_class=True, global_pool="avg"),
}


PRESETS.update(FAMILY_PRESETS)  # CLIP, SigLIP, DINOv2, DeiT distilled (vit_fast/family_presets.py)

# Data configs of the presets' default weights in timm (resolve_data_config reads them): the augreg ViTs were
# trained on inception-normalised images (0.5 / 0.5), DeiT-III on ImageNet's statistics; crop 1.0 at 384.
_INCEPTION = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
_IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def pretrained_cfg(name: str) -> dict:
    """timm's pretrained_cfg fields for a preset (what timm.data.resolve_data_config and train.py read):
    the default weights' input size, interpolation, crop and normalisation, head size and layer names.
    As in timm it describes the weights, not a model built with other overrides (img_size, num_classes)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    img_size = to_2tuple(PRESETS[name].get("img_size", 224))
    data = FAMILY_DATA_CFG.get(name) or dict(crop_pct=1.0 if min(img_size) >= 384 else 0.9,
                                             **(_IMAGENET if name.startswith("deit") else _INCEPTION))
    return dict(architecture=name, input_size=(3, *img_size), fixed_input_size=True, interpolation="bicubic",
                crop_mode="center", **data,
                num_classes=PRESETS[name].get("num_classes", 1000), pool_size=None, first_conv="patch_embed.proj",
                classifier="head")


def list_models(pattern: str = "") -> list[str]:
    """Preset names, sorted; with a pattern, only names containing it (fnmatch wildcards allowed)."""
    import fnmatch

    names = sorted(PRESETS)
    if not pattern:
        return names
    return [n for n in names if fnmatch.fnmatch(n, pattern if any(c in pattern for c in "*?[") else f"*{pattern}*")]


def get_config(name: str, **overrides) -> ViTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    check_fields(overrides)
    return ViTConfig(**{**PRESETS[name], **overrides})
