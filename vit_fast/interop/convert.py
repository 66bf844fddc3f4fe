"""Weight interop: timm, Hugging Face transformers and torchvision ViTs <-> vit_fast, and checkpoint files.

Each ``from_*`` takes a model object (its config is read exactly) or a bare state dict (the config is
inferred from the tensor shapes; what shapes cannot tell -- num_heads, a non-square img_size -- comes
from ``**overrides``), maps the keys to timm's names and loads them strictly: any missing or unexpected
key or shape mismatch raises one ``CheckpointError`` that names them all.
"""
from __future__ import annotations

import copy
import math
import os
import re
import warnings
from typing import Mapping, Optional

import torch
import torch.nn as nn

from ..adapters import encoder_layer_problems, patchify_problem
from ..layers import to_2tuple
from ..model import VisionTransformer
from ..presets import ViTConfig, check_fields, mlp_ratio_for

# Head count of the standard widths (shapes alone cannot tell it); other widths assume 64-wide heads.
STANDARD_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}


class CheckpointError(ValueError):
    """A checkpoint file cannot be used: damaged / truncated / not tensors (names the file and what is wrong),
    or its state dict does not fit the model (lists missing / unexpected keys and shape mismatches)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No file at the checkpoint path (both a CheckpointError and a FileNotFoundError)."""


