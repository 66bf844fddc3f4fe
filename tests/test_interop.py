"""Weight interop: timm, Hugging Face and torchvision ViTs with random weights give the same outputs and
parameter gradients (fp32, relative error < 1e-5) after conversion; checkpoint files load strictly.
These test the weights on the reference backend; the fused path against the same sources is tests/test_optimize.py."""
import functools
import re

import pytest
import timm
import torch
import torchvision
import transformers

import vit_fast
from vit_fast import CheckpointError, from_hf, from_timm, from_torchvision, load_checkpoint, save_checkpoint
from vit_fast.interop.convert import hf_to_timm_state_dict, torchvision_to_timm_state_dict

from .numerics import assert_close, bound

RTOL = bound(torch.float32, "dot")  # 1e-5


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere: init leaves biases 0 and norms 1, which would hide a swapped key."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g, device="cpu") * 0.05)
    return model.eval()


def check_same(ref, ours, x, ref_forward=None, grad_map=dict):
    """Forward outputs and every parameter gradient of the converted model match the reference."""
    ref_forward = ref_forward or ref
    torch.manual_seed(1)
    out_ref = ref_forward(x)
    out = ours(x)
    assert_close(out, out_ref, RTOL, name="logits")
    weight = torch.randn_like(out_ref)
    (out_ref * weight).sum().backward()
    (out * weight).sum().backward()
    ref_grads = grad_map({k: p.grad for k, p in ref.named_parameters() if p.grad is not None})
    our_grads = {k: p.grad for k, p in ours.named_parameters() if p.requires_grad}
    assert set(ref_grads) == set(our_grads)
    for name, grad in our_grads.items():
        assert_close(grad, ref_grads[name], RTOL, name=f"grad {name}")


TIMM_CASES = {
    "tiny": ("vit_tiny_patch16_224", dict(depth=2), (224, 224)),
    "small": ("vit_small_patch16_224", dict(depth=1), (224, 224)),
    "patch32": ("vit_base_patch32_224", dict(depth=1), (224, 224)),
    "avg_pool": ("vit_tiny_patch16_224", dict(depth=1, global_pool="avg"), (224, 224)),
    "no_class_token": ("vit_tiny_patch16_224", dict(depth=1, class_token=False, global_pool="avg"), (224, 224)),
    "reg_tokens": ("vit_base_patch16_reg4_gap_256", dict(depth=1, embed_dim=192, num_heads=3), (256, 256)),
    "reg_tokens_cls": ("vit_tiny_patch16_224", dict(depth=1, reg_tokens=2), (224, 224)),
    "layerscale_qknorm": ("deit3_base_patch16_224", dict(depth=2, embed_dim=192, num_heads=3, qk_norm=True),
                          (224, 224)),
    "non_square": ("vit_tiny_patch16_224", dict(depth=1, img_size=(96, 160)), (96, 160)),
    "in_chans_1": ("vit_tiny_patch16_224", dict(depth=1, in_chans=1, img_size=96), (96, 96)),
    "dynamic_size": ("vit_tiny_patch16_224", dict(depth=1, dynamic_img_size=True), (160, 112)),
    "features_only": ("vit_tiny_patch16_224", dict(depth=1, num_classes=0, img_size=64), (64, 64)),
}


