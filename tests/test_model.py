"""Reference ViT: presets match timm exactly, options behave like timm's, bad input is rejected clearly."""
import math

import pytest
import timm
import torch
import torch.nn as nn

import vit_fast
from vit_fast import VisionTransformer, ViTConfig, create_model, list_models
from vit_fast.backend import BACKENDS
from vit_fast.layers import resample_abs_pos_embed, sincos_2d_pos_embed

from .numerics import assert_close

REQUIRED = ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
            "vit_base_patch32_224", "vit_base_patch16_384", "vit_huge_patch14_224"]


def tiny(**kw) -> VisionTransformer:
    base = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, backend="torch")
    return VisionTransformer(**{**base, **kw})


@pytest.mark.parametrize("name", list_models())
def test_preset_matches_timm(name):
    """Every preset has timm's hyper-parameters: same parameter names, shapes and count (built on meta)."""
    assert set(REQUIRED) <= set(list_models())
    with torch.device("meta"):
        ref = timm.create_model(name)
        ours = create_model(name, weight_init="skip")
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert our_shapes == ref_shapes
    cfg, blk = ours.config, ref.blocks[0]
    assert (cfg.num_heads, cfg.global_pool, cfg.no_embed_class, cfg.num_classes) == \
        (blk.attn.num_heads, ref.global_pool, ref.no_embed_class, ref.num_classes)
    assert cfg.norm_eps == blk.norm1.eps and cfg.init_values == getattr(blk.ls1, "init_values", None)
    assert vit_fast.count_params(ours) == sum(p.numel() for p in ref.parameters())


def test_flops_and_param_count_of_vit_b16():
    cfg = vit_fast.presets.get_config("vit_base_patch16_224")
    assert round(vit_fast.forward_flops(cfg) / 1e9, 1) == 35.1  # the published ViT-B/16 figure
    assert cfg.num_tokens == 197 and cfg.head_dim == 64 and cfg.mlp_hidden == 3072
    assert vit_fast.forward_flops(cfg, img_size=384) > 3 * vit_fast.forward_flops(cfg)


