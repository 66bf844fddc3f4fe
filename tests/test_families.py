"""The fine-tuning families (vit_fast/interop/families.py, layers/mlp.py and attention_pool.py, family_presets.py):
presets against timm on the meta device; the transformers and open_clip key mappings and config extraction checked
by loading the mapped weights into timm's model of that config and comparing outputs and every parameter gradient
with the source (random weights, tiny configs); the family layers against timm's modules on both backends (kernels
in the interpreter without a GPU)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import vit_fast
from tests.numerics import assert_close
from vit_fast.family_presets import FAMILY_PRESETS
from vit_fast.interop import families
from vit_fast.layers import AttentionPoolLatent, SwiGLUMlp, SwiGLUPackedMlp, quick_gelu, quick_gelu_grad

timm = pytest.importorskip("timm")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32 = 1e-5  # fp32 with dots, same math in a different order


def _to2(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


# ------------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_family_preset_matches_timm(name):
    """Every family preset has the hyper-parameters of timm's model of that name (read from the model,
    built on meta), widths compared as the integers the layers get (So400m MLP 4304, DINOv2-g fc1 8192)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = timm.create_model(name)
    got = families.timm_config(ref)
    preset = {**families.FAMILY_DEFAULTS, "num_classes": 1000, "global_pool": "token", "class_token": True,
              "init_values": None, "norm_eps": 1e-6, **FAMILY_PRESETS[name]}
    for key, value in preset.items():
        if key == "mlp_ratio":
            assert int(preset["embed_dim"] * value) == int(got["embed_dim"] * got["mlp_ratio"]), key
        elif key in ("img_size", "patch_size"):
            assert _to2(value) == got[key], key
        else:
            assert got[key] == value, f"{name}: {key} preset {value!r} vs timm {got[key]!r}"
    assert got["act"] in families.ACTS and got["mlp_layer"] in families.MLP_LAYERS


def test_so400m_head_dim_is_72():
    p = FAMILY_PRESETS["vit_so400m_patch14_siglip_224"]
    assert p["embed_dim"] // p["num_heads"] == 72 and int(p["embed_dim"] * p["mlp_ratio"]) == 4304


# ----------------------------------------------------------------------------------- mapping helpers
def _timm_reference(cfg: dict, sd: dict) -> nn.Module:
    """timm's VisionTransformer of ``cfg`` holding the mapped weights (a bias-free projection head gets a
    zero bias, as timm's own open_clip converter does)."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**families.timm_kwargs(cfg))
    sd = dict(sd)
    if not cfg.get("head_bias", True) and "head.weight" in sd:
        sd["head.bias"] = torch.zeros(sd["head.weight"].shape[0])
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _check_grads(source: nn.Module, reference: nn.Module, to_timm) -> None:
    """Every source parameter's gradient, mapped like its weight, equals the timm reference's."""
    grads = {k: p.grad for k, p in source.named_parameters() if p.grad is not None}
    unused = [k for k, p in source.named_parameters() if p.grad is None]
    # only SiglipForImageClassification's unused map head and Dinov2's masked-modelling token get none
    assert all(".head." in k or k.endswith("mask_token") for k in unused), unused
    mapped = to_timm(grads)
    ref = dict(reference.named_parameters())
    assert mapped, "no gradients mapped"
    for k, g in mapped.items():
        assert_close(ref[k].grad, g, FP32, f"grad {k}")


def _images(cfg):
    torch.manual_seed(0)
    h, w = _to2(cfg["img_size"])
    return torch.randn(2, cfg.get("in_chans", 3), h, w)


# ------------------------------------------------------------------------------------------- transformers
def _hf_models():
    transformers = pytest.importorskip("transformers")
    tiny = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                patch_size=8)
    clip = transformers.CLIPVisionConfig(**tiny, projection_dim=24)
    siglip = transformers.SiglipVisionConfig(**tiny)
    dino = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
    return {
        "clip": lambda: transformers.CLIPVisionModel(clip),
        "clip_projection": lambda: transformers.CLIPVisionModelWithProjection(clip),
        "siglip": lambda: transformers.SiglipVisionModel(siglip),
        "siglip_classifier": lambda: transformers.SiglipForImageClassification(
            transformers.SiglipConfig(vision_config=siglip.to_dict(), num_labels=5)),
        "dinov2": lambda: transformers.Dinov2Model(transformers.Dinov2Config(**dino, layerscale_value=0.5)),
        "dinov2_swiglu": lambda: transformers.Dinov2Model(transformers.Dinov2Config(**dino, use_swiglu_ffn=True,
                                                                                      layerscale_value=0.5)),
    }


@pytest.mark.parametrize("name", ["clip", "clip_projection", "siglip", "siglip_classifier", "dinov2", "vit"])
def test_hf_outputs_under_autocast_have_transformers_dtypes(name):
    """Under autocast every output tensor has transformers' dtype: a LayerNorm's output (last_hidden_state, CLIP's
    and DINOv2's pooler_output) is fp32, where the fused final join wrote bf16 (a loss against fp32 targets outside
    autocast failed on it); the values within bf16 of transformers'."""
    import vit_fast

    transformers = pytest.importorskip("transformers")
    build = _hf_models().get(name) or (lambda: transformers.ViTModel(transformers.ViTConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8)))
    torch.manual_seed(0)
    source = _perturbed(build()).eval()
    ours = vit_fast.optimize(copy.deepcopy(source), backend="triton")
    x = _images({"img_size": 32})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = source(pixel_values=x), ours(pixel_values=x)
    fields = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
    assert fields and fields == [k for k, v in got.items() if isinstance(v, torch.Tensor)]
    for field in fields:
        assert got[field].dtype == expected[field].dtype, field
        assert_close(got[field].float(), expected[field].float(), 3e-2, field)