@pytest.mark.parametrize("case", list(TIMM_CASES))
def test_from_timm_model_matches_outputs_and_gradients(case):
    name, kw, size = TIMM_CASES[case]
    torch.manual_seed(0)
    ref = perturb_(timm.create_model(name, **kw))
    ours = from_timm(ref, backend="torch")
    assert ours.state_dict().keys() == ref.state_dict().keys()
    batch = 1 if ref.embed_dim >= 768 else 2  # keep the CPU suite fast
    check_same(ref, ours, torch.randn(batch, ref.patch_embed.proj.in_channels, *size))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_intermediates_and_pruning_match_timm(backend):
    """timm's feature-extraction API on a converted model (class + register tokens, non-square grid): every
    argument combination gives timm's tensors, NCHW maps and NLC tokens, prefix tokens, dict output,
    stop_early; gradients reach the blocks through the intermediates; pruning keeps timm's blocks."""
    torch.manual_seed(0)
    ref = perturb_(timm.create_model("vit_tiny_patch16_224", depth=3, reg_tokens=2, img_size=(32, 48),
                                     patch_size=8, embed_dim=64, num_heads=2))
    ours = from_timm(ref, backend=backend)
    x = torch.randn(2, 3, 32, 48)
    calls = [dict(), dict(indices=2, norm=True), dict(indices=[0, -1], output_fmt="NLC", return_prefix_tokens=True),
             dict(indices=[1], stop_early=True, intermediates_only=True),
             dict(indices=[0, 2], output_dict=True, return_prefix_tokens=True)]
    for kw in calls:
        want, got = ref.forward_intermediates(x, **kw), ours.forward_intermediates(x, **kw)
        flat_want, flat_got = torch.utils._pytree.tree_flatten(want), torch.utils._pytree.tree_flatten(got)
        assert flat_got[1] == flat_want[1], kw  # same structure (tuple / list / dict, pairs with prefix)
        for i, (g, w) in enumerate(zip(flat_got[0], flat_want[0])):
            assert_close(g, w, RTOL, name=f"{kw} leaf {i}")
    final, maps = ours.forward_intermediates(x, indices=[0])
    assert maps[0].shape == (2, 64, 4, 6)
    maps[0].square().sum().backward()
    assert ours.blocks[0].mlp.fc2.weight.grad.abs().sum() > 0 and ours.blocks[2].mlp.fc2.weight.grad is None
    with pytest.raises(ValueError, match="block indices"):
        ours.forward_intermediates(x, indices=[3])
    with pytest.raises(ValueError, match="output_fmt"):
        ours.forward_intermediates(x, output_fmt="NHWC")
    assert ours.prune_intermediate_layers([1]) == ref.prune_intermediate_layers([1]) == [1]
    assert len(ours.blocks) == len(ref.blocks) == 2 and isinstance(ours.head, torch.nn.Identity)
    assert_close(ours.forward_intermediates(x, indices=1)[1][0], ref.forward_intermediates(x, indices=1)[1][0], RTOL,
                 name="after pruning")


@pytest.mark.parametrize("kw, overrides", [
    (dict(depth=1, class_token=False, reg_tokens=4, no_embed_class=True, global_pool="avg"), {}),
    (dict(depth=1, init_values=1e-5, qk_norm=True, num_classes=10), {}),
    (dict(depth=1, img_size=(64, 96)), dict(img_size=(64, 96))),  # a non-square grid cannot be inferred
])
def test_from_timm_state_dict_infers_config(kw, overrides):
    torch.manual_seed(0)
    ref = perturb_(timm.create_model("vit_tiny_patch16_224", **kw))
    with pytest.warns(UserWarning, match="assumed act='gelu', norm_eps=1e-6, global_pool="):
        ours = from_timm(ref.state_dict(), backend="torch", **overrides).eval()
    x = torch.randn(2, 3, *ref.patch_embed.img_size)
    with torch.no_grad():
        assert_close(ours(x), ref(x), RTOL)


def test_from_timm_state_dict_takes_what_it_cannot_record_from_the_caller():
    """A state dict does not record the activation, the LayerNorm eps or the pooling (max and avg pool the same
    tensors): passed, the model is the source's, and nothing is assumed; not passed, the warning names them."""
    import warnings

    torch.manual_seed(0)
    ref = perturb_(timm.create_model("vit_tiny_patch16_224", depth=1, global_pool="max", act_layer="quick_gelu",
                                     norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-5))).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = from_timm(ref.state_dict(), backend="torch", act="quick_gelu", norm_eps=1e-5, global_pool="max")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert_close(ours.eval()(x), ref(x), RTOL)
    with pytest.warns(UserWarning, match="assumed global_pool="):
        from_timm(ref.state_dict(), backend="torch", act="quick_gelu", norm_eps=1e-5)