def test_list_models_and_unknown_names():
    assert list_models("patch32") == ["vit_base_patch32_224", "vit_base_patch32_384", "vit_small_patch32_224"]
    with pytest.raises(ValueError, match="unknown model 'vit_nope'"):
        create_model("vit_nope")
    with pytest.raises(TypeError, match="embed_dims"):
        create_model("vit_tiny_patch16_224", embed_dims=3)
    with pytest.raises(ValueError, match="global_pool='token' needs class_token"):
        ViTConfig(class_token=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        ViTConfig(backend="cuda")


def test_init_is_timm_style():
    torch.manual_seed(0)
    m = create_model("vit_small_patch16_224", depth=2, init_values=1e-5, backend="torch")
    w = m.blocks[0].mlp.fc1.weight
    assert abs(w.std().item() - 0.02) < 0.002 and torch.all(m.blocks[0].mlp.fc1.bias == 0)
    assert abs(m.pos_embed.std().item() - 0.02) < 0.002 and m.cls_token.abs().max() < 1e-4
    assert torch.all(m.blocks[1].ls2.gamma == 1e-5) and torch.all(m.norm.weight == 1)
    assert m.no_weight_decay() == {"pos_embed", "cls_token"}


@pytest.mark.parametrize("name, extra", [
    ("vit_tiny_patch16_224", {}), ("deit_base_distilled_patch16_224", {}), ("vit_small_patch14_dinov2", {}),
    ("vit_base_patch16_reg4_gap_256", {}), ("vit_base_patch16_clip_quickgelu_224", {}),
    ("deit3_base_patch16_224", {}), ("vit_base_patch16_siglip_224", {}),
    ("vit_giant_patch14_dinov2", dict(embed_dim=96)),
    ("vit_base_patch16_224", dict(mlp_layer=("swiglu", timm.layers.SwiGLU), mlp_ratio=2.5))])
def test_a_seed_gives_timms_weights_and_init_weights_after_to_empty_initialises_everything(name, extra):
    """create_model under a seed draws timm's weights bitwise (timm's truncated-normal draws, timm's order: a DeiT's
    dist_token first, SigLIP's pool latent at construction, the SwiGLU gates' own init); init_weights() on a model
    materialised from the meta device (to_empty) sets every parameter as timm's does, the LayerNorms and the patch
    convolution included (they were left as uninitialised memory: non-finite logits)."""
    kw = dict(img_size=28 if "patch14" in name else 32, depth=2, embed_dim=64, num_heads=2)
    kw.update(extra)
    ours_kw, timm_kw = dict(kw), dict(kw)
    if "mlp_layer" in kw:
        ours_kw["mlp_layer"], timm_kw["mlp_layer"] = kw["mlp_layer"]
    kw = ours_kw
    torch.manual_seed(2)
    ref = timm.create_model(name, **timm_kw)
    torch.manual_seed(2)
    ours = create_model(name, backend="torch", **kw)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    with torch.device("meta"):
        empty = create_model(name, backend="torch", **kw)
    empty.to_empty(device="cpu")
    for model in (empty, ref):
        torch.manual_seed(3)
        model.init_weights()
    for key, value in ref.state_dict().items():
        assert torch.equal(empty.state_dict()[key], value), key
    x = torch.randn(2, 3, kw["img_size"], kw["img_size"])
    assert torch.isfinite(empty(x)).all()


@pytest.mark.parametrize("kw, feat", [
    (dict(), (2, 5)),
    (dict(global_pool="avg", class_token=False, reg_tokens=2), (2, 5)),
    (dict(num_classes=0), (2, 32)),
    (dict(global_pool="", num_classes=0), (2, 17, 32)),
    (dict(img_size=(32, 48), in_chans=1), (2, 5)),
])
def test_options_and_shapes(kw, feat):
    m = tiny(**kw)
    H, W = m.patch_embed.img_size
    out = m(torch.randn(2, m.config.in_chans, H, W))
    assert out.shape == feat and torch.isfinite(out).all()
    assert m.forward_head(m.forward_features(torch.randn(2, m.config.in_chans, H, W)), pre_logits=True).shape[-1] == 32


def test_reset_classifier_and_backend():
    m = tiny()
    m.reset_classifier(7, global_pool="avg")
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, 7) and m.config.num_classes == 7
    m.reset_classifier(0)
    assert isinstance(m.head, nn.Identity)
    for backend in BACKENDS:
        m.set_backend(backend)
        assert {mod.backend for mod in m.modules() if hasattr(mod, "backend")} == {backend}
    with pytest.raises(ValueError, match="backend must be one of"):
        m.set_backend("cuda")
    with pytest.raises(ValueError, match="needs a class token"):
        tiny(class_token=False, global_pool="avg").reset_classifier(3, global_pool="token")
    for name in ("vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"):  # a seed gives timm's new head(s)
        ref = timm.create_model(name, img_size=32, depth=1).bfloat16()
        ours = vit_fast.optimize(ref, backend="torch")
        for model in (ref, ours):
            torch.manual_seed(5)
            model.reset_classifier(7)
        assert ours.head.weight.dtype == torch.bfloat16
        for key, value in ref.state_dict().items():
            assert torch.equal(ours.state_dict()[key], value), key


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    m, x = tiny(), torch.randn(2, 3, 32, 32)
    m(x).square().sum().backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    m.set_grad_checkpointing(True)
    m(x).square().sum().backward()
    for k, p in m.named_parameters():
        assert_close(p.grad, grads[k], rtol=1e-6, name=k)


def test_drop_path_and_dropout_train_vs_eval():
    torch.manual_seed(0)
    m, x = tiny(drop_path_rate=0.5, drop_rate=0.3, attn_drop_rate=0.2, proj_drop_rate=0.1), torch.randn(8, 3, 32, 32)
    assert isinstance(m.blocks[0].drop_path1, nn.Identity) and m.blocks[1].drop_path1.drop_prob == 0.5
    m.eval()
    assert torch.equal(m(x), m(x))
    m.train()
    assert not torch.equal(m(x), m(x))