def _hf_output(model, x):
    out = model(pixel_values=x)
    for field in ("image_embeds", "logits", "pooler_output"):
        if getattr(out, field, None) is not None:
            return getattr(out, field)
    raise AssertionError(f"no pooled output in {type(out).__name__}")


@pytest.mark.parametrize("kind", ["clip", "clip_projection", "siglip", "siglip_classifier", "dinov2",
                                  "dinov2_swiglu"])
def test_hf_mapping_matches_source(kind):
    """transformers model -> (config, timm-named state dict) -> timm's model: the same pooled output /
    projection / logits and the same gradient for every source parameter."""
    torch.manual_seed(0)
    source = _hf_models()[kind]().eval()
    with torch.no_grad():  # fresh non-trivial LayerNorm affine and biases (HF inits them to 1 / 0)
        for name, p in source.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    cfg = families.hf_config(source)
    reference = _timm_reference(cfg, families.hf_to_timm(source))
    x = _images(cfg)
    out = _hf_output(source, x)
    ref = reference(x)
    assert_close(ref, out, FP32, "output")
    (out.square().sum()).backward()
    ref.square().sum().backward()
    to_timm = families.hf_dinov2_to_timm if kind.startswith("dinov2") else families.hf_clip_siglip_to_timm
    _check_grads(source, reference, to_timm)