def check_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in expected.items() if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        lines = [f"checkpoint does not match {type(model).__name__}:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if mismatched:
            lines.append(f"  shape mismatches ({len(mismatched)}): " + "; ".join(mismatched))
        prefix = _outer_prefix(expected, state_dict)
        if prefix:  # first: the key lists below are long
            lines.insert(1, f"  every checkpoint key starts with {prefix!r}, the attribute a training wrapper (a "
                         f"LightningModule, say) keeps the model in: strip it ({{k.removeprefix({prefix!r}): v for k, "
                         f"v in state_dict.items()}})")
        raise CheckpointError("\n".join(lines))


def _outer_prefix(expected: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> str:
    """'model.' where every key of ``state_dict`` is 'model.' + a key ``expected`` holds (in timm's, transformers'
    or torchvision's names), else ''."""
    outer = {k.split(".", 1)[0] for k in state_dict}
    if len(outer) != 1 or not all("." in k for k in state_dict):
        return ""
    prefix = outer.pop() + "."
    inner = {k[len(prefix):]: v for k, v in state_dict.items()}
    return prefix if set(inner) & set(expected) or set(to_timm_state_dict(inner)) & set(expected) else ""


def load_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    check_state_dict(model, state_dict)
    model.load_state_dict(state_dict, strict=True)
    return model


def _build(config: dict, state_dict: Mapping[str, torch.Tensor], overrides: dict,
           model_class: type = VisionTransformer) -> VisionTransformer:
    check_fields(overrides)
    cfg = ViTConfig(**{**config, "weight_init": "skip", **overrides})
    model = model_class(cfg)
    load_state_dict(model, state_dict)
    if overrides.get("weight_init", "skip") == "skip":
        model.config.weight_init = ""
    return model


def _layer_count(keys, pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def _is_square(n: int) -> bool:
    return n >= 0 and math.isqrt(n) ** 2 == n


def _timm_grid(tokens: int, prefix: int, patch: tuple[int, int], overrides: Mapping, source: str) -> dict:
    """img_size and no_embed_class from pos_embed's ``tokens`` rows: the grid has tokens - prefix patches when
    pos_embed covers the ``prefix`` tokens, else tokens. A square grid is assumed unless img_size is passed. Where
    both readings are squares (class + 4 register tokens and 9 rows: a 3x3 grid, or 2x2 and the 5 prefix tokens) or
    neither is, the error names the keyword that settles it: a model of another size would only fail at forward."""
    if "img_size" in overrides:  # the grid is known: does pos_embed cover the prefix tokens too?
        h, w = to_2tuple(overrides["img_size"])
        return {"no_embed_class": bool(prefix) and tokens == (h // patch[0]) * (w // patch[1])}
    readings = {False: tokens - prefix, True: tokens} if prefix else {False: tokens}
    if prefix and "no_embed_class" in overrides:
        readings = {nec: n for nec, n in readings.items() if nec == bool(overrides["no_embed_class"])}
    grids = {nec: math.isqrt(n) for nec, n in readings.items() if n > 0 and _is_square(n)}
    if len(grids) == 1:
        (no_embed_class, side), = grids.items()
        return {"no_embed_class": no_embed_class, "img_size": (side * patch[0], side * patch[1])}
    if grids:
        size = {nec: f"{side}x{side} grid ({side * patch[0]}x{side * patch[1]} px)" for nec, side in grids.items()}
        raise CheckpointError(f"{source}: pos_embed has {tokens} rows: a {size[False]} and the {prefix} prefix tokens "
                              f"(no_embed_class=False), or a {size[True]} alone (no_embed_class=True); pass img_size= "
                              f"or no_embed_class= to say which")
    patches = " or ".join(str(n) for n in sorted(set(readings.values())))
    raise CheckpointError(f"{source}: pos_embed has {tokens} rows: {patches} patches, not a square grid; pass "
                          f"img_size=(H, W)")


def _timm_mlp(sd: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """Block 0's MLP kind and the hidden width its mlp_ratio gives: timm's SwiGLU has fc1_g and fc1_x, SwiGLUPacked
    one fc1 twice as wide as fc2's input ([gate | value]), Mlp an fc1 as wide as fc2's input."""
    if "blocks.0.mlp.fc1_g.weight" in sd:
        return "swiglu", sd["blocks.0.mlp.fc1_g.weight"].shape[0]
    hidden = sd["blocks.0.mlp.fc1.weight"].shape[0]
    fc2 = sd.get("blocks.0.mlp.fc2.weight")
    return ("swiglu_packed" if fc2 is not None and hidden == 2 * fc2.shape[1] else "mlp"), hidden


# --------------------------------------------------------------------------------------------- timm
def _patchify_problem_of(patch_embed: Optional[nn.Module]) -> Optional[str]:
    proj, patch = getattr(patch_embed, "proj", None), getattr(patch_embed, "patch_size", None)
    return None if proj is None or patch is None else patchify_problem(proj, patch)


def timm_unsupported(model: nn.Module) -> list[str]:
    """Every feature of a timm model that vit_fast does not implement, one line each (empty: ``from_timm``
    converts it exactly). Never raises on another kind of model: a VisionTransformer subclass with other
    blocks (parallel-scaling, rel-pos, rope) gets its block kinds listed."""
    from timm.layers import AttentionPoolLatent, GluMlp, LayerScale, Mlp, PatchEmbed, QuickGELU, SwiGLU
    from timm.layers import LayerNorm as TimmLayerNorm
    from timm.layers.activations import GELU as TimmGELU
    from timm.layers.activations import GELUTanh
    from timm.layers.drop import DropPath
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import Attention, Block
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    # the families (CLIP pre-norm and QuickGELU, SigLIP attention pool, DINOv2-g SwiGLU, DeiT distilled)
    allowed = {TimmViT, VisionTransformerDistilled, PatchEmbed, Block, Attention, Mlp, GluMlp, SwiGLU, QuickGELU,
               AttentionPoolLatent, LayerScale, DropPath, TimmLayerNorm, nn.LayerNorm, nn.Conv2d, nn.Linear,
               nn.GELU, TimmGELU, GELUTanh, nn.SiLU, nn.Dropout, nn.Identity, nn.Sequential, nn.ModuleList}
    if not isinstance(model, TimmViT):
        return [f"model class {type(model).__module__}.{type(model).__qualname__} (not timm's VisionTransformer)"]
    foreign: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if type(module) not in allowed and type(module).__name__ != "PatchDropout":  # own line below
            foreign.setdefault(type(module).__name__, []).append(path)
    problems = [f"module {name} ({len(paths)}x, e.g. {paths[0]!r})" for name, paths in foreign.items()]
    for name in ("head", "head_dist"):  # a head replaced by hand: vit_fast builds one Linear (or none)
        head = getattr(model, name, None)
        if isinstance(head, nn.Module) and not isinstance(head, (nn.Linear, nn.Identity)):
            problems.append(f"{name} of type {type(head).__name__} (vit_fast's {name} is one nn.Linear or an "
                            f"nn.Identity)")
    patch_embed = getattr(model, "patch_embed", None)
    patchify = _patchify_problem_of(patch_embed)
    problems += [name for name, bad in [
        ("attention pooling 'prr'", getattr(model, "global_pool", "") == "prr"),
        ("patch_embed.norm", not isinstance(getattr(patch_embed, "norm", nn.Identity()), nn.Identity)),
        (f"patch_embed.proj: {patchify}", patchify is not None),
        ("dynamic_img_pad", getattr(patch_embed, "dynamic_img_pad", False)),
        ("pool_include_prefix=True", getattr(model, "pool_include_prefix", False)),
        ("patch dropout (patch_drop_rate > 0)", not isinstance(getattr(model, "patch_drop", nn.Identity()),
                                                               nn.Identity)),
    ] if bad]
    blocks = list(getattr(model, "blocks", []))
    kinds = sorted({type(b).__name__ for b in blocks if type(b) is not Block})
    if kinds:
        problems.append(f"blocks of kind {', '.join(kinds)} (only timm's Block: norm1, attn, ls1, norm2, mlp, ls2)")
    elif blocks:  # config-level switches are the same in every block
        blk = blocks[0]
        if not isinstance(getattr(blk.attn, "norm", nn.Identity()), nn.Identity):
            problems.append("attention output norm (scale_attn_norm=True), blocks.0.attn.norm")
        if not isinstance(getattr(blk.mlp, "norm", nn.Identity()), nn.Identity):
            problems.append("MLP hidden norm (scale_mlp_norm=True), blocks.0.mlp.norm")
        if isinstance(getattr(blk, "norm1", None), nn.Identity) or isinstance(getattr(blk, "norm2", None), nn.Identity):
            problems.append("blocks without their LayerNorms (norm_layer=nn.Identity): vit_fast's blocks are "
                            "pre-norm, each branch joined with the next LayerNorm")
        if not foreign:  # the config of a model with foreign parts (a hybrid stem) is not timm's to read
            problems += _family_problems(model)
        if getattr(blk.attn.proj, "bias", None) is None or getattr(getattr(blk.mlp, "fc2", None), "bias", 1) is None:
            problems.append("projections without bias (proj_bias=False)")
        from ..kernels.attention.common import MAX_HEAD_DIM

        head_dim = getattr(blk.attn, "head_dim", 0)
        if head_dim > MAX_HEAD_DIM:
            problems.append(f"head_dim {head_dim} (the fused attention kernels take 1..{MAX_HEAD_DIM})")
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    if any(m.eps <= 0 for m in norms):
        problems.append("LayerNorm eps <= 0 (the LayerNorm kernels need eps > 0)")
    if len({m.eps for m in norms}) > 1:
        problems.append(f"LayerNorms with different eps {sorted({m.eps for m in norms})}")
    if any(not m.elementwise_affine or m.bias is None for m in norms):
        problems.append("LayerNorm without affine weight/bias")
    return problems


def _family_problems(model: nn.Module) -> list[str]:
    """What ``families.timm_config`` cannot express (other MLP kinds and activations, attention-pool
    variants, a patch bias that does not follow timm's pre_norm rule), one line each."""
    from .families import timm_config

    try:
        timm_config(model)
    except ValueError as e:
        return [str(e)]
    return []


def _timm_config_from_model(m: nn.Module) -> dict:
    problems = timm_unsupported(m)
    if problems:
        raise ValueError("from_timm: this timm model uses features vit_fast does not implement:\n  - "
                         + "\n  - ".join(problems))
    from .families import timm_config

    return timm_config(m)


def _timm_config_from_state_dict(sd: Mapping[str, torch.Tensor], overrides: Mapping = {},
                                 source: str = "from_timm") -> dict:
    """ViTConfig fields from a timm-keyed state dict's keys and shapes; ``overrides`` settle an ambiguous grid."""
    proj = sd["patch_embed.proj.weight"]
    D, in_chans, ph, pw = proj.shape
    cfg = dict(embed_dim=D, in_chans=in_chans, patch_size=(ph, pw), num_heads=STANDARD_HEADS.get(D, max(1, D // 64)),
               depth=_layer_count(sd, r"blocks\.(\d+)\."), class_token="cls_token" in sd,
               reg_tokens=sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    # CLIP's norm_pre (timm: no patch bias then), DeiT's distillation token (before the registers in pos_embed)
    cfg.update(pre_norm="norm_pre.weight" in sd, distilled="dist_token" in sd)
    prefix = cfg["class_token"] + cfg["distilled"] + cfg["reg_tokens"]
    if "pos_embed" in sd:
        cfg.update(_timm_grid(sd["pos_embed"].shape[1], prefix, (ph, pw), overrides, source))
    else:
        cfg["pos_embed"] = "none"
    if cfg["depth"]:
        mlp_layer, hidden = _timm_mlp(sd)
        cfg.update(mlp_ratio=mlp_ratio_for(hidden, D), mlp_layer=mlp_layer,
                   qkv_bias="blocks.0.attn.qkv.bias" in sd, qk_norm="blocks.0.attn.q_norm.weight" in sd)
        if "blocks.0.ls1.gamma" in sd:
            cfg["init_values"] = 1e-5  # any value: gamma is loaded right after
    elif "attn_pool.mlp.fc1.weight" in sd:  # timm builds the pool's MLP with the blocks' mlp_ratio
        cfg["mlp_ratio"] = mlp_ratio_for(sd["attn_pool.mlp.fc1.weight"].shape[0], D)
    cfg["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    if "head.weight" in sd and "head.bias" not in sd:
        cfg["head_bias"] = False
    # timm builds attn_pool only for 'map'; otherwise it puts the final norm after pooling (fc_norm) exactly when
    # it averages tokens
    has_fc_norm = "fc_norm.weight" in sd
    if "attn_pool.latent" in sd:
        cfg["global_pool"] = "map"
    else:
        cfg["global_pool"] = "token" if cfg["class_token"] and not has_fc_norm else "avg"
    pool = overrides.get("global_pool", cfg["global_pool"])
    cfg["final_norm"] = has_fc_norm or "norm.weight" in sd
    if has_fc_norm != (pool in ("avg", "avgmax", "max")):
        cfg["fc_norm"] = has_fc_norm
    return cfg


# What a timm ViT's state dict does not record, with what from_timm assumes for it (timm's ViT defaults; the pooling
# from the tensors present): a source that differs needs them passed, or its model object converted
STATE_DICT_ASSUMPTIONS = {"act": "'gelu'", "norm_eps": "1e-6",
                          "global_pool": "'token' with a class token and no fc_norm, else 'avg'"}
# The same for a transformers ViT's state dict (its config's defaults) and a torchvision one (which fixes GELU and
# eps 1e-6 in code): the head count alone, at a width whose usual head count is not known
HF_STATE_DICT_ASSUMPTIONS = {"act": "'gelu'", "norm_eps": "1e-12"}


def _timm_state_dict_assumptions(config: Mapping) -> dict[str, str]:
    """STATE_DICT_ASSUMPTIONS less what this state dict's keys settle, plus img_size where it has no pos_embed."""
    assumed = dict(STATE_DICT_ASSUMPTIONS)
    if config["global_pool"] == "map" or config["distilled"]:  # attn_pool's keys; DeiT's heads read the tokens
        del assumed["global_pool"]
    if config.get("mlp_layer", "mlp") != "mlp" and config["global_pool"] != "map":  # SwiGLU gates with SiLU
        del assumed["act"]
    if config.get("pos_embed") == "none":  # only the forward's input size depends on it
        assumed["img_size"] = f"{ViTConfig.img_size} (ViTConfig's default, no pos_embed records the grid)"
    return assumed


def _warn_assumed(source: str, assumptions: Mapping[str, str], config: Mapping, overrides: Mapping,
                  hint: str) -> None:
    """One warning naming what ``source``'s state dict did not record and the caller did not pass: ``assumptions``,
    and num_heads where the width is not one of STANDARD_HEADS (any head count fits the same tensors)."""
    assumed = dict(assumptions)
    if config["embed_dim"] not in STANDARD_HEADS:
        assumed["num_heads"] = f"{config['num_heads']} (64-wide heads at width {config['embed_dim']})"
    named = [f"{k}={v}" for k, v in assumed.items() if k not in overrides]
    if named:
        warnings.warn(f"{source}: a state dict does not record {', '.join(assumed)}; assumed {', '.join(named)}: "
                      f"pass them as keyword arguments where the source differs{hint}", UserWarning, stacklevel=3)


def _carry_attention_switches(timm_model: nn.Module, model: VisionTransformer) -> None:
    """timm's per-block attention switch: a block on timm's explicit path (``fused_attn=False``, e.g. under
    TIMM_FUSED_ATTN=0, or set for attention maps) stays on it, with the scale it applies there (one set by hand
    included; timm's SDPA path ignores the attribute, and so does a converted fused block keeping the default)."""
    for source, block in zip(getattr(timm_model, "blocks", ()), model.blocks):
        attn = getattr(source, "attn", None)
        if attn is not None and getattr(attn, "fused_attn", True) is False:
            block.attn.fused_attn = False
            block.attn.scale = float(attn.scale)


_BLOCK_DROPOUTS = ("attn.attn_drop", "attn.proj_drop", "mlp.drop1", "mlp.drop2")


def _carry_dropout_rates(timm_model: nn.Module, model: VisionTransformer) -> None:
    """Each block's dropout rates as the timm model's block has them (the config holds block 0's: a rate set by
    hand on one block, or a dropout replaced by an nn.Identity, applies where it was set)."""
    from .families import dropout_p

    for source, block in zip(getattr(timm_model, "blocks", ()), model.blocks):
        for path in _BLOCK_DROPOUTS:
            mine, theirs = _submodule_or_none(block, path), _submodule_or_none(source, path)
            if type(mine) is nn.Dropout and isinstance(theirs, (nn.Dropout, nn.Identity)):
                mine.p = dropout_p(theirs)


def _submodule_or_none(module: nn.Module, path: str):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def from_timm(model_or_state_dict, **overrides) -> VisionTransformer:
    """A vit_fast model with the weights (and, for a model object, the exact config) of a timm ViT. From a state
    dict, the shapes give the sizes and the keys the families (attn_pool: 'map', norm_pre, dist_token, SwiGLU);
    what it does not record is assumed (``STATE_DICT_ASSUMPTIONS``: activation, LayerNorm eps, pooling, num_heads
    for a non-standard width, img_size without pos_embed) with a warning naming each one not passed as a keyword
    argument. A non-square grid needs img_size; rows that fit two square grids (with and without the prefix
    tokens) are refused, naming img_size and no_embed_class."""
    if isinstance(model_or_state_dict, nn.Module):
        sd = model_or_state_dict.state_dict()
        config = _timm_config_from_model(model_or_state_dict)
    else:
        if not isinstance(model_or_state_dict, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model_or_state_dict.items()):
            raise ValueError(f"from_timm: expected a timm VisionTransformer or its state dict (str -> Tensor), got "
                             f"{type(model_or_state_dict).__name__}")
        sd = dict(model_or_state_dict)
        if "patch_embed.proj.weight" not in sd:
            raise CheckpointError(f"from_timm: the state dict has no 'patch_embed.proj.weight', so it is not a timm "
                                  f"ViT's (its first keys: {sorted(sd)[:5]})")
        config = _timm_config_from_state_dict(sd, overrides)
        _warn_assumed("from_timm", _timm_state_dict_assumptions(config), config, overrides,
                      " (CLIP: act='quick_gelu' or norm_eps=1e-5), or convert the timm model object")
    model = _build(config, sd, overrides)
    if isinstance(model_or_state_dict, nn.Module):
        _carry_attention_switches(model_or_state_dict, model)
        _carry_dropout_rates(model_or_state_dict, model)
    source_cfg = getattr(model_or_state_dict, "pretrained_cfg", None)
    if source_cfg:  # the data config (mean, std, crop, interpolation) travels with the weights
        model.pretrained_cfg = copy.deepcopy(dict(source_cfg))
    return model


# ------------------------------------------------------------------------------------- Hugging Face
_HF_OLD = {  # transformers < 5 (and most hub checkpoints) -> transformers 5.x names
    "attention.attention.query.": "attention.q_proj.", "attention.attention.key.": "attention.k_proj.",
    "attention.attention.value.": "attention.v_proj.", "attention.output.dense.": "attention.o_proj.",
    "intermediate.dense.": "mlp.fc1.", "output.dense.": "mlp.fc2.",
}
_HF_LAYER = {"attention.o_proj": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def hf_to_timm_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map ViTModel / ViTForImageClassification keys (old or new names) to timm's; q, k, v fused into qkv.
    The ViTModel pooler (dense + tanh, unused by image classification) and mask token (use_mask_token=True, read
    only with bool_masked_pos) are dropped."""
    out, qkv = {}, {}
    for key, value in sd.items():
        k = key[4:] if key.startswith("vit.") else key
        k = re.sub(r"^encoder\.layer\.", "layers.", k)
        for old, new in _HF_OLD.items():
            k = k.replace(old, new)
        if k.startswith("pooler.") or k == "embeddings.mask_token":   # use_mask_token: only masked-image modelling
            continue
        if m := re.match(r"layers\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$", k):
            qkv.setdefault((int(m.group(1)), m.group(3)), {})[m.group(2)] = value
            continue
        if m := re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", k):
            if m.group(2) not in _HF_LAYER:
                out[key] = value  # left unmapped: reported as unexpected
                continue
            k = f"blocks.{m.group(1)}.{_HF_LAYER[m.group(2)]}.{m.group(3)}"
        else:
            k = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
                 "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
                 "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
                 "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
                 "classifier.weight": "head.weight", "classifier.bias": "head.bias"}.get(k, key)
        out[k] = value
    for (layer, kind), parts in sorted(qkv.items()):
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"Hugging Face layer {layer}: expected q, k and v {kind}, found only {sorted(parts)}")
        out[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


HF_FAMILY_CLASSES = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "SiglipVisionModel",
                     "SiglipForImageClassification", "Dinov2Model")


def hf_vit_config(hf: nn.Module) -> dict:
    """ViTConfig fields of a transformers ViTModel / ViTForImageClassification (its config and classifier)."""
    from .families import hf_act

    c = hf.config
    act = hf_act(c.hidden_act)
    head_weight = getattr(getattr(hf, "classifier", None), "weight", None)
    return dict(
        img_size=c.image_size, patch_size=c.patch_size, in_chans=c.num_channels, embed_dim=c.hidden_size,
        depth=c.num_hidden_layers, num_heads=c.num_attention_heads,
        mlp_ratio=mlp_ratio_for(c.intermediate_size, c.hidden_size), qkv_bias=c.qkv_bias, norm_eps=c.layer_norm_eps,
        num_classes=head_weight.shape[0] if head_weight is not None else 0, act=act,
        pos_drop_rate=c.hidden_dropout_prob, proj_drop_rate=c.hidden_dropout_prob,
        attn_drop_rate=c.attention_probs_dropout_prob,
    )


def from_hf(model_or_state_dict, **overrides) -> VisionTransformer:
    """A vit_fast model with the weights of a transformers ViTModel / ViTForImageClassification, or of a
    CLIPVisionModel(WithProjection) / SiglipVisionModel / SiglipForImageClassification / Dinov2Model object
    (config read exactly, see interop/families.py; CLIP's visual_projection becomes a bias-free head).

    Keeps Hugging Face's LayerNorm eps (1e-12) and GELU flavour. From a state dict, act 'gelu', eps 1e-12 and the
    width's standard num_heads are assumed, with a warning naming each one not passed. Eval outputs are
    identical; in training, the standalone model regularises as timm's blocks do: ViT's hidden_dropout_prob also
    drops after the GELU (timm's Mlp), which transformers' ViTIntermediate does not, and DINOv2's stochastic
    depth ramps from 0 over the blocks where transformers gives every layer the same rate. ``vit_fast.optimize``
    of the transformers model keeps transformers' placement and rates."""
    if isinstance(model_or_state_dict, nn.Module) and type(model_or_state_dict).__name__ in HF_FAMILY_CLASSES:
        from .families import hf_config, hf_to_timm

        return _build(hf_config(model_or_state_dict), hf_to_timm(model_or_state_dict), overrides)
    if isinstance(model_or_state_dict, nn.Module):
        _check_hf_vit_class(model_or_state_dict)
        sd = hf_to_timm_state_dict(model_or_state_dict.state_dict())
        config = hf_vit_config(model_or_state_dict)
    else:
        sd = hf_to_timm_state_dict(model_or_state_dict)
        _check_hf_vit_state_dict(sd)
        config = {**_timm_config_from_state_dict(sd, overrides, "from_hf"), "norm_eps": 1e-12}
        _warn_assumed("from_hf", HF_STATE_DICT_ASSUMPTIONS, config, overrides,
                      " (hidden_act 'gelu_new': act='gelu_tanh'), or convert the transformers model object")
    return _build(config, sd, overrides)


_HF_VIT_CLASSES = ("ViTModel", "ViTForImageClassification", "ViTMSNModel")  # ViT-MSN: a ViT encoder's layout


def _check_hf_vit_class(model: nn.Module) -> None:
    """A model object from_hf reads as a ViT is a transformers ViTModel / ViTForImageClassification (or one optimize
    returned): another class (DeiT, Dinov2ForImageClassification, DINOv2 with registers, ViTMAE...) is refused by
    name, with the supported module inside it where there is one (it failed with an AttributeError on its config, a
    CheckpointError listing keys, or converted a model whose forward is not a ViT's)."""
    if any(c.__module__.startswith("transformers.") and c.__name__ in _HF_VIT_CLASSES for c in type(model).__mro__):
        return
    from .optimize import _supported_submodule

    inner = _supported_submodule(model)
    hint = f"; its {inner} is one: pass model.{inner}" if inner else ""
    raise ValueError(f"from_hf: expected a transformers ViTModel / ViTForImageClassification / "
                     f"{' / '.join(HF_FAMILY_CLASSES)} (or a ViT state dict), got "
                     f"{type(model).__module__}.{type(model).__qualname__}{hint}")


# Keys only the other transformers families' state dicts hold (CLIP / SigLIP embeddings, DINOv2's mask token and
# LayerScale)
_HF_FAMILY_MARKERS = {"embeddings.patch_embedding.": "CLIP or SigLIP", ".layer_scale1.": "DINOv2"}


def _check_hf_vit_state_dict(sd: Mapping[str, torch.Tensor]) -> None:
    """A state dict from_hf reads is a ViTModel / ViTForImageClassification's: another family's (whose config its
    tensors do not record) or something else is refused by name."""
    for marker, family in _HF_FAMILY_MARKERS.items():
        if any(marker in k for k in sd):
            raise CheckpointError(f"from_hf: a state dict is read as a transformers ViTModel / "
                                  f"ViTForImageClassification's; this one is a {family} model's, whose config its "
                                  f"tensors do not record: build the transformers model and pass it (from_hf(model))")
    if "patch_embed.proj.weight" not in sd:
        raise CheckpointError(f"from_hf: the state dict has no 'embeddings.patch_embeddings.projection.weight', so it "
                              f"is not a transformers ViT's (its first keys: {sorted(sd)[:5]})")


# ----------------------------------------------------------------------------------------- open_clip
def from_open_clip(model, **overrides) -> VisionTransformer:
    """A vit_fast model with the weights of an open_clip image tower: an open_clip VisionTransformer or a
    CLIP model holding one as ``.visual``. ``proj`` becomes a bias-free head (forward returns x @ proj as
    open_clip's does); LayerScale, QuickGELU / GELU and the LayerNorm eps are read from the modules.
    (``vit_fast.optimize`` of the tower returns the same model answering open_clip's tower methods too.)"""
    return _from_open_clip(model, VisionTransformer, overrides)


def _from_open_clip(model, model_class: type, overrides: dict) -> VisionTransformer:
    from .families import open_clip_config, open_clip_to_timm

    if isinstance(model, Mapping):
        raise ValueError("from_open_clip: expected an open_clip model or its .visual, got a state dict, which does not "
                         "record the tower's activation, pooling or attentional pool: build the model with open_clip "
                         "(open_clip.create_model(name, pretrained=path)) and pass it")
    visual = getattr(model, "visual", model)
    return _build(open_clip_config(visual), open_clip_to_timm(visual.state_dict()), overrides, model_class)


# --------------------------------------------------------------------------------------- torchvision
_TV_LAYER = {"ln_1": "norm1", "ln_2": "norm2", "self_attention.in_proj": "attn.qkv",
             "self_attention.out_proj": "attn.proj", "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2",
             "mlp.linear_1": "mlp.fc1", "mlp.linear_2": "mlp.fc2"}


def torchvision_to_timm_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map torchvision.models.VisionTransformer keys to timm's (in_proj is already packed [q; k; v])."""
    out = {}
    for key, value in sd.items():
        k = key
        if m := re.match(r"encoder\.layers\.encoder_layer_(\d+)\.(.+?)[._](weight|bias)$", key):
            name = _TV_LAYER.get(m.group(2))
            k = f"blocks.{m.group(1)}.{name}.{m.group(3)}" if name else key
        else:
            k = {"class_token": "cls_token", "encoder.pos_embedding": "pos_embed",
                 "conv_proj.weight": "patch_embed.proj.weight", "conv_proj.bias": "patch_embed.proj.bias",
                 "encoder.ln.weight": "norm.weight", "encoder.ln.bias": "norm.bias",
                 "heads.head.weight": "head.weight", "heads.head.bias": "head.bias"}.get(key, key)
        out[k] = value
    return out


def _torchvision_act(module: nn.Module) -> Optional[str]:
    """The ViTConfig act of a torchvision MLP's activation module; None for one the kernels do not compute."""
    if type(module) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return None


def _torchvision_head(heads: nn.Module) -> tuple[int, bool]:
    """(num_classes, head bias) of a torchvision ViT's ``heads``, read from the modules: fine-tuning replaces
    ``heads.head`` (another class count; the model's ``num_classes`` attribute is not updated) or drops it for
    features (``heads`` or ``heads.head`` an nn.Identity: the class token after the final norm, num_classes 0)."""
    if isinstance(heads, nn.Identity):
        return 0, True
    children = dict(heads.named_children())
    if "pre_logits" in children:
        raise ValueError("from_torchvision: models with representation_size (heads.pre_logits) are not supported")
    head = children.get("head")
    if list(children) == ["head"] and isinstance(head, nn.Identity):
        return 0, True
    if list(children) == ["head"] and type(head) is nn.Linear:
        return head.out_features, head.bias is not None
    raise ValueError(f"from_torchvision: expected heads to hold one nn.Linear named 'head' (or heads / heads.head an "
                     f"nn.Identity for features), got {type(heads).__name__} with {children or 'no modules'}")


def _torchvision_layer_problems(tv: nn.Module) -> list[str]:
    """What in a torchvision ViT's encoder the conversion would drop or misread (the config is read from the first
    layer, the weights by name): each once."""
    from torchvision.models.vision_transformer import EncoderBlock

    problems = []
    for layer in tv.encoder.layers:
        if type(layer) is not EncoderBlock or not isinstance(layer.self_attention, nn.MultiheadAttention):
            problems.append(f"encoder layers of type {type(layer).__name__}")
            continue
        # torchvision's layers take (B, N, D)
        problems += encoder_layer_problems(layer.self_attention, (layer.ln_1, layer.ln_2, tv.encoder.ln))
    return list(dict.fromkeys(problems))


def from_torchvision(model_or_state_dict, **overrides) -> VisionTransformer:
    """A vit_fast model with the weights of a torchvision VisionTransformer (vit_b_16, vit_b_32, vit_l_16, ...). From
    a state dict at a width without a standard head count, num_heads is assumed (64-wide heads) with a warning."""
    if isinstance(model_or_state_dict, nn.Module):
        tv = model_or_state_dict
        num_classes, head_bias = _torchvision_head(tv.heads)
        if not isinstance(tv.conv_proj, nn.Conv2d):
            raise ValueError("from_torchvision: models with a convolutional stem (conv_stem_configs) are not supported")
        problem = patchify_problem(tv.conv_proj, (tv.patch_size, tv.patch_size))
        if problem:
            raise ValueError(f"from_torchvision: conv_proj is {problem}")
        problems = _torchvision_layer_problems(tv)
        if problems:
            raise ValueError(f"from_torchvision: this model uses features vit_fast does not implement: {problems}")
        layer = tv.encoder.layers[0]
        acts = {_torchvision_act(block.mlp[1]) for block in tv.encoder.layers}
        if None in acts or len(acts) > 1:
            found = sorted({repr(block.mlp[1]) for block in tv.encoder.layers})
            raise ValueError(f"from_torchvision: the MLP activation must be nn.GELU() or nn.GELU(approximate='tanh') "
                             f"in every layer, got {', '.join(found)}")
        config = dict(
            img_size=tv.image_size, patch_size=tv.patch_size, in_chans=tv.conv_proj.in_channels,
            embed_dim=tv.hidden_dim, depth=len(tv.encoder.layers), num_heads=layer.self_attention.num_heads,
            mlp_ratio=mlp_ratio_for(tv.mlp_dim, tv.hidden_dim), num_classes=num_classes, head_bias=head_bias,
            norm_eps=layer.ln_1.eps,
            pos_drop_rate=tv.encoder.dropout.p, proj_drop_rate=tv.dropout,
            attn_drop_rate=tv.attention_dropout, act=acts.pop(),
        )
        sd = torchvision_to_timm_state_dict(tv.state_dict())
    else:
        sd = torchvision_to_timm_state_dict(model_or_state_dict)
        config = _timm_config_from_state_dict(sd, overrides, "from_torchvision")
        _warn_assumed("from_torchvision", {}, config, overrides, ", or convert the torchvision model object")
    return _build(config, sd, overrides)


# ----------------------------------------------------------------------------------- checkpoint files
def detect_format(sd: Mapping[str, torch.Tensor]) -> str:
    keys = set(sd)
    if any(k.startswith(("encoder.layers.encoder_layer_", "conv_proj.")) for k in keys) or "class_token" in keys:
        return "torchvision"
    if any(k.startswith(("vit.", "embeddings.patch_embeddings")) for k in keys):
        return "hf"
    return "timm"


def to_timm_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fmt = detect_format(sd)
    if fmt == "hf":
        return hf_to_timm_state_dict(sd)
    if fmt == "torchvision":
        return torchvision_to_timm_state_dict(sd)
    return dict(sd)


def sniff_checkpoint_format(path: str | os.PathLike) -> str:
    """'safetensors', 'torch-zip' or 'torch-pickle' from a file's first bytes (never from its suffix).

    Raises CheckpointNotFoundError for a missing path and CheckpointError naming the file for a directory, an
    empty file, a truncated safetensors header and bytes that are neither format."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"checkpoint {path!r}: no such file")
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a directory, expected a .safetensors or torch.save file")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"checkpoint {path!r} is empty (0 bytes): truncated or never written")
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    # safetensors: u64 little-endian header length, then JSON. Asked before the pickle's first byte: a header
    # length whose low byte is 0x80 (one file in 32, the header being padded to 8 bytes) starts with b"\x80" too
    if len(head) == 9 and head[8:9] == b"{":
        header_len = int.from_bytes(head[:8], "little")
        if 8 + header_len > size:
            raise CheckpointError(f"checkpoint {path!r}: truncated safetensors file (its header announces "
                                  f"{header_len} bytes of metadata, the file has {size} bytes in all)")
        return "safetensors"
    if head[:1] == b"\x80":   # pickle protocol >= 2: torch.save's legacy (non-zip) format
        return "torch-pickle"
    raise CheckpointError(f"checkpoint {path!r} ({size} bytes) is neither a safetensors file nor a torch.save "
                          f"file (first bytes {head[:8]!r})")


def _read_raw(path: str, fmt: str):
    """The object stored in ``path`` (format ``fmt``); every reader error becomes a CheckpointError."""
    import pickle
    import zipfile

    if fmt == "safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as err:   # SafetensorError, OSError: the file's bytes do not match its header
            raise CheckpointError(f"checkpoint {path!r}: damaged safetensors file ({type(err).__name__}: "
                                  f"{err})") from err
    if fmt == "torch-zip" and not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {path!r}: truncated or damaged torch.save file (zip archive without "
                              f"its central directory)")
    try:
        with open(path, "rb") as f:   # a file object: torch.load must not pick a reader from the suffix either
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = str(err)
        if "GLOBAL" in text or "Unsupported operand" in text or "Weights only load failed" in text and \
                "truncated" not in text:
            detail = next((line.strip() for line in text.splitlines() if "GLOBAL" in line or "Unsupported" in line),
                          text.splitlines()[-1].strip() if text.strip() else "")
            raise CheckpointError(f"checkpoint {path!r} holds pickled code, not only tensors; only tensors are "
                                  f"loaded (torch.load weights_only=True), nothing in it was executed. Re-save "
                                  f"the weights as a state dict of tensors ({detail[:200]})") from None
        raise CheckpointError(f"checkpoint {path!r}: damaged torch.save file ({text[:200]})") from err
    except Exception as err:   # EOFError, RuntimeError (zip / storage sizes), OSError, ...
        raise CheckpointError(f"checkpoint {path!r}: truncated or damaged torch.save file "
                              f"({type(err).__name__}: {str(err)[:200] or 'unexpected end of file'})") from err


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or of a torch.save file read with torch.load(weights_only=True) (no
    pickled code runs). The format comes from the file's bytes, not its suffix. A {'state_dict': ...} /
    {'model': ...} wrapper and a 'module.' prefix (DistributedDataParallel) are removed. Anything wrong with
    the file (directory, empty, truncated, pickled code, not a dict of tensors) is a CheckpointError naming
    the file and what is wrong; a missing file a CheckpointNotFoundError (a CheckpointError and a
    FileNotFoundError)."""
    path = os.fspath(path)
    sd = _read_raw(path, sniff_checkpoint_format(path))
    for wrapper in ("state_dict", "model", "model_state_dict"):
        if isinstance(sd, dict) and isinstance(sd.get(wrapper), dict):
            sd = sd[wrapper]
            break
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        got = type(sd).__name__
        if isinstance(sd, dict):   # name what is there: another wrapper ('model_ema', 'state_dict_ema'), or extras
            others = [f"{k!r} ({type(v).__name__})" for k, v in sd.items() if not isinstance(v, torch.Tensor)]
            got += (f" with entries that are not tensors: {', '.join(others[:8])}; a state dict is read from the "
                    f"file itself or its 'state_dict', 'model' or 'model_state_dict' entry")
        raise CheckpointError(f"checkpoint {path!r} does not hold a state dict of tensors (got {got})")
    if not all(isinstance(k, str) for k in sd):
        raise CheckpointError(f"checkpoint {path!r} does not hold a state dict of tensors: keys that are not "
                              f"strings ({sorted(repr(k) for k in sd if not isinstance(k, str))[:5]})")
    while sd and (prefix := next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in sd)), None)):
        sd = {k[len(prefix):]: v for k, v in sd.items()}
    return sd


# Prefixes a wrapper puts before every key: DistributedDataParallel's and torch.compile's (OptimizedModule), nested
# either way round
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's OptimizedModule and (Distributed)DataParallel, as timm's unwrap_model: the
    module whose state dict has the model's own key names."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a timm-, Hugging Face- or torchvision-keyed checkpoint file into ``model`` (strict).

    The checkpoint's keys are mapped to timm's, unless they are already the model's own (a transformers model,
    optimized or not, and its own checkpoint). A prefix before every key that leaves the model's keys (a
    LightningModule's 'model.') is removed. A model under torch.compile or (Distributed)DataParallel is loaded
    through the module it wraps. Raises CheckpointError naming every missing / unexpected key and shape
    mismatch."""
    raw = read_state_dict(path)
    target = _unwrapped(model)
    own = target.state_dict()
    on_meta = [name for name, t in own.items() if t.is_meta]
    if on_meta:  # torch's load_state_dict would copy into nothing, with a warning per tensor
        raise CheckpointError(f"{os.fspath(path)}: the model's tensors are on the meta device ({on_meta[0]}, ... "
                              f"{len(on_meta)} in all): call model.to_empty(device=...) before loading, or "
                              f"model.load_state_dict(state_dict, assign=True)")
    empty = [name for name, t in raw.items() if t.is_meta]
    if empty:
        raise CheckpointError(f"{os.fspath(path)}: the checkpoint holds tensors without data (on the meta device: "
                              f"{empty[0]}, ... {len(empty)} in all): it was saved from a model not yet materialised")
    expected = set(own)
    outer = "" if set(raw) == expected else _outer_prefix(own, raw)   # a training wrapper's ('model.')
    if outer:
        raw = {k[len(outer):]: v for k, v in raw.items()}
    sd = raw if set(raw) == expected or detect_format(dict.fromkeys(expected)) != "timm" else to_timm_state_dict(raw)
    try:
        load_state_dict(target, sd)
    except CheckpointError as e:
        raise CheckpointError(f"{os.fspath(path)}: {e}") from None
    return model


def tensors_to_save(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``'s tensors detached, contiguous and on the CPU, as safetensors writes them: a tensor sharing memory
    with an earlier one (tied weights, a buffer viewing a parameter) as a copy, since safetensors refuses shared
    memory (loading copies into the model's own tensors, ties included)."""
    tensors, storages = {}, set()
    for name, t in state.items():
        t = t.detach().contiguous().cpu()
        storage = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if storage in storages else t
        storages.add(storage)
    return tensors


def save_checkpoint(model: nn.Module, path: str | os.PathLike, metadata: Optional[dict[str, str]] = None) -> None:
    """Write the model's state dict (timm key names; a transformers model's own) to .safetensors, or .pt/.pth with
    torch.save. A model under torch.compile or (Distributed)DataParallel is saved under the wrapped module's names
    (no '_orig_mod.' / 'module.' prefix), as timm saves it."""
    path = os.fspath(path)
    if not path.endswith((".safetensors", ".pt", ".pth")):
        raise ValueError(f"checkpoint {path!r}: expected a .safetensors, .pt or .pth file name")
    if metadata is not None and not path.endswith(".safetensors"):
        raise ValueError(f"checkpoint {path!r}: metadata is written to .safetensors files only (torch.save files "
                         f"hold tensors alone)")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError(f"checkpoint {path!r}: expected metadata as a dict of str to str (safetensors' header), "
                         f"got {metadata!r:.200}")
    state = _unwrapped(model).state_dict()
    on_meta = [k for k, v in state.items() if v.is_meta]
    if on_meta:
        raise ValueError(f"checkpoint {path!r}: the model's tensors are on the meta device ({on_meta[0]}, ... "
                         f"{len(on_meta)} in all), they hold no values to save: materialise it first "
                         f"(model.to_empty(device=...) and a weight load or init)")
    sd = tensors_to_save(state)
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint {path!r}: its folder {folder!r} does not exist; create it first "
                                "(os.makedirs)")
    tmp = path + ".tmp"   # written next to the target and renamed: a crash never leaves a half-written file
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(sd, tmp, metadata=metadata)
        else:
            torch.save(sd, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