def test_dynamic_img_size_resamples_like_timm():
    m = tiny(dynamic_img_size=True)
    x = torch.randn(2, 3, 48, 24)
    grid_tokens = m.pos_embed[:, 1:]
    expected = resample_abs_pos_embed(m.pos_embed, (6, 3), (4, 4), num_prefix_tokens=1)
    assert torch.equal(expected[:, :1], m.pos_embed[:, :1]) and expected.shape == (1, 19, 32)
    ref = torch.nn.functional.interpolate(grid_tokens.reshape(1, 4, 4, 32).permute(0, 3, 1, 2), size=(6, 3),
                                          mode="bicubic", antialias=True).permute(0, 2, 3, 1).reshape(1, 18, 32)
    assert torch.equal(expected[:, 1:], ref)
    assert m(x).shape == (2, 5)
    with pytest.raises(ValueError, match="divisible by patch size"):
        m(torch.randn(1, 3, 36, 32))


def test_sincos_pos_embed_fixed():
    m = tiny(pos_embed="sincos", dynamic_img_size=True)
    assert not m.pos_embed.requires_grad and torch.all(m.pos_embed[:, 0] == 0)
    pe = sincos_2d_pos_embed((4, 4), 32)
    assert_close(m.pos_embed[0, 1:], pe, rtol=0, name="sincos")
    # row 0 / col 0 encode position 0: sin 0 = 0, cos 0 = 1
    assert torch.all(pe[0, :8] == 0) and torch.all(pe[0, 8:16] == 1)
    assert "pos_embed" not in {n for n, p in m.named_parameters() if p.requires_grad}
    assert m(torch.randn(1, 3, 40, 24)).shape == (1, 5)  # recomputed on the new grid


def test_attention_maps_are_softmax_probabilities():
    torch.manual_seed(0)
    m = tiny(depth=3).eval()
    x = torch.randn(2, 3, 32, 32)
    maps = m.get_attention_maps(x, layers=[0, -1])
    assert list(maps) == [0, 2] and maps[2].shape == (2, 4, 17, 17)
    assert_close(maps[0].sum(-1), torch.ones(2, 4, 17), rtol=1e-6, name="rows")
    # Block 0's attention output rebuilt from the probabilities equals the module's own attend().
    blk = m.blocks[0]
    h = blk.norm1(m.embed(x))
    qkv = blk.attn.qkv(h)
    v = qkv.reshape(2, 17, 3, 4, 8)[:, :, 2].transpose(1, 2)
    rebuilt = (maps[0] @ v).transpose(1, 2).reshape(2, 17, 32)
    assert_close(rebuilt, blk.attn.attend(qkv), rtol=1e-5, name="attn@v")
    with pytest.raises(ValueError, match="out of range"):
        m.get_attention_maps(x, layers=[3])
    with pytest.raises(ValueError, match="expected layers as an iterable of block indices"):
        m.get_attention_maps(x, layers=1)
    with pytest.raises(ValueError, match="expected integer block indices, got 0.5"):
        m.get_attention_maps(x, layers=[0.5])
    assert list(m.get_attention_maps(x, layers=torch.tensor([-1]))) == [2]  # index-like values still work
    assert not maps[0].requires_grad  # computed under no_grad


@pytest.mark.parametrize("bad, message", [
    (torch.randn(2, 1, 32, 32), "expected 3 input channels"),
    (torch.randn(2, 3, 36, 36), r"divisible by patch size \(8, 8\), got \(36, 36\)"),
    (torch.randn(2, 3, 40, 40), r"expected images of size \(32, 32\)"),
    (torch.randn(2, 3, 32), "expected a 4-D image batch"),
    (torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8), "expected a floating-point image batch"),
])
def test_bad_input_raises_clear_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny()(bad)


def test_not_divisible_size_with_dynamic_off_and_bad_config():
    with pytest.raises(ValueError, match="divisible by patch_size"):
        tiny(img_size=30)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        tiny(num_heads=5)


