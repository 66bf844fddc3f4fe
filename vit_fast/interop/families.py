"""The fine-tuning families (CLIP, SigLIP, DINOv2, DeiT distilled) from timm, Hugging Face transformers and
open_clip: their configs, read exactly from the source object, and their state dicts mapped to timm's names.

Config fields beyond the original ViT (``FAMILY_DEFAULTS``; the model reads them from ``ViTConfig``):
  pre_norm    LayerNorm ``norm_pre`` between the embedding and block 0 (CLIP); the patch conv then has no bias
              (timm: ``bias=not pre_norm``; OpenAI / open_clip / transformers CLIP the same);
  act         'gelu' | 'gelu_tanh' | 'quick_gelu' (x * sigmoid(1.702 x), OpenAI CLIP);
  mlp_layer   'mlp' | 'swiglu_packed' (timm SwiGLUPacked, DINOv2-g: one fc1 of 2F outputs, gate first) |
              'swiglu' (timm SwiGLU: fc1_g, fc1_x);
  global_pool 'map': timm's AttentionPoolLatent head ``attn_pool`` (SigLIP);
  head_bias   False for output projections without bias (CLIP's ``proj`` / ``visual_projection``);
  distilled   DeiT's distillation token ``dist_token`` and second head ``head_dist`` (VisionTransformerDistilled).

Mappings (every source key is consumed or named in the error; q, k, v are packed into timm's qkv):
  transformers CLIPVisionModel(WithProjection)  vision_model.embeddings.{class_embedding, patch_embedding,
      position_embedding}, pre_layrnorm, encoder.layers.N.{layer_norm1, self_attn.{q,k,v,out}_proj,
      layer_norm2, mlp.fc1, mlp.fc2}, post_layernorm, visual_projection;
  transformers SiglipVisionModel  the same encoder names, post_layernorm, head.{probe, attention.in_proj_*,
      attention.out_proj, layernorm, mlp}; SiglipForImageClassification adds ``classifier`` (mean pooling);
  transformers Dinov2Model  embeddings.{cls_token, mask_token (unused at inference, dropped),
      position_embeddings, patch_embeddings.projection}, encoder.layer.N.{norm1, attention.attention.
      {query,key,value} | attention.{q,k,v}_proj (transformers >= 5.2x), attention.output.dense |
      attention.o_proj, layer_scale1.lambda1, norm2, mlp.{fc1,fc2 | weights_in,weights_out |
      gate_proj,up_proj,down_proj (packed into fc1 = [gate | up])}, layer_scale2.lambda1}, layernorm;
  open_clip VisionTransformer  conv1, class_embedding, positional_embedding, ln_pre, transformer.resblocks.N.
      {ln_1, attn.in_proj_*, attn.out_proj, ls_1.gamma, ln_2, mlp.c_fc, mlp.c_proj, ls_2.gamma}, ln_post,
      proj (D, out), applied as ``x @ proj`` = a bias-free head with weight proj^T.
"""
from __future__ import annotations

import re
from typing import Mapping

import torch
import torch.nn as nn

from ..adapters import encoder_layer_problems, patchify_problem
from ..layers.common import to_2tuple
from ..presets import mlp_ratio_for

FAMILY_DEFAULTS = dict(pre_norm=False, act="gelu", mlp_layer="mlp", head_bias=True, distilled=False)
ACTS = ("gelu", "gelu_tanh", "quick_gelu")
MLP_LAYERS = ("mlp", "swiglu_packed", "swiglu")


def _qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# ----------------------------------------------------------------------------------------------- timm
def timm_act(act_module: nn.Module) -> str:
    """'gelu' | 'gelu_tanh' | 'quick_gelu' for a timm MLP activation module, else ValueError."""
    name = type(act_module).__name__
    if isinstance(act_module, nn.GELU):
        return "gelu_tanh" if act_module.approximate == "tanh" else "gelu"
    if name == "QuickGELU":
        return "quick_gelu"
    if name == "GELUTanh":
        return "gelu_tanh"
    if name == "GELU":  # timm.layers.GELU (exact)
        return "gelu"
    raise ValueError(f"unsupported MLP activation {name}; expected GELU, GELU(tanh) or QuickGELU")