def tiny_timm(**kw):
    torch.manual_seed(0)
    return perturb_(timm.create_model("vit_tiny_patch16_224", **{**dict(img_size=32, patch_size=8, embed_dim=64,
                                                                         depth=1, num_heads=2), **kw}))


def test_from_timm_state_dict_names_what_settles_an_ambiguous_grid():
    """Class + 4 register tokens, no_embed_class=True, a 3x3 grid (24 px): pos_embed's 9 rows are also a 2x2 grid
    and the 5 prefix tokens. That was read silently as 16 px with no_embed_class=False (failing at forward); now the
    error names both readings and the keywords, and either keyword gives the source's model."""
    ref = tiny_timm(img_size=24, reg_tokens=4, no_embed_class=True)
    with pytest.raises(CheckpointError, match=r"9 rows: a 2x2 grid \(16x16 px\).*3x3 grid \(24x24 px\).*img_size= "
                                              r"or no_embed_class="):
        from_timm(ref.state_dict(), backend="torch", num_heads=2)
    x = torch.randn(2, 3, 24, 24)
    for settles in (dict(img_size=24), dict(no_embed_class=True)):
        with pytest.warns(UserWarning, match="assumed act="):
            ours = from_timm(ref.state_dict(), backend="torch", num_heads=2, **settles).eval()
        assert ours.config.img_size == (24, 24) and ours.config.no_embed_class
        with torch.no_grad():
            assert_close(ours(x), ref(x), RTOL)
    with pytest.raises(CheckpointError, match=r"pos_embed has 21 rows: 20 or 21 patches, not a square grid; pass "
                                              r"img_size=\(H, W\)"):  # a 4x5 grid: was a 224 px model's mismatch
        from_timm(tiny_timm(img_size=(32, 40)).state_dict(), num_heads=2)


def test_from_timm_state_dict_without_pos_embed_names_the_assumed_img_size():
    """No pos_embed records the grid: the default 224 px is named in the warning (it was silent, the error only came
    at the first forward); passed, nothing is said of it. A head without bias (CLIP's projection) is read too."""
    ref = tiny_timm(class_token=False, global_pool="avg", pos_embed="none")
    ref.head = torch.nn.Linear(64, 5, bias=False)
    with pytest.warns(UserWarning, match=r"assumed .*img_size=224 \(ViTConfig's default, no pos_embed records"):
        assert from_timm(ref.state_dict(), backend="torch", num_heads=2).config.img_size == (224, 224)
    with pytest.warns(UserWarning) as caught:
        ours = from_timm(ref.state_dict(), backend="torch", num_heads=2, img_size=32).eval()
    assert "img_size=" not in str(caught[0].message) and not ours.config.head_bias
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(ours(x), ref(x), RTOL)


def hf_model(**kw):
    base = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3, intermediate_size=768,
                image_size=64, patch_size=16, num_labels=7, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return perturb_(transformers.ViTForImageClassification(transformers.ViTConfig(**{**base, **kw})))


def hf_logits(model):
    return lambda x: model(pixel_values=x).logits


@pytest.mark.parametrize("kw", [dict(), dict(qkv_bias=False, num_channels=1), dict(image_size=(48, 80)),
                                dict(hidden_act="quick_gelu")])
def test_from_hf_model_matches_outputs_and_gradients(kw):
    ref = hf_model(**kw)
    ours = from_hf(ref, backend="torch")
    assert ours.config.norm_eps == 1e-12 and ours.config.qkv_bias == ref.config.qkv_bias
    size = ref.config.image_size
    size = size if isinstance(size, (tuple, list)) else (size, size)
    check_same(ref, ours, torch.randn(2, ref.config.num_channels, *size), hf_logits(ref), hf_to_timm_state_dict)


def test_from_hf_and_optimize_refuse_an_activation_they_do_not_have_by_its_config_name():
    ref = hf_model(hidden_act="relu")
    for convert in (from_hf, vit_fast.optimize):
        with pytest.raises(ValueError, match=r"transformers config's hidden_act 'relu' is not supported; expected "
                                             r"one of \['gelu', 'gelu_new', 'gelu_pytorch_tanh', 'quick_gelu'\]"):
            convert(ref)