def test_hf_mapping_refuses_unknown_keys_and_classes():
    with pytest.raises(ValueError, match="no vit_fast counterpart.*vision_model.encoder.layers.0.extra.weight"):
        families.hf_clip_siglip_to_timm({"vision_model.encoder.layers.0.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="needs q, k and v"):
        families.hf_clip_siglip_to_timm({"vision_model.encoder.layers.0.self_attn.q_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="expected a transformers CLIPVisionModel"):
        families.hf_config(nn.Linear(2, 2))


# -------------------------------------------------------------------------------------------- open_clip
@pytest.mark.parametrize("quick", [True, False])
def test_open_clip_mapping_matches_source(quick):
    """open_clip VisionTransformer (QuickGELU or GELU, LayerScale) -> timm names: same embedding (x @ proj after
    ln_post on the class token) and the same gradient for every parameter, proj included."""
    oc = pytest.importorskip("open_clip.transformer")
    QuickGELU = oc.QuickGELU
    torch.manual_seed(0)
    visual = oc.VisionTransformer(image_size=32, patch_size=8, width=64, layers=2, heads=4, mlp_ratio=4.0,
                                  ls_init_value=0.3 if quick else None, output_dim=24,
                                  act_layer=QuickGELU if quick else nn.GELU).eval()
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    cfg = families.open_clip_config(visual)
    assert cfg["act"] == ("quick_gelu" if quick else "gelu") and cfg["num_classes"] == 24
    reference = _timm_reference(cfg, families.open_clip_to_timm(visual.state_dict()))
    x = _images(cfg)
    out, ref = visual(x), reference(x)
    assert_close(ref, out, FP32, "embedding")
    out.square().sum().backward()
    ref.square().sum().backward()
    _check_grads(visual, reference, families.open_clip_to_timm)


def test_open_clip_refuses_what_it_cannot_map():
    oc = pytest.importorskip("open_clip.transformer")
    visual = oc.VisionTransformer(image_size=32, patch_size=8, width=64, layers=1, heads=4, mlp_ratio=4.0,
                                  pool_type="avg", output_dim=8)
    with pytest.raises(ValueError, match="pool_type other than 'tok'"):
        families.open_clip_config(visual)
    padded = oc.VisionTransformer(image_size=32, patch_size=8, width=64, layers=1, heads=4, mlp_ratio=4.0,
                                  output_dim=8)
    padded.conv1 = nn.Conv2d(3, 64, 8, 8, padding=1, bias=False)  # rebuilt without its padding, 0.17 off
    with pytest.raises(ValueError, match=r"conv1: a patch convolution other than kernel = stride = \(8, 8\)"):
        families.open_clip_config(padded)
    # every block is read, not only the first: what the conversion would drop (0.11 off with add_zero_attn) or
    # misread (norm_eps None from an RMSNorm, a CheckpointError for a bias-free attention) is refused by name
    edits = {
        "norm layer RMSNorm": lambda v: setattr(v.transformer.resblocks[1], "ln_2", nn.RMSNorm(64)),
        "attention without biases": lambda v: setattr(v.transformer.resblocks[1], "attn",
                                                      nn.MultiheadAttention(64, 4, bias=False, batch_first=True)),
        "add_zero_attn": lambda v: setattr(v.transformer.resblocks[1].attn, "add_zero_attn", True),
        "batch_first=False in a transformer with batch_first=True": lambda v: setattr(
            v.transformer.resblocks[0].attn, "batch_first", False),
        "conv1 with a bias": lambda v: setattr(v, "conv1", nn.Conv2d(3, 64, 8, 8)),
    }
    for problem, edit in edits.items():
        edited = oc.VisionTransformer(image_size=32, patch_size=8, width=64, layers=2, heads=4, mlp_ratio=4.0,
                                      output_dim=8)
        families.open_clip_config(edited)
        edit(edited)
        with pytest.raises(ValueError, match=problem):
            families.open_clip_config(edited)
    with pytest.raises(ValueError, match="expected an open_clip VisionTransformer"):
        families.open_clip_config(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="from_open_clip: expected an open_clip model or its .visual, got a state"):
        vit_fast.from_open_clip(visual.state_dict())
    with pytest.raises(ValueError, match="no vit_fast counterpart.*text_projection"):
        families.open_clip_to_timm({"text_projection": torch.zeros(1)})


# --------------------------------------------------------------------------------------- family layers
def test_quick_gelu_matches_timm_and_float64_derivative():
    from timm.layers.activations import quick_gelu as timm_quick_gelu

    x = torch.randn(1000, dtype=torch.float64) * 4
    assert torch.equal(quick_gelu(x), timm_quick_gelu(x))
    xg = x.clone().requires_grad_()
    quick_gelu(xg).sum().backward()
    assert_close(quick_gelu_grad(x), xg.grad, 1e-12, "QuickGELU'")


def _load_from(ours: nn.Module, theirs: nn.Module) -> None:
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours.load_state_dict(theirs.state_dict(), strict=True)


def _compare_module(ours, theirs, x, backend):
    ours.backend = backend
    for m in ours.modules():
        if hasattr(m, "backend"):
            m.backend = backend
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = ours(xo), theirs(xt)
    assert_close(out, ref, FP32, "output")
    out.square().sum().backward()
    ref.square().sum().backward()
    assert_close(xo.grad, xt.grad, FP32, "input grad")
    theirs_params = dict(theirs.named_parameters())
    for k, p in ours.named_parameters():
        assert_close(p.grad, theirs_params[k].grad, FP32, f"grad {k}")
    return {k for k, _ in ours.named_parameters()}, set(theirs_params)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("packed", [True, False])
def test_swiglu_mlp_matches_timm(backend, packed):
    from timm.layers import SwiGLU, SwiGLUPacked

    torch.manual_seed(0)
    if packed:
        ours, theirs = SwiGLUPackedMlp(48, 2 * 40), SwiGLUPacked(48, 2 * 40)
    else:
        ours, theirs = SwiGLUMlp(48, 40), SwiGLU(48, 40)
    _load_from(ours, theirs)
    compared, theirs_names = _compare_module(ours.to(DEVICE), theirs.to(DEVICE), torch.randn(2, 9, 48, device=DEVICE),
                                             backend)
    assert compared == theirs_names  # every parameter's gradient compared, under timm's names


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_pool_matches_timm(backend):
    """timm's AttentionPoolLatent (SigLIP 'map' head), head_dim 24, same names and state dict; output and
    every gradient on both backends (the LayerNorm and MLP run vit_fast's kernels on the fused path)."""
    from timm.layers import AttentionPoolLatent as TimmPool

    torch.manual_seed(0)
    ours = AttentionPoolLatent(48, num_heads=2, mlp_ratio=3.0, norm_eps=1e-6)
    theirs = TimmPool(48, num_heads=2, mlp_ratio=3.0, norm_layer=nn.LayerNorm)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    _load_from(ours, theirs)
    _compare_module(ours.to(DEVICE), theirs.to(DEVICE), torch.randn(3, 11, 48, device=DEVICE), backend)


# ------------------------------------------------------------------------------ families through vit_fast
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4)
FAMILIES = {
    "clip_quickgelu": dict(pre_norm=True, norm_eps=1e-5, act="quick_gelu", num_classes=10),
    "clip_gelu": dict(pre_norm=True, norm_eps=1e-5, num_classes=10),
    "siglip_map": dict(class_token=False, global_pool="map", act="gelu_tanh", num_classes=0),
    "dinov2": dict(init_values=0.3, num_classes=5),
    "dinov2_giant_swiglu": dict(init_values=0.3, mlp_layer="swiglu_packed", mlp_ratio=2.5, num_classes=5),
    "swiglu_split": dict(mlp_layer="swiglu", mlp_ratio=1.5, num_classes=5),
    "deit_distilled": dict(distilled=True, num_classes=7),
    # SigLIP So400m's head shape: 2 heads of 72 (a non-power-of-two head_dim), MLP ratio 4304/1152
    "so400m_head_dim_72": dict(embed_dim=144, num_heads=2, mlp_ratio=3.7362, class_token=False, global_pool="map",
                               num_classes=0),
}


def timm_family(kind: str, seed: int = 0, **extra) -> nn.Module:
    """timm's model of a tiny family config, weights perturbed (non-zero biases, LayerNorm affine, tokens)."""
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import VisionTransformer

    cfg = {**TINY, **FAMILIES[kind], **extra}
    cls = VisionTransformerDistilled if cfg.pop("distilled", False) else VisionTransformer
    torch.manual_seed(seed)
    ref = cls(**families.timm_kwargs(cfg))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref


def _grads_match(fast: nn.Module, ref: nn.Module, rtol: float) -> None:
    ours = dict(fast.named_parameters())
    assert set(ours) == {k for k, _ in ref.named_parameters()}
    for k, p in ref.named_parameters():
        assert p.grad is not None and ours[k].grad is not None, k
        assert_close(ours[k].grad, p.grad, rtol, f"grad {k}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_timm_family_through_optimize(kind, backend):
    """optimize(timm model) for every family: same output and every parameter's gradient, both backends
    (the fused path on the interpreter's kernels: pre_norm, QuickGELU, attention pool, SwiGLU, dist token); the
    parameters and state-dict keys in timm's order (optimizers keep their state by position: a DeiT's dist_token
    came before pos_embed, and a resumed timm optimizer state broke at the first step)."""
    import vit_fast

    ref = timm_family(kind).eval()
    fast = vit_fast.optimize(ref, backend=backend)
    assert type(fast).__name__ == "VisionTransformer" and fast.config.backend == backend
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(fast.state_dict()) == list(ref.state_dict())
    x = _images(TINY)
    out, expected = fast(x), ref(x)
    assert_close(out, expected, FP32, "output")
    out.square().sum().backward()
    expected.square().sum().backward()
    _grads_match(fast, ref, FP32)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_timm_family_from_state_dict(kind):
    """from_timm(state_dict) builds each family as timm's model was built: attn_pool keys give global_pool='map',
    norm_pre pre_norm (no patch bias), dist_token a DeiT distilled model, fc1_g / an fc1 twice fc2's width the
    SwiGLU MLPs. Only what no key records is passed (head count, activation, eps); these were refused for
    unexpected keys (DeiT also for pos_embed's 18 rows read as a 224 px grid)."""
    from vit_fast import from_timm

    ref = timm_family(kind).eval()
    cfg = {**TINY, **FAMILIES[kind]}
    unrecorded = {k: cfg[k] for k in ("num_heads", "act", "norm_eps") if k in cfg}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = from_timm(ref.state_dict(), backend="torch", **unrecorded).eval()
    exact = from_timm(ref, backend="torch").config
    for field in ("img_size", "global_pool", "pre_norm", "distilled", "mlp_layer", "mlp_ratio", "head_bias",
                  "class_token", "use_fc_norm", "final_norm", "norm_eps", "act"):
        assert getattr(ours.config, field) == getattr(exact, field), field
    settled = cfg.get("global_pool") == "map" or cfg.get("distilled")  # the keys tell the pooling
    assert ("global_pool=" in str(caught[0].message)) != bool(settled), caught[0].message
    x = _images(TINY)
    with torch.no_grad():
        assert_close(ours(x), ref(x), FP32, "output")


def test_distilled_train_and_eval_semantics():
    """timm's VisionTransformerDistilled: eval averages the two heads; training returns (head, head_dist) only
    with distilled training on; pre_logits averages the two tokens."""
    import vit_fast

    ref = timm_family("deit_distilled")
    fast = vit_fast.optimize(ref.eval(), backend="triton")
    x = _images(TINY)
    assert_close(fast(x), ref(x), FP32, "eval logits")
    fast.train(), ref.train()
    assert_close(fast(x), ref(x), FP32, "training logits, distilled training off")
    ref.set_distilled_training(True)
    fast.set_distilled_training(True)
    (a, b), (ra, rb) = fast(x), ref(x)
    assert_close(a, ra, FP32, "head")
    assert_close(b, rb, FP32, "head_dist")
    assert_close(fast.forward_head(fast.forward_features(x), pre_logits=True),
                 ref.forward_head(ref.forward_features(x), pre_logits=True), FP32, "pre_logits")
    ref.eval(), fast.eval()
    assert_close(fast(x), ref(x), FP32, "eval logits with distilled training on")
    fast.reset_classifier(3)
    assert fast.head.out_features == fast.head_dist.out_features == 3
    with pytest.raises(ValueError, match="must stay 'token'"):
        fast.reset_classifier(3, "avg")


def test_head_protocol_of_distilled_and_attention_pool_models_as_timm():
    """timm's head methods on the families with their own heads: a DeiT's reset_classifier(0, '') and
    prune_intermediate_layers (which calls it) keep its 'token' pooling, as timm's VisionTransformerDistilled, and
    work; an attention-pool model's pool(x, pool_type) runs its attention pool whatever pool_type asks, as
    timm's pool."""
    import vit_fast

    x = _images(TINY)
    ref = timm_family("deit_distilled").eval()
    fast = vit_fast.optimize(ref, backend="torch")
    assert fast.prune_intermediate_layers([0]) == ref.prune_intermediate_layers([0]) == [0]
    assert fast.global_pool == ref.global_pool == "token"
    assert isinstance(fast.head, nn.Identity) and isinstance(fast.head_dist, nn.Identity)
    assert_close(fast(x), ref(x), FP32, "pruned DeiT features")
    assert_close(fast.forward_intermediates(x, indices=1)[1][0], ref.forward_intermediates(x, indices=1)[1][0], FP32,
                 "pruned DeiT intermediates")

    ref = timm_family("siglip_map").eval()
    fast = vit_fast.optimize(ref, backend="torch")
    tokens = ref.forward_features(x)
    for pool_type in (None, "map", "avg", "token", "max", "avgmax", ""):
        assert_close(fast.pool(tokens, pool_type), ref.pool(tokens, pool_type), FP32, f"pool {pool_type!r}")


@pytest.mark.parametrize("kind", ["clip_quickgelu", "siglip_map", "dinov2_giant_swiglu"])
def test_family_bf16_autocast(kind):
    """Under bf16 autocast the fused model is within the bf16 bound of the float64 reference and at most 2x
    timm's own autocast error (the guide's rule)."""
    import vit_fast
    from tests.numerics import bound, errors

    ref = timm_family(kind).eval()
    fast = vit_fast.optimize(ref, backend="triton")
    x = _images(TINY)
    out64 = timm_family(kind).double().eval()(x.double()).detach()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        err, err_eager = errors(fast(x), out64)[0], errors(ref(x), out64)[0]
    assert err <= min(bound(torch.bfloat16, "dot"), 2 * err_eager + 1e-3), (err, err_eager)


def test_family_compiles_fullgraph():
    """One model with every family part (pre_norm, SwiGLU MLP, attention-pool head) under
    torch.compile(fullgraph=True) on the fused path: same loss and gradients as eager."""
    import vit_fast

    # vit_fast's own config: timm would run this pool's MLP with SiLU (timm_kwargs refuses it)
    torch.manual_seed(0)
    fast = vit_fast.VisionTransformer(vit_fast.ViTConfig(**{**TINY, **FAMILIES["siglip_map"], "act": "gelu"},
                                                         pre_norm=True, mlp_layer="swiglu_packed",
                                                         backend="triton")).eval()
    with pytest.raises(ValueError, match="no timm equivalent"):
        timm_family("siglip_map", pre_norm=True, mlp_layer="swiglu_packed")
    x = _images(TINY)
    compiled = torch.compile(lambda m, t: m(t).square().sum(), backend="aot_eager", fullgraph=True)
    compiled(fast, x).backward()
    grads = {k: p.grad.clone() for k, p in fast.named_parameters()}
    fast.zero_grad()
    fast(x).square().sum().backward()
    for k, p in fast.named_parameters():
        assert_close(grads[k], p.grad, FP32, f"compiled grad {k}")


def test_family_checkpoint_round_trip(tmp_path):
    """A family model saved under timm's names loads back (attn_pool.*, norm_pre.*, mlp.fc1 of 2F, dist_token)."""
    import vit_fast
    from vit_fast.interop.convert import load_checkpoint, save_checkpoint

    for kind in ("siglip_map", "clip_quickgelu", "dinov2_giant_swiglu", "deit_distilled"):
        fast = vit_fast.optimize(timm_family(kind).eval(), backend="torch")
        save_checkpoint(fast, tmp_path / f"{kind}.safetensors")
        again = vit_fast.VisionTransformer(fast.config.replace(weight_init="skip"))
        load_checkpoint(again, tmp_path / f"{kind}.safetensors")
        x = _images(TINY)
        assert torch.equal(again(x), fast(x))


# ------------------------------------------------------------------ transformers and open_clip sources
def _perturbed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["clip", "clip_projection", "siglip", "siglip_classifier", "dinov2",
                                  "dinov2_swiglu"])
def test_hf_family_through_optimize(kind, backend):
    """optimize(transformers model) keeps transformers' class (a same-name subclass), module tree and
    parameter names; the source's output type and fields (last_hidden_state, pooler_output, image_embeds,
    logits, loss) and every parameter's gradient, both backends; the linked vit_fast model owns nothing."""
    import vit_fast

    torch.manual_seed(0)
    source = _perturbed(_hf_models()[kind]()).eval()
    fast = vit_fast.optimize(source, backend=backend)
    assert type(fast).__name__ == type(source).__name__ and isinstance(fast, type(source))
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in source.named_parameters()]
    assert [n for n, _ in fast.named_modules()] == [n for n, _ in source.named_modules()]
    assert not list(fast.vit_fast_model.parameters())
    x = _images({"img_size": 32})
    labels = torch.tensor([1, 3]) if kind == "siglip_classifier" else None
    kwargs = {"labels": labels} if labels is not None else {}
    out, expected = fast(x, **kwargs), source(pixel_values=x, **kwargs)
    assert type(out) is type(expected)
    fields = [k for k, v in expected.items() if v is not None]
    assert fields == [k for k, v in out.items() if v is not None]
    for k in fields:
        assert_close(out[k], expected[k], FP32, k)
    loss, ref_loss = (sum(v.square().sum() for v in o.values() if v is not None and v.dim() > 0)
                      for o in (out, expected))
    loss.backward()
    ref_loss.backward()
    grads, ref_grads = (_qkv_bias_grads_joined(m) for m in (fast, source))
    assert grads.keys() == ref_grads.keys(), "gradients reach the same parameters"
    for name, g in grads.items():
        assert_close(g, ref_grads[name], FP32, f"grad {name}")
    assert not fast(x, return_dict=False)[0].isnan().any()
    with pytest.raises(ValueError, match="output_hidden_states"):
        fast(x, output_hidden_states=True)


@pytest.mark.parametrize("kind,backend", [("clip", "triton"), ("clip_projection", "torch"), ("siglip", "torch"),
                                          ("siglip_classifier", "triton"), ("dinov2", "triton")])
def test_hf_family_other_image_sizes_as_transformers(kind, backend):
    """Images of another size: resized position tables as transformers makes them (interpolate_pos_encoding=True
    for CLIP and SigLIP, always for DINOv2), the same outputs and gradients (the table's included); without the
    argument CLIP and SigLIP refuse, naming it; the model's own size changes nothing. A size that is not whole
    patches: transformers' convolution leaves the last pixels unread, and so does vit_fast."""
    import vit_fast

    torch.manual_seed(0)
    source = _perturbed(_hf_models()[kind]()).eval()
    fast = vit_fast.optimize(source, backend=backend)
    kwargs = {} if kind == "dinov2" else {"interpolate_pos_encoding": True}
    for size in [(48, 40), (24, 24), (32, 32), (53, 45)]:
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        out, expected = fast(x, **kwargs), source(pixel_values=x, **kwargs)
        for k in [k for k, v in expected.items() if v is not None]:
            assert_close(out[k], expected[k], FP32, f"{k} {size}")
        if size == (48, 40):
            for o in (out, expected):
                sum(v.square().sum() for v in o.values() if v is not None).backward()
            grads, ref_grads = (_qkv_bias_grads_joined(m) for m in (fast, source))
            assert grads.keys() == ref_grads.keys()
            assert any("position" in name for name in grads)
            for name, g in grads.items():
                assert_close(g, ref_grads[name], FP32, f"grad {name}")
    if kind != "dinov2":
        with pytest.raises(ValueError, match=r"\(48\*40\) doesn't match model \(32\*32\); pass interpolate_pos_enc"):
            fast(torch.randn(2, 3, 48, 40))


def test_hf_dropout_and_stochastic_depth_where_transformers_applies_them():
    """The linked model drops where the transformers source does, at its rates: ViT after the attention output, the
    MLP and the embeddings (not after the GELU, where timm's Mlp also drops); DINOv2 after the embeddings only, and
    the same stochastic depth in every layer (timm ramps it from 0: with one layer it would never drop)."""
    import transformers

    import vit_fast

    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=128, image_size=32, patch_size=8,
                                                       hidden_dropout_prob=0.2))
    linked = vit_fast.optimize(vit, backend="torch").vit_fast_model
    assert linked.pos_drop.p == 0.2
    assert [(b.attn.proj_drop.p, b.mlp.drop1.p, b.mlp.drop2.p) for b in linked.blocks] == [(0.2, 0.0, 0.2)] * 2
    dino = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    source = transformers.Dinov2Model(transformers.Dinov2Config(**dino, hidden_dropout_prob=0.2, drop_path_rate=0.5))
    fast = vit_fast.optimize(source, backend="torch").train()
    linked = fast.vit_fast_model
    assert linked.pos_drop.p == 0.2
    for block in linked.blocks:
        assert (block.attn.proj_drop.p, block.mlp.drop1.p, block.mlp.drop2.p) == (0.0, 0.0, 0.0)
        assert block.drop_path1.drop_prob == block.drop_path2.drop_prob == 0.5
    x = torch.randn(4, 3, 32, 32)
    outputs = []
    for seed in range(6):  # each image's branches kept or dropped: the outputs vary with the seed, as the source's
        torch.manual_seed(seed)
        outputs.append(fast(x).last_hidden_state)
    assert any(not torch.equal(outputs[0], o) for o in outputs[1:])
    source_eval, fast_eval = source.eval(), fast.eval()
    assert_close(fast_eval(x).last_hidden_state, source_eval(pixel_values=x).last_hidden_state, FP32, "eval")