def timm_mlp_layer(mlp: nn.Module) -> str:
    name = type(mlp).__name__
    if name == "Mlp":
        return "mlp"
    if name == "GluMlp":
        if not isinstance(mlp.act, nn.SiLU) or mlp.gate_last:
            raise ValueError("GluMlp: only SwiGLUPacked (SiLU gate, gate_last=False) is supported")
        return "swiglu_packed"
    if name == "SwiGLU":
        if not isinstance(mlp.act, nn.SiLU):
            raise ValueError("SwiGLU: only a SiLU gate is supported")
        return "swiglu"
    raise ValueError(f"unsupported MLP {name}; expected Mlp, SwiGLUPacked (GluMlp) or SwiGLU")


def _layer_scale_init(ls: nn.Module):
    """LayerScale's init value (None without LayerScale): the module's record, else gamma's first entry."""
    if not hasattr(ls, "gamma"):
        return None
    if getattr(ls, "init_values", None) is not None or ls.gamma.is_meta:
        return getattr(ls, "init_values", None)
    return float(ls.gamma.detach().flatten()[0])


def _head_classes(m: nn.Module) -> int:
    """The classes the head computes: a head replaced by hand (``model.head = nn.Linear(D, 10)``, or an Identity)
    leaves timm's ``num_classes`` as it was; ``reset_classifier`` keeps both in step."""
    if isinstance(m.head, nn.Linear):
        return m.head.out_features
    return 0 if isinstance(m.head, nn.Identity) else m.num_classes


def dropout_p(module: nn.Module) -> float:
    """The rate a timm dropout slot is set to: an ``nn.Dropout``'s p, 0 for an ``nn.Identity`` put in its place (a
    model whose dropout was stripped by hand: ``model.head_drop = nn.Identity()``)."""
    return 0.0 if isinstance(module, nn.Identity) else float(module.p)


def timm_config(m: nn.Module) -> dict:
    """Every hyper-parameter of a timm VisionTransformer / VisionTransformerDistilled as ViTConfig fields,
    the family fields included. Raises ValueError naming what does not fit."""
    blk = m.blocks[0] if len(m.blocks) else None
    pool = m.global_pool
    if pool == "map" and (m.attn_pool.latent_len != 1 or m.attn_pool.pos_embed is not None
                          or m.attn_pool.pool != "token" or not isinstance(m.attn_pool.q_norm, nn.Identity)):
        raise ValueError("attention pooling: only latent_len=1, no pos_embed, pool 'token', no qk_norm")
    cfg = dict(
        img_size=tuple(m.patch_embed.img_size), patch_size=tuple(m.patch_embed.patch_size),
        in_chans=m.patch_embed.proj.in_channels, num_classes=_head_classes(m), global_pool=pool,
        embed_dim=m.embed_dim, depth=len(m.blocks), class_token=m.cls_token is not None,
        reg_tokens=getattr(m, "num_reg_tokens", 0), no_embed_class=m.no_embed_class,
        pos_embed="none" if m.pos_embed is None else "learn",
        fc_norm=not isinstance(m.fc_norm, nn.Identity),
        final_norm=not (isinstance(m.norm, nn.Identity) and isinstance(m.fc_norm, nn.Identity)),
        dynamic_img_size=m.dynamic_img_size, drop_rate=dropout_p(m.head_drop), pos_drop_rate=dropout_p(m.pos_drop),
        pre_norm=not isinstance(m.norm_pre, nn.Identity),
        distilled=type(m).__name__ == "VisionTransformerDistilled",
        head_bias=not isinstance(m.head, nn.Linear) or m.head.bias is not None,
    )
    if (m.patch_embed.proj.bias is None) != cfg["pre_norm"]:
        raise ValueError("patch embedding bias: vit_fast has one exactly when there is no pre_norm (timm's rule)")
    norms = [mod for mod in m.modules() if isinstance(mod, nn.LayerNorm)]
    if norms:
        cfg["norm_eps"] = norms[0].eps
    if blk is not None:
        mlp_layer = timm_mlp_layer(blk.mlp)
        fc1_width = blk.mlp.fc1_g.out_features if mlp_layer == "swiglu" else blk.mlp.fc1.out_features
        cfg.update(
            num_heads=blk.attn.num_heads, mlp_ratio=mlp_ratio_for(fc1_width, m.embed_dim), mlp_layer=mlp_layer,
            qkv_bias=blk.attn.qkv.bias is not None, qk_norm=not isinstance(blk.attn.q_norm, nn.Identity),
            init_values=_layer_scale_init(blk.ls1),
            proj_drop_rate=dropout_p(blk.attn.proj_drop), attn_drop_rate=dropout_p(blk.attn.attn_drop),
            drop_path_rate=float(getattr(m.blocks[-1].drop_path1, "drop_prob", 0.0)),
            act="gelu" if mlp_layer != "mlp" else timm_act(blk.mlp.act),
        )
        for i, other in enumerate(m.blocks):  # one config for every block: a block changed by hand differs
            other_layer = timm_mlp_layer(other.mlp)
            other_act = "gelu" if other_layer != "mlp" else timm_act(other.mlp.act)
            if (other_layer, other_act, other.attn.num_heads) != (mlp_layer, cfg["act"], cfg["num_heads"]):
                raise ValueError(f"blocks.{i}: MLP {other_layer}, activation {other_act}, {other.attn.num_heads} "
                                 f"heads where blocks.0 has {mlp_layer}, {cfg['act']}, {cfg['num_heads']}: vit_fast "
                                 "builds every block alike")
    elif pool == "map":
        cfg["num_heads"] = m.attn_pool.num_heads
    else:  # no block and no attention pool: nothing reads the head count (ViTConfig's default need not divide D)
        cfg["num_heads"] = 1
    if pool == "map" and blk is None:
        cfg["act"] = timm_act(m.attn_pool.mlp.act)
    if pool == "map":
        built = cfg["act"] if cfg.get("mlp_layer", "mlp") == "mlp" else "gelu"  # what vit_fast's pool MLP runs
        try:
            pool_act = timm_act(m.attn_pool.mlp.act)
        except ValueError:
            pool_act = type(m.attn_pool.mlp.act).__name__
        if pool_act != built:
            raise ValueError(f"attention pooling: its MLP's activation {pool_act} (the model's act_layer) differs "
                             f"from the {built} vit_fast's pool MLP runs with these blocks")
    return cfg