def to_old_hf_names(sd):
    """transformers 5.x keys -> the names of transformers 4.x and most hub checkpoints."""
    renames = [(r"\.layers\.(\d+)\.", r".encoder.layer.\1."), (r"attention\.q_proj", "attention.attention.query"),
               (r"attention\.k_proj", "attention.attention.key"), (r"attention\.v_proj", "attention.attention.value"),
               (r"attention\.o_proj", "attention.output.dense"), (r"mlp\.fc1", "intermediate.dense"),
               (r"mlp\.fc2", "output.dense")]
    out = {}
    for k, v in sd.items():
        for pattern, new in renames:
            k = re.sub(pattern, new, k)
        out[k] = v
    return out


def test_from_hf_old_key_names_state_dict():
    ref = hf_model()
    old = to_old_hf_names(ref.state_dict())
    assert "vit.encoder.layer.1.attention.attention.query.weight" in old
    with pytest.warns(UserWarning, match="assumed act='gelu', norm_eps=1e-12: "):
        ours = from_hf(old, backend="torch").eval()  # width 192 -> 3 heads, eps 1e-12, from shapes alone
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert_close(ours(x), ref(pixel_values=x).logits, RTOL)
    with pytest.raises(CheckpointError, match=r"found only \['k', 'v'\]"):
        from_hf({k: v for k, v in old.items() if "attention.attention.query" not in k})