def test_hf_family_takes_the_arguments_its_callers_pass():
    """What transformers' own callers hand these classes: the Trainer's num_items_in_batch (unused by their losses,
    as in transformers), a wrapping classifier's attention_mask=None (Dinov2ForImageClassification around an
    optimized backbone: the same logits and loss as the stock model); a real attention mask is refused."""
    import transformers

    import vit_fast

    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                                       patch_size=8, num_labels=3)
    stock = _perturbed(transformers.Dinov2ForImageClassification(config)).eval()
    with pytest.raises(ValueError, match=r"Its dinov2 is one: optimize that in place \(model.dinov2 = vit_fast"):
        vit_fast.optimize(stock)
    wrapped = copy.deepcopy(stock)
    wrapped.dinov2 = vit_fast.optimize(wrapped.dinov2, backend="torch")
    x, labels = _images({"img_size": 32}), torch.tensor([0, 2])
    out, want = wrapped(pixel_values=x, labels=labels), stock(pixel_values=x, labels=labels)
    assert_close(out.logits, want.logits, FP32, "logits")
    assert_close(out.loss, want.loss, FP32, "loss")
    siglip = vit_fast.optimize(_hf_models()["siglip_classifier"](), backend="torch")
    assert siglip(x, labels=labels, num_items_in_batch=torch.tensor(2)).loss.isfinite()
    with pytest.raises(ValueError, match=r"not supported: keyword arguments \['attention_mask'\]"):
        wrapped.dinov2(x, attention_mask=torch.ones(2, 17))