def timm_kwargs(cfg: Mapping) -> dict:
    """The inverse of ``timm_config``: keyword arguments of timm's VisionTransformer for a config (tests
    build the timm reference model of a family from it)."""
    from functools import partial

    from timm.layers import SwiGLU, SwiGLUPacked

    c = {**FAMILY_DEFAULTS, **cfg}
    act = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}[c.get("act", "gelu")]
    kwargs = {k: c[k] for k in ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim",
                                "depth", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "init_values",
                                "class_token", "reg_tokens", "no_embed_class", "fc_norm", "final_norm",
                                "dynamic_img_size", "drop_rate", "pos_drop_rate", "proj_drop_rate",
                                "attn_drop_rate", "drop_path_rate", "pre_norm") if k in c}
    kwargs["norm_layer"] = partial(nn.LayerNorm, eps=c.get("norm_eps", 1e-6))
    if c["mlp_layer"] != "mlp" and c.get("global_pool") == "map":
        raise ValueError("timm_kwargs: SwiGLU blocks with global_pool='map' have no timm equivalent (timm's pool MLP "
                         "runs the model's act_layer, SiLU; vit_fast's runs GELU)")
    if c["mlp_layer"] == "swiglu_packed":
        kwargs.update(mlp_layer=SwiGLUPacked, act_layer=nn.SiLU)
    elif c["mlp_layer"] == "swiglu":
        kwargs.update(mlp_layer=SwiGLU, act_layer=nn.SiLU)
    else:
        kwargs["act_layer"] = act
    if c.get("pos_embed", "learn") == "none":
        kwargs["pos_embed"] = "none"
    return kwargs


# --------------------------------------------------------------------------------------- transformers
def _check_all_mapped(source: str, unmapped: list[str]) -> None:
    if unmapped:
        raise ValueError(f"{source}: state dict keys with no vit_fast counterpart: {sorted(unmapped)}")


def _encoder_layer_key(rest: str) -> str | None:
    """CLIP / SigLIP encoder layer suffix -> timm block suffix (q/k/v handled by the caller)."""
    table = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    m = re.match(r"(.+)\.(weight|bias)$", rest)
    if m and m.group(1) in table:
        return f"{table[m.group(1)]}.{m.group(2)}"
    return None