def test_from_hf_takes_a_vit_with_a_mask_token():
    """ViTModel(use_mask_token=True) (masked-image modelling's backbone) converts, its mask token dropped as the
    pooler is: the object was refused for an unexpected 'embeddings.mask_token', its state dict as a DINOv2's."""
    cfg = transformers.ViTConfig(hidden_size=192, num_hidden_layers=2, num_attention_heads=3, intermediate_size=768,
                                 image_size=64, patch_size=16)
    torch.manual_seed(0)
    ref = perturb_(transformers.ViTModel(cfg, add_pooling_layer=False, use_mask_token=True)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = ref(pixel_values=x).last_hidden_state
        assert_close(from_hf(ref, backend="torch").eval().forward_features(x), expected, RTOL)
        with pytest.warns(UserWarning, match="assumed"):
            ours = from_hf(ref.state_dict(), backend="torch").eval()
        assert_close(ours.forward_features(x), expected, RTOL)


def test_from_hf_refuses_another_familys_state_dict_by_name():
    """A CLIP or DINOv2 state dict does not record its family's config (pre-norm, QuickGELU, LayerScale...): refused
    with what to pass instead (it was a bare KeyError, or a list of unexpected keys)."""
    common = dict(image_size=32, patch_size=16, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(intermediate_size=128, **common))
    dinov2 = transformers.Dinov2Model(transformers.Dinov2Config(**common))
    for model, family in [(clip, "CLIP or SigLIP"), (dinov2, "DINOv2")]:
        with pytest.raises(CheckpointError, match=f"this one is a {family} model's.*from_hf\\(model\\)"):
            from_hf(model.state_dict())
    with pytest.raises(CheckpointError, match="is not a transformers ViT's"):
        from_hf({"weight": torch.zeros(2)})


def test_from_hf_refuses_another_transformers_class_by_name():
    """A transformers model object from_hf does not implement was read as a ViT: Dinov2ForImageClassification and
    DINOv2 with registers raised AttributeError on their config's intermediate_size, DeiT a CheckpointError listing
    keys. Refused naming the class, and the supported module inside it where there is one."""
    common = dict(image_size=32, patch_size=16, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    for model, hint in [
        (transformers.Dinov2ForImageClassification(transformers.Dinov2Config(num_labels=3, **common)),
         "its dinov2 is one: pass model.dinov2"),
        (transformers.Dinov2WithRegistersModel(transformers.Dinov2WithRegistersConfig(**common)), ""),
        (transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(intermediate_size=128, **common)),
         ""),
    ]:
        with pytest.raises(ValueError, match=f"from_hf: expected a transformers ViTModel.*{type(model).__name__}"
                                             f".*{re.escape(hint)}") as info:
            from_hf(model)
        assert not isinstance(info.value, CheckpointError)
    msn = transformers.ViTMSNModel(transformers.ViTMSNConfig(intermediate_size=128, **common)).eval()  # a ViT's layout
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(from_hf(msn).forward_features(x), msn(x).last_hidden_state, RTOL, name="ViT-MSN tokens")


@pytest.mark.parametrize("missing", ["absolute", "./relative", "path object"])
def test_from_pretrained_names_a_missing_local_directory(tmp_path, monkeypatch, missing):
    """A local directory that does not exist is named (transformers read it as a malformed hub id); a hub id still
    goes to transformers. CLIP's class takes the same check through the shared from_pretrained."""
    from vit_fast.interop import hf, hf_families

    monkeypatch.chdir(tmp_path)
    path = {"absolute": str(tmp_path / "no_such_model"), "./relative": "./no_such_model",
            "path object": tmp_path / "no_such_model"}[missing]
    for optimized_class in (vit_fast.HFViT, hf_families.CLIPVisionModel):
        with pytest.raises(FileNotFoundError, match=r"from_pretrained: no such directory '.*no_such_model'"):
            optimized_class.from_pretrained(path)

    class ReachedTransformers(Exception):
        pass

    def config_from_hub(name, *args, **kwargs):
        raise ReachedTransformers(name)

    monkeypatch.setattr(hf.ViTConfig, "from_pretrained", config_from_hub)
    with pytest.raises(ReachedTransformers, match="google/vit-base-patch16-224"):
        vit_fast.HFViT.from_pretrained("google/vit-base-patch16-224")


def test_from_hf_and_torchvision_state_dicts_name_what_they_assume():
    """A transformers state dict does not record hidden_act or layer_norm_eps, and no state dict records the head
    count (any count fits the same tensors): each assumption not passed is named in one warning; passed, the model is
    the source's and nothing is assumed. A torchvision ViT fixes GELU and eps in code: only the heads of a width
    whose usual head count is unknown are assumed."""
    import warnings

    ref = hf_model(hidden_size=96, num_attention_heads=3, intermediate_size=192, hidden_act="gelu_new",
                   layer_norm_eps=1e-6)
    sd = ref.state_dict()
    with pytest.warns(UserWarning, match=r"assumed act='gelu', norm_eps=1e-12, num_heads=1 \(64-wide heads at"):
        from_hf(sd, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = from_hf(sd, backend="torch", act="gelu_tanh", norm_eps=1e-6, num_heads=3).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert_close(ours(x), ref(pixel_values=x).logits, RTOL)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_torchvision(tv_model(16).state_dict(), backend="torch")  # width 768: 12 heads, nothing assumed
    torch.manual_seed(0)
    narrow = perturb_(torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=4,
                                                           hidden_dim=96, mlp_dim=192, num_classes=3)).eval()
    with pytest.warns(UserWarning, match=r"from_torchvision: .*assumed num_heads=1"):
        from_torchvision(narrow.state_dict(), backend="torch")
    ours = from_torchvision(narrow.state_dict(), backend="torch", num_heads=4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(ours(x), narrow(x), RTOL)


def test_mlp_width_read_from_a_source_survives_float_rounding():
    """A source's MLP width is read as hidden / width, and the model builds int(width * ratio) (timm's rounding):
    49 / 44 * 44 is 48.99..., which built a 48-wide fc1 and failed to load (open_clip, timm and transformers
    sources, model or state dict). The ratio read is the one that rebuilds the source's width."""
    from vit_fast.presets import mlp_ratio_for

    assert all(int(w * mlp_ratio_for(h, w)) == h for w in range(8, 400, 4) for h in range(w, 5 * w))
    open_clip = pytest.importorskip("open_clip.transformer")
    torch.manual_seed(0)
    ratio = 49 / 44 + 1e-9  # the sources' own int(44 * ratio) is 49
    visual = perturb_(open_clip.VisionTransformer(image_size=32, patch_size=16, width=44, layers=1, heads=4,
                                                  mlp_ratio=ratio, output_dim=8)).eval()
    tm = perturb_(timm.create_model("vit_tiny_patch16_224", img_size=32, embed_dim=44, num_heads=4, depth=1,
                                    mlp_ratio=ratio, num_classes=5)).eval()
    hf = hf_model(hidden_size=44, num_attention_heads=4, intermediate_size=49, image_size=32).eval()
    assert visual.transformer.resblocks[0].mlp.c_fc.out_features == tm.blocks[0].mlp.fc1.out_features == 49
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(vit_fast.optimize(visual, backend="torch")(x), visual(x), RTOL)
        assert_close(vit_fast.optimize(tm, backend="torch")(x), tm(x), RTOL)
        with pytest.warns(UserWarning, match="assumed act="):
            from_sd = from_timm(tm.state_dict(), backend="torch", num_heads=4).eval()
        assert_close(from_sd(x), tm(x), RTOL)
        assert_close(from_hf(hf, backend="torch").eval()(x), hf(pixel_values=x).logits, RTOL)


def tv_model(patch_size):
    torch.manual_seed(0)
    return perturb_(torchvision.models.VisionTransformer(image_size=224, patch_size=patch_size, num_layers=1,
                                                         num_heads=12, hidden_dim=768, mlp_dim=3072,
                                                         num_classes=10))


@pytest.mark.parametrize("patch_size", [16, 32])  # vit_b_16 / vit_b_32 at depth 1
def test_from_torchvision_matches_outputs_and_gradients(patch_size):
    ref = tv_model(patch_size)
    ours = from_torchvision(ref, backend="torch")
    check_same(ref, ours, torch.randn(1, 3, 224, 224), grad_map=torchvision_to_timm_state_dict)
    from_sd = from_torchvision(ref.state_dict(), backend="torch").eval()
    assert from_sd.config == ours.config


def test_from_torchvision_reads_the_mlp_activation():
    """A tanh GELU converts as tanh GELU; another activation (ReLU) is refused by name (it converted as exact GELU:
    logits 0.57 off)."""
    ref = tv_model(32).eval()
    ref.encoder.layers[0].mlp[1] = torch.nn.GELU(approximate="tanh")
    ours = from_torchvision(ref, backend="torch").eval()
    assert ours.config.act == "gelu_tanh"
    x = torch.randn(1, 3, 224, 224)
    assert_close(ours(x), ref(x), RTOL)
    ref.encoder.layers[0].mlp[1] = torch.nn.ReLU()
    with pytest.raises(ValueError, match=r"MLP activation must be nn.GELU\(\).*got ReLU\(\)"):
        from_torchvision(ref)


@pytest.mark.parametrize("heads", ["new_head", "no_bias", "identity", "head_identity"])
def test_from_torchvision_reads_the_head_modules(heads):
    """A torchvision ViT's head as fine-tuning leaves it: heads.head replaced by another class count (num_classes, the
    model's attribute, not updated) or without bias, heads or heads.head an nn.Identity (features: the class token
    after the final norm). The head is read from the modules: same outputs and gradients, through optimize too."""
    ref = tv_model(32)
    if heads == "new_head":
        ref.heads.head = torch.nn.Linear(768, 3)
    elif heads == "no_bias":
        ref.heads.head = torch.nn.Linear(768, 10, bias=False)
    elif heads == "identity":
        ref.heads = torch.nn.Identity()
    else:
        ref.heads.head = torch.nn.Identity()
    perturb_(ref, seed=1)
    check_same(ref, from_torchvision(ref, backend="torch"), torch.randn(1, 3, 224, 224),
               grad_map=torchvision_to_timm_state_dict)
    x = torch.randn(2, 3, 224, 224)
    assert_close(vit_fast.optimize(ref.eval(), backend="torch")(x), ref(x), RTOL)


def test_from_torchvision_refuses_another_head_by_name():
    ref = tv_model(32)
    ref.heads = torch.nn.Sequential(torch.nn.Linear(768, 5))
    with pytest.raises(ValueError, match=r"from_torchvision: expected heads to hold one nn.Linear named 'head'"):
        vit_fast.optimize(ref)


def test_from_torchvision_refuses_encoder_layers_it_would_misread_by_name():
    """Every encoder layer is read (the config comes from the first): a layer replaced (an Identity was an
    AttributeError), an RMSNorm, an attention with add_zero_attn (converted without it) or without biases (a
    CheckpointError listing keys) are refused, naming what."""
    small = dict(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=7)
    edits = {
        "encoder layers of type Identity": lambda m: m.encoder.layers.__setitem__(1, torch.nn.Identity()),
        "norm layer RMSNorm": lambda m: setattr(m.encoder.layers[1], "ln_2", torch.nn.RMSNorm(64)),
        "add_zero_attn": lambda m: setattr(m.encoder.layers[1].self_attention, "add_zero_attn", True),
        "attention without biases": lambda m: setattr(
            m.encoder.layers[0], "self_attention", torch.nn.MultiheadAttention(64, 2, bias=False, batch_first=True)),
    }
    for problem, edit in edits.items():
        ref = torchvision.models.VisionTransformer(**small)
        from_torchvision(ref)
        edit(ref)
        with pytest.raises(ValueError, match=f"from_torchvision: this model uses features .*{problem}"):
            vit_fast.optimize(ref)


def test_torchvision_vit_b_16_config_is_the_timm_preset():
    with torch.device("meta"):
        tv = torchvision.models.vit_b_16()
    cfg = vit_fast.interop.convert._timm_config_from_state_dict(torchvision_to_timm_state_dict(tv.state_dict()))
    preset = vit_fast.presets.get_config("vit_base_patch16_224")
    assert vit_fast.ViTConfig(**cfg) == preset


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_checkpoint_round_trip(tmp_path, suffix):
    torch.manual_seed(0)
    src = perturb_(vit_fast.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4))
    path = tmp_path / f"model{suffix}"
    save_checkpoint(src, path)
    dst = load_checkpoint(vit_fast.VisionTransformer(src.config), path)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_checkpoint_in_hf_format_loads(tmp_path):
    from safetensors.torch import save_file

    ref = hf_model()
    save_file(ref.state_dict(), tmp_path / "hf.safetensors")
    ours = load_checkpoint(from_hf(ref, backend="torch"), tmp_path / "hf.safetensors").eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert_close(ours(x), ref(pixel_values=x).logits, RTOL)


def test_a_transformers_models_own_checkpoint_loads_back(tmp_path):
    """save_checkpoint of a transformers model (optimized or not) writes its own keys; load_checkpoint reads them
    back into it, optimized or plain (it mapped them to timm's names whatever the model: every key missing)."""
    ref = hf_model()
    optimized = vit_fast.optimize(hf_model(), backend="torch")
    save_checkpoint(ref, tmp_path / "hf.safetensors")
    save_checkpoint(optimized, tmp_path / "hf.pt")
    for path in (tmp_path / "hf.safetensors", tmp_path / "hf.pt"):
        for dst in (vit_fast.optimize(hf_model(), backend="torch"), hf_model()):
            with torch.no_grad():
                dst.classifier.weight.zero_()
            load_checkpoint(dst, path)
            for k, v in ref.state_dict().items():
                assert torch.equal(dst.state_dict()[k], v), (path.name, k)
    ours = load_checkpoint(from_hf(ref, backend="torch"), tmp_path / "hf.pt")   # into timm's names as before
    assert torch.equal(ours.head.weight, ref.classifier.weight)


def test_compiled_and_data_parallel_models_save_and_load_under_the_models_own_names(tmp_path):
    """A model under torch.compile (or DataParallel) is saved without '_orig_mod.' / 'module.' (it wrote
    '_orig_mod.'-prefixed keys that neither timm nor load_checkpoint read) and loads into such a wrapper; a file with
    those prefixes, in either order, loads into the plain model."""
    torch.manual_seed(0)
    src = perturb_(vit_fast.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4))
    sd = src.state_dict()
    save_checkpoint(torch.compile(src), tmp_path / "compiled.safetensors")
    save_checkpoint(torch.nn.DataParallel(src), tmp_path / "dp.pt")
    torch.save({"state_dict": {f"module._orig_mod.{k}": v for k, v in sd.items()}}, tmp_path / "prefixed.pt")
    torch.save({f"_orig_mod.module.{k}": v for k, v in sd.items()}, tmp_path / "prefixed2.pt")
    timm_model = timm.create_model("vit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                                   num_heads=4)
    for name in ("compiled.safetensors", "dp.pt", "prefixed.pt", "prefixed2.pt"):
        for dst in (vit_fast.VisionTransformer(src.config), torch.compile(vit_fast.VisionTransformer(src.config))):
            assert load_checkpoint(dst, tmp_path / name) is dst
            assert all(torch.equal(getattr(dst, "_orig_mod", dst).state_dict()[k], v) for k, v in sd.items()), name
        timm_model.load_state_dict(vit_fast.interop.convert.read_state_dict(tmp_path / name), strict=True)


def test_a_lightning_checkpoint_loads_without_its_model_prefix(tmp_path):
    """A LightningModule's checkpoint ({'state_dict': {'model.' + key: ...}, 'epoch': ...}) in timm's or
    transformers' names loads (it failed: every key missing, every key unexpected); a prefixed checkpoint lacking a
    key names that key, and load_state_dict's error names the prefix to strip."""
    torch.manual_seed(0)
    src = perturb_(vit_fast.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4))
    torch.save({"state_dict": {f"model.{k}": v for k, v in src.state_dict().items()}, "epoch": 3},
               tmp_path / "timm.ckpt")
    ref = hf_model()
    torch.save({"state_dict": {f"net.{k}": v for k, v in ref.state_dict().items()}}, tmp_path / "hf.ckpt")
    dst = load_checkpoint(vit_fast.VisionTransformer(src.config), tmp_path / "timm.ckpt")
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in src.state_dict().items())
    ours = load_checkpoint(from_hf(hf_model(), backend="torch"), tmp_path / "hf.ckpt")
    assert torch.equal(ours.head.weight, ref.classifier.weight)
    hf_dst = hf_model()
    with torch.no_grad():
        hf_dst.classifier.weight.zero_()
    assert torch.equal(load_checkpoint(hf_dst, tmp_path / "hf.ckpt").classifier.weight, ref.classifier.weight)
    partial = {f"model.{k}": v for k, v in src.state_dict().items() if k != "head.bias"}
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): head.bias$"):
        load_checkpoint(vit_fast.VisionTransformer(src.config), tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match=r"every checkpoint key starts with 'model\.'"):
        vit_fast.interop.convert.load_state_dict(vit_fast.VisionTransformer(src.config), partial)


def test_mismatched_checkpoint_names_keys_and_shapes(tmp_path):
    small = vit_fast.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)
    sd = small.state_dict()
    sd["head.weight"] = torch.zeros(9, 32)
    del sd["blocks.1.mlp.fc2.bias"]
    sd["blocks.0.attn.extra"] = torch.zeros(1)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(small, tmp_path / "bad.pth")
    message = str(info.value)
    assert "bad.pth" in message and "missing keys (1): blocks.1.mlp.fc2.bias" in message
    assert "unexpected keys (1): blocks.0.attn.extra" in message
    assert "head.weight: checkpoint (9, 32) vs model (1000, 32)" in message


class NotATensor:
    pass


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    model = vit_fast.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4)
    torch.save({"state_dict": model.state_dict(), "evil": NotATensor()}, tmp_path / "pickled.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        load_checkpoint(model, tmp_path / "pickled.pt")
    with pytest.raises(CheckpointError, match="model.ckpt': no such file"):   # any suffix: the bytes tell the format
        load_checkpoint(model, tmp_path / "model.ckpt")