@pytest.mark.parametrize("kind", ["clip", "siglip_classifier", "dinov2"])
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_hf_family_refuses_the_outputs_its_config_asks_for(kind, flag):
    """Hidden states or attention maps asked for in the config (transformers reads an argument left as None from it:
    the source returns them) are refused as the argument is, naming the config; the argument False overrides it and
    gives the source's outputs."""
    import vit_fast

    torch.manual_seed(0)
    source = _perturbed(_hf_models()[kind]()).eval()
    config = getattr(source.config, "vision_config", source.config)  # the classifier's vision tower reads its own
    config._attn_implementation = "eager"  # transformers' SDPA attention does not return the maps
    setattr(config, flag, True)
    fast = vit_fast.optimize(source, backend="torch")
    x = _images({"img_size": 32})
    assert getattr(source(pixel_values=x), flag.removeprefix("output_")) is not None
    with pytest.raises(ValueError, match=rf"not supported: {flag} \(set in the config: pass {flag}=False"):
        fast(x)
    out, expected = fast(x, **{flag: False}), source(pixel_values=x, **{flag: False})
    for k, v in expected.items():
        assert_close(out[k], v, FP32, k)


def _qkv_bias_grads_joined(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient, a layer's q, k and v bias gradients joined as one: the key bias's own is
    zero up to rounding (softmax ignores a shift per query row), so only the joined one has a scale."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for name in [n for n in grads if n.endswith("k_proj.bias")]:
        grads[name[:-len("k_proj.bias")] + "qkv_bias"] = torch.cat(
            [grads.pop(name.replace("k_proj", part)) for part in ("q_proj", "k_proj", "v_proj")])
    return grads


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT asks
@pytest.mark.parametrize("kind", ["clip_projection", "dinov2_swiglu"])
def test_hf_family_peft_freezing_and_save_load(kind, tmp_path):
    """The optimized family model is transformers' tree: PEFT's usual targets (q_proj, v_proj) wrap its
    modules and the fused forward reads them (same outputs and LoRA gradients as PEFT on the source);
    freezing by name holds; save_pretrained / from_pretrained round-trip through the optimized class, and a
    model transformers builds itself (from_pretrained on the optimized class) links on first use."""
    import vit_fast

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    source = _perturbed(_hf_models()[kind]()).eval()
    fast = vit_fast.optimize(copy.deepcopy(source), backend="triton")
    config = dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, init_lora_weights=False)
    torch.manual_seed(3)
    ref = peft.get_peft_model(source, peft.LoraConfig(**config))
    fast = peft.get_peft_model(fast, peft.LoraConfig(**config))
    fast.load_state_dict(ref.state_dict())
    x = _images({"img_size": 32})
    out, expected = (_hf_output(m, x) for m in (fast, ref))
    assert_close(out, expected, FP32, "output with LoRA")
    out.square().sum().backward()
    expected.square().sum().backward()
    ref_params = dict(ref.named_parameters())
    trained = [(n, p) for n, p in fast.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    for name, p in trained:
        assert_close(p.grad, ref_params[name].grad, FP32, name)

    model = vit_fast.optimize(_hf_models()[kind](), backend="triton")
    embeddings = getattr(model, "vision_model", model).embeddings
    for p in embeddings.parameters():
        p.requires_grad_(False)
    _hf_output(model, x).sum().backward()
    assert all(p.grad is None for p in embeddings.parameters())
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, backend="triton")
    assert type(loaded) is type(model) and loaded.config.architectures == [type(model).__name__]
    with torch.no_grad():
        assert_close(_hf_output(loaded.eval(), x), _hf_output(model.eval(), x), FP32, "after save / load")
    stock = model.to_transformers()
    assert type(stock) is type(model).stock_class()
    with torch.no_grad():
        assert_close(_hf_output(stock.eval(), x), _hf_output(model, x), FP32, "to_transformers")
    built = type(model)(copy.deepcopy(model.config))  # transformers' own construction: links on first call
    built.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_close(_hf_output(built.eval(), x), _hf_output(model, x), FP32, "constructed directly")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_open_clip_through_optimize_and_from_open_clip(backend):
    """optimize(open_clip VisionTransformer) and from_open_clip(model with .visual): the embedding
    (ln_post(class token) @ proj) and every gradient; frozen source parameters stay frozen."""
    import vit_fast

    oc = pytest.importorskip("open_clip.transformer")
    QuickGELU, VisionTransformer = oc.QuickGELU, oc.VisionTransformer
    torch.manual_seed(0)
    visual = _perturbed(VisionTransformer(image_size=32, patch_size=8, width=64, layers=2, heads=4, mlp_ratio=4.0,
                                          ls_init_value=0.3, output_dim=24, act_layer=QuickGELU)).eval()
    visual.conv1.weight.requires_grad_(False)
    fast = vit_fast.optimize(visual, backend=backend)
    assert not fast.patch_embed.proj.weight.requires_grad and fast.head.bias is None
    x = _images({"img_size": 32})
    out, expected = fast(x), visual(x)
    assert_close(out, expected, FP32, "embedding")
    out.square().sum().backward()
    expected.square().sum().backward()
    mapped = families.open_clip_to_timm({k: p.grad for k, p in visual.named_parameters() if p.grad is not None})
    ours = dict(fast.named_parameters())
    for k, g in mapped.items():
        assert_close(ours[k].grad, g, FP32, f"grad {k}")
    holder = nn.Module()
    holder.visual = visual
    assert_close(vit_fast.from_open_clip(holder).set_backend(backend)(x), expected, FP32, "from_open_clip")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_open_clip_model_calls_its_optimized_tower_as_its_own(backend):
    """An open_clip CLIP model whose .visual is optimize()d: lock_image_tower (LiT) freezes the same parameters,
    CLIP.forward_intermediates gives open_clip's dict with the same tensors, get_model_preprocess_cfg reads the same
    config, and the tower keeps the source's grad checkpointing (each was an AttributeError, a TypeError, or dropped
    silently)."""
    import vit_fast

    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    source = open_clip.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, layers=3, width=64, patch_size=16,
                                                          head_width=32),
                            text_cfg=dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1)).eval()
    _perturbed(source.visual)
    open_clip.set_model_preprocess_cfg(source, dict(size=(32, 32), mean=(0.5,) * 3, std=(0.25,) * 3))
    source.set_grad_checkpointing(True)
    ours = copy.deepcopy(source)
    ours.visual = vit_fast.optimize(source.visual, backend=backend)
    assert ours.visual.grad_checkpointing
    assert open_clip.get_model_preprocess_cfg(ours) == open_clip.get_model_preprocess_cfg(source)
    assert ours.visual.image_size == (32, 32) and ours.visual.patch_size == (16, 16)

    flags = {k: torch.zeros(3, 1) if "in_proj" in k else torch.zeros(1) for k, _ in source.visual.named_parameters()}
    for unlocked in (0, 1, 2, 5):
        source.lock_image_tower(unlocked_groups=unlocked)
        ours.lock_image_tower(unlocked_groups=unlocked)
        expected = families.open_clip_to_timm({k: flags[k] + p.requires_grad for k, p in
                                               source.visual.named_parameters()})
        got = {k: p.requires_grad for k, p in ours.visual.named_parameters()}
        assert got == {k: bool(v.flatten()[0]) for k, v in expected.items()}, unlocked
        assert sum(got.values()) > 0 or unlocked == 0

    x = torch.randn(2, 3, 32, 32)
    for kwargs in [dict(), dict(image_indices=2, stop_early=True, normalize_intermediates=True),
                   dict(image_indices=[0, 2], intermediates_only=True, image_output_fmt="NLC",
                        image_output_extra_tokens=True)]:
        with torch.no_grad():
            got, expected = ours.forward_intermediates(image=x, **kwargs), source.forward_intermediates(image=x,
                                                                                                        **kwargs)
        assert sorted(got) == sorted(expected), kwargs
        for key in expected:
            values = expected[key] if isinstance(expected[key], list) else [expected[key]]
            mine = got[key] if isinstance(got[key], list) else [got[key]]
            assert len(values) == len(mine)
            for a, b in zip(mine, values):
                assert_close(a, b, FP32, f"{key} {kwargs}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_open_clip_tower_prune_intermediate_layers_as_open_clip(backend):
    """The optimized tower's prune_intermediate_layers is open_clip's: prune_head drops the projection only, forward
    and forward_intermediates' 'image_features' give the normed class token (B, width); timm's also dropped the
    pooling and returned every token (B, N, width)."""
    import vit_fast

    oc = pytest.importorskip("open_clip.transformer")
    torch.manual_seed(0)
    source = _perturbed(oc.VisionTransformer(image_size=32, patch_size=8, width=64, layers=2, heads=2, mlp_ratio=4.0,
                                             output_dim=24)).to(DEVICE).eval()
    x = _images({"img_size": 32}).to(DEVICE)
    for kwargs in [dict(), dict(prune_norm=True), dict(prune_head=False)]:
        ref = copy.deepcopy(source)
        ours = vit_fast.optimize(copy.deepcopy(source), backend=backend)
        assert ours.prune_intermediate_layers([0], **kwargs) == ref.prune_intermediate_layers([0], **kwargs) == [0]
        with torch.no_grad():
            assert_close(ours(x), ref(x), FP32, f"forward {kwargs}")
            assert_close(ours.forward_intermediates(x, indices=1)["image_features"],
                         ref.forward_intermediates(x, indices=1)["image_features"], FP32, f"image_features {kwargs}")


def test_from_hf_family_model():
    import vit_fast

    torch.manual_seed(0)
    source = _perturbed(_hf_models()["dinov2_swiglu"]()).eval()
    fast = vit_fast.from_hf(source)
    assert fast.config.mlp_layer == "swiglu_packed" and fast.config.init_values == 0.5
    x = _images({"img_size": 32})
    assert_close(fast(x), source(pixel_values=x).pooler_output, FP32, "pooled")


def test_init_from_timm_clip_uses_the_local_weights(monkeypatch):
    """``--init-from timm:vit_base_patch16_clip_224``: the timm model that timm.create_model(pretrained=True)
    returns (here a tiny CLIP tower standing in for the cached weights) is converted with pre_norm and a
    bias-free patch embedding, and loads into the preset model; the head of another class count is fresh."""
    import vit_fast
    from vit_fast.training import checkpoint as ckpt

    clip = dict(FAMILIES["clip_gelu"], num_classes=1000)
    calls = []

    def cached_create_model(name, pretrained=False, **kwargs):
        calls.append((name, pretrained))
        return timm_family("clip_gelu", num_classes=1000)

    monkeypatch.setattr(timm, "create_model", cached_create_model)
    model = vit_fast.create_model("vit_base_patch16_clip_224", **{**TINY, "num_classes": 3})
    assert model.config.pre_norm and model.patch_embed.proj.bias is None and clip["pre_norm"]
    notes = ckpt.load_pretrained(model, "timm:vit_base_patch16_clip_224")
    assert calls == [("vit_base_patch16_clip_224", True)]
    assert any("head.weight re-initialised" in n for n in notes)
    source = timm_family("clip_gelu", num_classes=1000)
    assert torch.equal(model.norm_pre.weight, source.norm_pre.weight)
    assert torch.equal(model.blocks[1].mlp.fc1.weight, source.blocks[1].mlp.fc1.weight)