def _pack_qkv(out: dict, parts: dict) -> None:
    """{(block, 'weight'|'bias'): {'q': t, 'k': t, 'v': t}} -> blocks.N.attn.qkv.* = cat(q, k, v)."""
    for (block, kind), qkv in parts.items():
        if set(qkv) != {"q", "k", "v"}:
            raise ValueError(f"block {block}: attention {kind} needs q, k and v, got {sorted(qkv)}")
        out[f"blocks.{block}.attn.qkv.{kind}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]], dim=0)


def hf_clip_siglip_to_timm(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers CLIPVisionModel / CLIPVisionModelWithProjection / SiglipVisionModel /
    SiglipForImageClassification state dict -> timm names."""
    out, parts, unmapped = {}, {}, []
    for key, v in sd.items():
        k = key.removeprefix("vision_model.")
        if m := re.match(r"encoder\.layers\.(\d+)\.(.+)$", k):
            block, rest = int(m.group(1)), m.group(2)
            if qm := re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rest):
                parts.setdefault((block, qm.group(2)), {})[qm.group(1)] = v
            elif (name := _encoder_layer_key(rest)) is not None:
                out[f"blocks.{block}.{name}"] = v
            else:
                unmapped.append(key)
        elif k == "embeddings.class_embedding":
            out["cls_token"] = v.reshape(1, 1, -1)
        elif k == "embeddings.position_embedding.weight":
            out["pos_embed"] = v.unsqueeze(0)
        elif k.startswith("embeddings.patch_embedding."):
            out["patch_embed.proj." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("pre_layrnorm."):
            out["norm_pre." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("post_layernorm."):
            out["norm." + k.rsplit(".", 1)[1]] = v
        elif k == "visual_projection.weight":
            out["head.weight"] = v
        elif k.startswith("classifier."):
            out["head." + k.rsplit(".", 1)[1]] = v
        elif k == "head.probe":
            out["attn_pool.latent"] = v
        elif k in ("head.attention.in_proj_weight", "head.attention.in_proj_bias"):
            kind = "weight" if k.endswith("weight") else "bias"
            d = v.shape[0] // 3
            out[f"attn_pool.q.{kind}"], out[f"attn_pool.kv.{kind}"] = v[:d], v[d:]
        elif m := re.match(r"head\.(attention\.out_proj|layernorm|mlp\.fc1|mlp\.fc2)\.(weight|bias)$", k):
            name = {"attention.out_proj": "proj", "layernorm": "norm"}.get(m.group(1), m.group(1))
            out[f"attn_pool.{name}.{m.group(2)}"] = v
        elif k == "embeddings.position_ids":
            continue  # a buffer (0..N-1), not a weight
        else:
            unmapped.append(key)
    _check_all_mapped("transformers CLIP/SigLIP", unmapped)
    _pack_qkv(out, parts)
    return out


def hf_dinov2_to_timm(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers Dinov2Model state dict -> timm names (mask_token is dropped: it is only used for masked
    image modelling inputs, which vit_fast refuses)."""
    out, parts, unmapped = {}, {}, []
    layer_table = {"norm1": "norm1", "norm2": "norm2", "attention.output.dense": "attn.proj",
                   "attention.o_proj": "attn.proj",
                   "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "mlp.weights_in": "mlp.fc1",
                   "mlp.weights_out": "mlp.fc2", "mlp.down_proj": "mlp.fc2"}
    glu = {}
    for key, v in sd.items():
        k = key.removeprefix("dinov2.")
        if m := re.match(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias|lambda1)$", k):
            block, name, kind = int(m.group(1)), m.group(2), m.group(3)
            if qm := re.match(r"attention\.(?:attention\.(query|key|value)|([qkv])_proj)$", name):
                parts.setdefault((block, kind), {})[(qm.group(1) or qm.group(2))[0]] = v
            elif name in ("mlp.gate_proj", "mlp.up_proj"):  # split SwiGLU: packed [gate | value] as weights_in
                glu.setdefault((block, kind), {})[name[4:-5]] = v
            elif kind == "lambda1" and name in ("layer_scale1", "layer_scale2"):
                out[f"blocks.{block}.ls{name[-1]}.gamma"] = v
            elif name in layer_table:
                out[f"blocks.{block}.{layer_table[name]}.{kind}"] = v
            else:
                unmapped.append(key)
        elif k == "embeddings.cls_token":
            out["cls_token"] = v
        elif k == "embeddings.position_embeddings":
            out["pos_embed"] = v
        elif k.startswith("embeddings.patch_embeddings.projection."):
            out["patch_embed.proj." + k.rsplit(".", 1)[1]] = v
        elif k.startswith("layernorm."):
            out["norm." + k.rsplit(".", 1)[1]] = v
        elif k == "embeddings.mask_token":
            continue
        else:
            unmapped.append(key)
    _check_all_mapped("transformers Dinov2", unmapped)
    _pack_qkv(out, parts)
    for (block, kind), halves in glu.items():
        if set(halves) != {"gate", "up"}:
            raise ValueError(f"block {block}: SwiGLU {kind} needs gate_proj and up_proj, got {sorted(halves)}")
        out[f"blocks.{block}.mlp.fc1.{kind}"] = torch.cat([halves["gate"], halves["up"]], dim=0)
    return out


def hf_act(name: str) -> str:
    """vit_fast's act for a transformers config's hidden_act (every family's)."""
    table = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if name not in table:
        raise ValueError(f"the transformers config's hidden_act {name!r} is not supported; expected one of "
                         f"{sorted(table)}")
    return table[name]


def hf_config(model: nn.Module) -> dict:
    """ViTConfig fields of a transformers CLIP / SigLIP / Dinov2 vision model, read from its config."""
    # an optimized model (vit_fast.interop.hf_families) is read as the transformers class it subclasses
    stock = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model))
    where, cls = f"{stock.__module__}.{stock.__qualname__}", stock.__name__
    known = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "SiglipVisionModel", "SiglipForImageClassification",
             "Dinov2Model")
    if not where.startswith("transformers.") or cls not in known:
        raise ValueError(f"expected a transformers CLIPVisionModel(WithProjection), SiglipVisionModel, "
                         f"SiglipForImageClassification or Dinov2Model, got {where}")
    c = getattr(model.config, "vision_config", model.config)
    base = dict(img_size=c.image_size, patch_size=c.patch_size, in_chans=c.num_channels, embed_dim=c.hidden_size,
                depth=c.num_hidden_layers, num_heads=c.num_attention_heads, norm_eps=c.layer_norm_eps,
                attn_drop_rate=getattr(c, "attention_dropout", getattr(c, "attention_probs_dropout_prob", 0.0)),
                weight_init="skip")
    if cls in ("CLIPVisionModel", "CLIPVisionModelWithProjection"):
        with_proj = cls == "CLIPVisionModelWithProjection"
        return dict(base, mlp_ratio=mlp_ratio_for(c.intermediate_size, c.hidden_size), act=hf_act(c.hidden_act),
                    pre_norm=True,
                    num_classes=model.config.projection_dim if with_proj else 0, head_bias=False)
    if cls in ("SiglipVisionModel", "SiglipForImageClassification"):
        classifier = cls == "SiglipForImageClassification"
        use_head = getattr(c, "vision_use_head", True) and not classifier
        return dict(base, mlp_ratio=mlp_ratio_for(c.intermediate_size, c.hidden_size), act=hf_act(c.hidden_act),
                    class_token=False, global_pool="map" if use_head else ("avg" if classifier else ""),
                    fc_norm=False, num_classes=model.config.num_labels if classifier else 0)
    if cls == "Dinov2Model":
        hidden = int(c.hidden_size * c.mlp_ratio)
        # transformers 5 drops (hidden_dropout_prob) after the embeddings only; its stochastic depth is the same in
        # every layer (the linked model's blocks take it: Dinov2Layout), timm's ramps from 0 over the blocks
        cfg = dict(base, init_values=c.layerscale_value, act=hf_act(c.hidden_act), num_classes=0,
                   qkv_bias=c.qkv_bias, pos_drop_rate=c.hidden_dropout_prob, drop_path_rate=c.drop_path_rate)
        if c.use_swiglu_ffn:
            hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
            # swiglu_packed gates with SiLU whatever act says
            cfg.update(mlp_layer="swiglu_packed", mlp_ratio=mlp_ratio_for(2 * hidden, c.hidden_size), act="gelu")
        else:
            cfg["mlp_ratio"] = mlp_ratio_for(hidden, c.hidden_size)
        return cfg
    raise ValueError(f"expected a transformers CLIPVisionModel(WithProjection), SiglipVisionModel, "
                     f"SiglipForImageClassification or Dinov2Model, got {where}")