def test_half_precision_forward_runs():
    m = tiny().to(torch.bfloat16)
    out = m(torch.randn(2, 3, 32, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert math.isfinite(m.flops_per_image())


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_timm_methods_not_implemented_say_what_to_use_instead():
    """The README's table lists them as not implemented: each raises NotImplementedError naming the alternative
    (an AttributeError, or a TypeError for init_weights('jax'), before)."""
    m = tiny()
    for call, hint in ((lambda: m.load_pretrained("x.npz"), "vit_fast.optimize"),
                       (lambda: m.set_input_size(img_size=64), "dynamic_img_size=True"),
                       (lambda: m.get_intermediate_layers(torch.randn(1, 3, 32, 32)), "forward_intermediates"),
                       (lambda: m.init_weights("jax"), "only timm's default mode")):
        with pytest.raises(NotImplementedError, match=hint):
            call()
    m.init_weights("")  # the default mode still works
    with pytest.raises(NotImplementedError, match="torch.jit.script does not compile"):
        torch.jit.script(m)
    for trace in (lambda: torch.fx.symbolic_trace(m), lambda: timm.models.create_feature_extractor(m, ["blocks.0"])):
        with pytest.raises(NotImplementedError, match="torch.fx symbolic tracing"):  # it blamed the input
            trace()


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_timms_fused_attn_switch_exposes_the_attention_maps_to_a_hook(backend):
    """timm's idiom for attention maps: ``attn.fused_attn = False`` and a forward hook on ``attn.attn_drop``, which
    then receives the softmax probabilities (the hook never fired before: no such switch). The same maps and
    outputs as timm's."""
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=10).eval()
    ours = vit_fast.optimize(ref, backend=backend).eval()
    x = torch.randn(2, 3, 32, 32)
    maps = {}
    for name, model in (("timm", ref), ("ours", ours)):
        model.blocks[-1].attn.fused_attn = False
        attn_drop = model.blocks[-1].attn.attn_drop
        hook = attn_drop.register_forward_hook(lambda m, i, o, name=name: maps.setdefault(name, o))
        with torch.no_grad():
            out = model(x)
        hook.remove()
        maps[name + "_out"] = out
    assert_close(maps["ours"], maps["timm"], 1e-5)
    assert_close(maps["ours_out"], maps["timm_out"], 1e-5)


def test_timm_forward_signatures_take_no_mask_and_refuse_one():
    """timm's forward, forward_features and forward_intermediates take attn_mask and is_causal (timm 1.0.31): None
    and False run as without them, by keyword or position as timm's callers pass them; a mask or is_causal=True is
    refused naming both (forward_features read a mask passed by position as its position embeddings)."""
    import inspect

    m = tiny().eval()
    for name in ("forward", "forward_features", "forward_intermediates"):
        ours = inspect.signature(getattr(m, name)).parameters
        theirs = inspect.signature(getattr(timm.models.VisionTransformer, name)).parameters
        for arg in ("attn_mask", "is_causal"):
            if arg in theirs:
                assert ours[arg].default == theirs[arg].default, (name, arg)
        if name != "forward_intermediates" and "attn_mask" in theirs:
            assert list(ours)[:3] == list(theirs)[1:4] == ["x", "attn_mask", "is_causal"], name
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(m(x, None, False), m(x)) and torch.equal(m(x, attn_mask=None), m(x))
        assert torch.equal(m.forward_features(x, None), m.forward_features(x))
        mask = torch.ones(2, 1, 17, 17, dtype=torch.bool)
        for call in (lambda: m(x, mask), lambda: m.forward_features(x, mask), lambda: m(x, is_causal=True),
                     lambda: m.forward_intermediates(x, attn_mask=mask)):
            with pytest.raises(ValueError, match=r"attention masks are not supported.*attn_mask=None and "
                                                 r"is_causal=False, got attn_mask (of shape \(2, 1, 17, 17\)|None)"):
                call()