def hf_to_timm(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under timm's names (see ``hf_config`` for the classes)."""
    sd = model.state_dict()
    if type(model).__name__ == "SiglipForImageClassification":  # its forward mean-pools: the map head is unused
        sd = {k: v for k, v in sd.items() if not k.startswith("vision_model.head.")}
    return hf_dinov2_to_timm(sd) if type(model).__name__ == "Dinov2Model" else hf_clip_siglip_to_timm(sd)


# -------------------------------------------------------------------------------------------- open_clip
def open_clip_to_timm(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip VisionTransformer (``model.visual``) state dict -> timm names; a whole CLIP model's
    ``visual.`` prefix is accepted, its text tower keys are not."""
    out, unmapped = {}, []
    layer_table = {"ln_1": "norm1", "ln_2": "norm2", "attn.out_proj": "attn.proj", "attn.in_proj": "attn.qkv",
                   "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2", "ls_1": "ls1", "ls_2": "ls2"}
    for key, v in sd.items():
        k = key.removeprefix("visual.")
        if m := re.match(r"transformer\.resblocks\.(\d+)\.(.+?)[._](weight|bias|gamma)$", k):
            name = layer_table.get(m.group(2))
            if name is None:
                unmapped.append(key)
            else:
                out[f"blocks.{m.group(1)}.{name}.{m.group(3)}"] = v
        elif k == "class_embedding":
            out["cls_token"] = v.reshape(1, 1, -1)
        elif k == "positional_embedding":
            out["pos_embed"] = v.unsqueeze(0)
        elif k in ("conv1.weight", "conv1.bias"):
            out["patch_embed.proj." + k.rsplit(".", 1)[1]] = v
        elif m := re.match(r"(ln_pre|ln_post)\.(weight|bias)$", k):
            out[("norm_pre." if m.group(1) == "ln_pre" else "norm.") + m.group(2)] = v
        elif k == "proj":
            out["head.weight"] = v.t()
        else:
            unmapped.append(key)
    _check_all_mapped("open_clip VisionTransformer", unmapped)
    return out


def open_clip_config(visual: nn.Module) -> dict:
    """ViTConfig fields of an open_clip VisionTransformer (the ``visual`` tower of a CLIP model)."""
    if _qualname(visual) != "open_clip.transformer.VisionTransformer":
        raise ValueError(f"expected an open_clip VisionTransformer (model.visual), got {_qualname(visual)}")
    problems = [name for name, bad in [
        ("attentional pooling", visual.attn_pool is not None),
        ("pool_type other than 'tok'", visual.pool_type != "tok"),
        ("final_ln_after_pool", visual.final_ln_after_pool),
        ("patch dropout", not isinstance(visual.patch_dropout, nn.Identity)),
        ("no ln_pre", isinstance(visual.ln_pre, nn.Identity)),
        ("output_tokens", visual.output_tokens),
    ] if bad]
    problem = patchify_problem(visual.conv1, to_2tuple(visual.patch_size))
    if problem:
        problems.append(f"conv1: {problem}")
    if getattr(visual.conv1, "bias", None) is not None:
        problems.append("conv1 with a bias (open_clip's patch projection has none)")
    blocks = visual.transformer.resblocks
    blk = blocks[0]
    batch_first = getattr(visual.transformer, "batch_first", True)
    final = () if isinstance(visual.ln_post, nn.Identity) else (visual.ln_post,)  # ln_pre: its own line above
    for block in blocks:  # every block, as the config is read from the first
        if type(block).__name__ != "ResidualAttentionBlock" or not isinstance(block.attn, nn.MultiheadAttention):
            problems.append(f"blocks of type {type(block).__name__} (custom attention)")
            continue
        problems += encoder_layer_problems(block.attn, (block.ln_1, block.ln_2, *final), batch_first)
    problems = list(dict.fromkeys(problems))  # each once, however many blocks have it
    act = getattr(blk.mlp, "gelu", None)
    try:  # torch's GELU (exact or tanh), open_clip's or timm's QuickGELU, timm's GELU and GELUTanh
        act_kind = timm_act(act)
    except ValueError:
        act_kind = None
    if act_kind is None or list(dict(blk.mlp.named_children())) != ["c_fc", "gelu", "c_proj"]:
        problems.append(f"MLP {list(dict(blk.mlp.named_children()))} with activation {type(act).__name__}")
    if problems:
        raise ValueError(f"open_clip VisionTransformer uses features vit_fast does not implement: {problems}")
    width = visual.conv1.out_channels
    gamma = getattr(blk.ls_1, "gamma", None)
    return dict(
        img_size=visual.image_size, patch_size=visual.patch_size, in_chans=visual.conv1.in_channels,
        embed_dim=width, depth=len(blocks), num_heads=blk.attn.num_heads,
        mlp_ratio=mlp_ratio_for(blk.mlp.c_fc.out_features, width), norm_eps=blk.ln_1.eps,
        act=act_kind, init_values=None if gamma is None else 1e-5, pre_norm=True,
        final_norm=not isinstance(visual.ln_post, nn.Identity),  # prune_intermediate_layers(prune_norm=True)
        num_classes=0 if visual.proj is None else visual.proj.shape[1], head_bias=False, weight_init="skip",
        attn_drop_rate=blk.attn.dropout,
    )
