"""vit_fast.optimize(): random-weight timm, transformers and torchvision ViTs become vit_fast models with the
same outputs (reference backend, and the Triton kernels through the interpreter), the same forward
signatures, device, dtype, mode and frozen parameters; unsupported features are a clear error."""
import functools

import pytest
import timm
import torch
import torchvision
import transformers

import vit_fast
from vit_fast.interop.hf import HFViT

from .numerics import assert_close, bound, errors

RTOL = bound(torch.float32, "dot")  # 1e-5
BACKENDS = ["torch", "triton"]  # 'triton' runs the kernels in the interpreter on CPU (conftest)


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere: init leaves biases 0 and norms 1, which would hide a swapped key."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g, device="cpu").to(p) * 0.05)
    return model


def timm_vit(**kw):
    torch.manual_seed(0)
    base = dict(depth=2, embed_dim=64, num_heads=2, img_size=32, num_classes=5)
    return perturb_(timm.create_model("vit_tiny_patch16_224", **{**base, **kw})).eval()


def torchvision_vit():
    torch.manual_seed(0)
    return perturb_(torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2,
                                                         hidden_dim=64, mlp_dim=128, num_classes=7)).eval()


def hf_vit(cls=transformers.ViTForImageClassification, **kw):
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128, image_size=32, patch_size=16, num_labels=3,
                                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), **kw})
    return perturb_(cls(config)).eval()


def images(batch=2, size=32, seed=1):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), device="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_timm_same_outputs_and_signature(backend):
    ref = timm_vit(global_pool="avg", reg_tokens=1, init_values=0.1)
    model = vit_fast.optimize(ref, backend=backend)
    assert isinstance(model, vit_fast.VisionTransformer) and model.config.backend == backend
    assert model.state_dict().keys() == ref.state_dict().keys()
    x = images()
    assert_close(model(x), ref(x), RTOL, name="logits")
    features = model.forward_features(x)
    assert_close(features, ref.forward_features(x), RTOL, name="forward_features")
    assert_close(model.forward_head(features, pre_logits=True), ref.forward_head(features, pre_logits=True), RTOL,
                 name="forward_head(pre_logits=True)")


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_timm_explicit_attention_and_its_scale_carry_over(backend):
    """A timm block on its explicit attention path (fused_attn=False: TIMM_FUSED_ATTN=0, or set for attention maps)
    applies its scale, one set by hand included; the converted model defaulted both (logits 1.3e-2 off). A fused
    timm block ignores a hand-set scale (its SDPA call takes none), and so does its conversion."""
    ref = timm_vit()
    ref.blocks[0].attn.fused_attn, ref.blocks[0].attn.scale = False, 0.37
    ref.blocks[1].attn.scale = 0.37  # ignored by timm's SDPA path
    model = vit_fast.optimize(ref, backend=backend)
    assert model.blocks[0].attn.fused_attn is False and model.blocks[0].attn.scale == 0.37
    assert_close(model(images()), ref(images()), RTOL, name="logits")


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_torchvision_same_logits(backend):
    ref = torchvision_vit()
    model = vit_fast.optimize(ref, backend=backend)
    x = images()
    assert_close(model(x), ref(x), RTOL, name="logits")


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_hf_classifier_same_outputs_loss_and_tuple(backend):
    ref = hf_vit()
    model = vit_fast.optimize(ref, backend=backend)
    assert isinstance(model, HFViT) and isinstance(model, transformers.ViTForImageClassification)
    assert type(model).__name__ == type(ref).__name__ and model.config.to_dict() == ref.config.to_dict()
    # transformers' own module tree: the same names and modules types, the source left as it was
    assert [(n, type(m)) for n, m in model.named_modules()][1:] == [(n, type(m)) for n, m in ref.named_modules()][1:]
    assert all(p is not q for p, q in zip(model.parameters(), ref.parameters()))
    x, labels = images(), torch.tensor([0, 2])
    want, got = ref(x, labels=labels), model(pixel_values=x, labels=labels)
    assert type(got) is type(want)
    assert_close(got.logits, want.logits, RTOL, name="logits")
    assert_close(got.loss, want.loss, RTOL, name="loss")
    got_tuple = model(x, return_dict=False)
    assert isinstance(got_tuple, tuple) and len(got_tuple) == len(ref(x, return_dict=False))
    assert_close(got_tuple[0], want.logits, RTOL, name="tuple logits")
    hidden = model(x, output_hidden_states=True).hidden_states
    hidden_ref = ref(x, output_hidden_states=True).hidden_states
    assert len(hidden) == len(hidden_ref) == 3
    for i, (h, r) in enumerate(zip(hidden, hidden_ref)):
        assert_close(h, r, RTOL, name=f"hidden_states[{i}]")
    assert model.classifier is model.vit_fast_model.head


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_hf_vit_model_last_hidden_state_and_pooler(backend):
    ref = hf_vit(transformers.ViTModel)
    model = vit_fast.optimize(ref, backend=backend)
    x = images()
    want, got = ref(pixel_values=x), model(x)
    assert type(got) is type(want)
    assert_close(got.last_hidden_state, want.last_hidden_state, RTOL, name="last_hidden_state")
    assert_close(got.pooler_output, want.pooler_output, RTOL, name="pooler_output")
    bare = hf_vit(lambda config: transformers.ViTModel(config, add_pooling_layer=False))
    got, want = vit_fast.optimize(bare, backend=backend)(x), bare(x)
    assert got.pooler_output is None and want.pooler_output is None
    assert_close(got.last_hidden_state, want.last_hidden_state, RTOL, name="last_hidden_state without pooler")
    with pytest.raises(ValueError, match="no classifier"):
        model(x, labels=torch.tensor([0, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_output_attentions_match_the_source(backend):
    """output_attentions: one (B, heads, N, N) map per block, equal to transformers' (eager attention) with
    the same hidden states and logits, and differentiable; refused in training with attention dropout."""
    ref = hf_vit(attn_implementation="eager")
    model = vit_fast.optimize(ref, backend=backend)
    x = images()
    want = ref(x, output_attentions=True, output_hidden_states=True)
    got = model(x, output_attentions=True, output_hidden_states=True)
    assert len(got.attentions) == len(want.attentions) == 2
    for i, (a, r) in enumerate(zip(got.attentions, want.attentions)):
        assert a.shape == r.shape == (2, 2, 5, 5)
        assert_close(a, r, RTOL, name=f"attentions[{i}]")
    assert_close(got.logits, want.logits, RTOL, name="logits")
    assert len(got.hidden_states) == 3 and len(model(x, return_dict=False, output_attentions=True)) == 2
    assert model(x).attentions is None
    got.attentions[-1][:, :, 0, 1:].square().sum().backward()  # a class-token attention loss reaches the weights
    assert model.vit.layers[-1].attention.q_proj.weight.grad.abs().sum() > 0
    dropping = vit_fast.optimize(hf_vit(attention_probs_dropout_prob=0.1), backend=backend).train()
    with pytest.raises(ValueError, match="before dropout"):
        dropping(x, output_attentions=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_interpolate_pos_encoding_matches_the_source(backend):
    """interpolate_pos_encoding=True at other image sizes (non-square, larger and smaller grids, and sizes that are
    not whole patches, whose last pixels transformers' convolution never reads) gives transformers' logits, hidden
    states and gradients (the images' included); at the model's own size it changes nothing; without it another
    size is refused by both."""
    ref = hf_vit(patch_size=8)  # 32 px: a 4x4 grid
    model = vit_fast.optimize(ref, backend=backend)
    for size in [(48, 40), (45, 37), (24, 24), (32, 32)]:
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1), device="cpu")
        x_ref, x = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = ref(x_ref, interpolate_pos_encoding=True, output_hidden_states=True)
        got = model(x, interpolate_pos_encoding=True, output_hidden_states=True)
        assert_close(got.logits, want.logits, RTOL, name=f"logits {size}")
        assert_close(got.hidden_states[0], want.hidden_states[0], RTOL, name=f"embeddings {size}")
        if size in [(48, 40), (45, 37)]:  # the gradient through the interpolation, and the images'
            want.logits.square().sum().backward()
            got.logits.square().sum().backward()
            pos, pos_ref = model.vit.embeddings.position_embeddings, ref.vit.embeddings.position_embeddings
            assert_close(pos.grad, pos_ref.grad, RTOL, name=f"d pos_embed {size}")
            assert_close(x.grad, x_ref.grad, RTOL, name=f"d images {size}")
    for m in (ref, model):
        with pytest.raises(ValueError, match="size"):
            m(torch.randn(2, 3, 48, 40))


def test_gradients_flow_like_the_source():
    """Training through the optimized model: every parameter gradient equals the source model's."""
    ref = timm_vit()
    model = vit_fast.optimize(ref, backend="torch")
    x = images()
    weight = torch.randn(2, 5, generator=torch.Generator().manual_seed(3), device="cpu")
    (ref(x) * weight).sum().backward()
    (model(x) * weight).sum().backward()
    for name, p in model.named_parameters():
        assert_close(p.grad, dict(ref.named_parameters())[name].grad, RTOL, name=f"grad {name}")


def test_dtype_mode_and_frozen_parameters_preserved():
    ref64 = timm_vit().double()
    ref = timm_vit().to(torch.bfloat16).train()
    ref.patch_embed.proj.weight.requires_grad_(False)
    model = vit_fast.optimize(ref)
    assert model.training and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device for p in model.parameters()} == {ref.cls_token.device}
    assert not model.patch_embed.proj.weight.requires_grad and model.head.weight.requires_grad
    with torch.no_grad():
        x = images()
        out64 = ref64(x.double())
        # the guide's rule: within the bf16 bound of float64 and at most 2x the error of timm in bf16
        err, err_eager = errors(model.eval()(x.bfloat16()), out64)[0], errors(ref.eval()(x.bfloat16()), out64)[0]
        assert err <= min(bound(torch.bfloat16, "dot"), 2 * err_eager), (err, err_eager)

    hf = hf_vit()
    hf.vit.layers[0].attention.q_proj.weight.requires_grad_(False)
    hf.vit.layers[1].attention.k_proj.weight.requires_grad_(False)
    hf.vit.layers[1].attention.q_proj.weight.requires_grad_(False)
    hf.vit.layers[1].attention.v_proj.weight.requires_grad_(False)
    out = vit_fast.optimize(hf.half())
    assert not out.training and {p.dtype for p in out.parameters()} == {torch.float16}
    frozen = {n for n, p in out.named_parameters() if not p.requires_grad}  # the same modules, the same flags
    assert frozen == {n for n, p in hf.named_parameters() if not p.requires_grad} and len(frozen) == 4
    assert out(images()).logits.dtype == torch.float16  # float32 pixels are cast, as transformers does


def test_residual_in_fp32_false_keeps_the_stream_in_the_autocast_dtype():
    ref = timm_vit().eval()
    model = vit_fast.optimize(ref, backend="torch", residual_in_fp32=False)
    assert model.residual_in_fp32 is False and model.config.residual_in_fp32 is False
    x = images()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.embed(x).dtype == torch.bfloat16
        assert_close(model(x), ref(x), bound(torch.bfloat16, "dot"), name="bf16-residual logits vs timm autocast")
    assert vit_fast.optimize(model, residual_in_fp32=True).residual_in_fp32 is True


@pytest.mark.parametrize("pool", [dict(), dict(global_pool="avg", fc_norm=False), dict(global_pool="avg"),
                                  dict(global_pool="map", class_token=False)])
def test_features_under_autocast_have_timms_dtype(pool):
    """A feature extractor (num_classes=0) and forward_head(pre_logits=True) under autocast return what timm does:
    fp32 features from its final LayerNorm (the fused final join wrote them in bf16, and a loss against fp32
    targets outside autocast then failed on the dtype), the attention-pool head's own dtype; logits in bf16."""
    for num_classes in (0, 5):
        ref = timm_vit(num_classes=num_classes, **pool)
        model = vit_fast.optimize(ref, backend="triton")
        x = images()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for run in (lambda m: m(x), lambda m: m.forward_head(m.forward_features(x), pre_logits=True)):
                ours, theirs = run(model), run(ref)
                assert ours.dtype == theirs.dtype, (num_classes, pool)
                assert_close(ours.float(), theirs.float(), bound(torch.bfloat16, "dot"), name=f"{pool}")


def test_vit_fast_model_is_switched_in_place():
    model = vit_fast.create_model("vit_tiny_patch16_224", depth=1, img_size=32)
    assert vit_fast.optimize(model, backend="torch") is model and model.config.backend == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix", [dict(class_token=True), dict(class_token=False, reg_tokens=4),
                                    dict(class_token=False, qkv_bias=False)])
def test_attention_pool_reads_the_patch_tokens_as_timm(backend, prefix):
    """global_pool='map' pools the patch tokens only (timm drops the class and register tokens first), with q and
    kv biases whatever the blocks' qkv_bias (timm builds its pool so): same logits and gradients."""
    ref = timm_vit(global_pool="map", patch_size=8, **prefix)
    model = vit_fast.optimize(ref, backend=backend)
    x = images()
    weight = torch.randn(2, 5, generator=torch.Generator().manual_seed(3), device="cpu")
    out, want = model(x), ref(x)
    assert_close(out, want, RTOL, name="logits")
    (out * weight).sum().backward()
    (want * weight).sum().backward()
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert_close(grads[name].grad, p.grad, RTOL, name=f"d {name}")


def test_what_one_config_cannot_express_is_refused_by_name():
    """An attention pool whose MLP runs another activation than vit_fast's pool would (SwiGLU blocks with a SiLU
    act_layer), a block changed by hand, a hybrid stem: refused, each named; a model without blocks converts."""
    silu_pool = timm_vit(global_pool="map", class_token=False, mlp_layer=timm.layers.SwiGLUPacked,
                         act_layer=torch.nn.SiLU)
    with pytest.raises(ValueError, match="attention pooling: its MLP's activation SiLU"):
        vit_fast.optimize(silu_pool)
    edited = timm_vit()
    edited.blocks[1].mlp.act = torch.nn.GELU(approximate="tanh")
    with pytest.raises(ValueError, match="blocks.1: MLP mlp, activation gelu_tanh, 2 heads where blocks.0 has mlp, "
                                         "gelu"):
        vit_fast.optimize(edited)
    hybrid = timm.create_model("vit_base_mci_224", pretrained=False, depth=1, num_classes=5)
    with pytest.raises(ValueError, match="module HybridEmbed"):
        vit_fast.optimize(hybrid)
    no_blocks = timm_vit(depth=0)
    assert_close(vit_fast.optimize(no_blocks, backend="torch")(images()), no_blocks(images()), RTOL, name="depth 0")


@pytest.mark.parametrize("head", [torch.nn.Linear(64, 10), torch.nn.Identity()], ids=["linear", "identity"])
def test_a_head_replaced_by_hand_is_the_head_converted(head):
    """``model.head = ...`` leaves timm's num_classes stale (reset_classifier keeps them in step): the classes are
    read from the head itself."""
    ref = timm_vit()
    ref.head = head
    model = vit_fast.optimize(ref, backend="torch")
    assert_close(model(images()), ref(images()), RTOL, name="logits")


@pytest.mark.parametrize("head", [torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(64, 10)),
                                  torch.nn.LayerNorm(64)], ids=["sequential", "layer_norm"])
def test_a_head_replaced_by_another_module_is_refused_by_name(head):
    """A head of another kind than one Linear (``model.head = nn.Sequential(nn.Dropout(p), nn.Linear(D, C))``, made
    of modules vit_fast takes elsewhere) is refused naming it; it failed in the weight load with a CheckpointError
    listing head.* keys, though no checkpoint was passed."""
    ref = timm_vit()
    ref.head = head
    with pytest.raises(ValueError, match=f"head of type {type(head).__name__} "):
        vit_fast.optimize(ref, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("removed", ["weight", "bias"])
def test_a_layer_norm_made_non_affine_by_hand_runs_as_on_timm(removed, backend):
    """A LayerNorm's weight or bias set to None after optimize (a bias-free norm, as torch's LayerNorm(bias=False))
    is computed as timm computes it on both backends: the kernels read affine norms only, the others run
    F.layer_norm (the Triton path raised the kernel's 'expected weight' error)."""
    ref = timm_vit(init_values=0.1)
    model = vit_fast.optimize(ref, backend=backend)
    for m in (ref, model):
        for norm in (m.blocks[0].norm1, m.blocks[1].norm2, m.norm):
            setattr(norm, removed, None)
    x = images()
    out, want = model(x), ref(x)
    assert_close(out, want, RTOL, name="logits")
    out.square().sum().backward(), want.square().sum().backward()
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert_close(grads[name].grad, p.grad, RTOL, name=f"grad {name}")


@pytest.mark.parametrize("name, cls", [("eva02_tiny_patch14_224", "timm.models.eva.Eva"),
                                       ("vit_relpos_small_patch16_224",
                                        "timm.models.vision_transformer_relpos.VisionTransformerRelPos")])
def test_other_timm_vit_family_is_refused_by_class_with_the_families_taken(name, cls):
    """A timm ViT of another class (Eva, rel-pos) is named with the timm families optimize takes, not with the
    generic refusal that lists every library's classes."""
    other = timm.create_model(name, depth=1, embed_dim=32, num_heads=2, img_size=32, num_classes=5)
    with pytest.raises(ValueError) as info:
        vit_fast.optimize(other)
    message = str(info.value)
    assert message.startswith(f"optimize: {cls} is a timm model family vit_fast does not implement;"), message
    assert "VisionTransformer and VisionTransformerDistilled" in message and "CLIP, SigLIP and DINOv2" in message


def test_unsupported_features_are_listed():
    ref = timm_vit(patch_drop_rate=0.1, pool_include_prefix=True, scale_mlp_norm=True, global_pool="avg")
    with pytest.raises(ValueError) as info:
        vit_fast.optimize(ref)
    message = str(info.value)
    for feature in ("pool_include_prefix", "scale_mlp_norm", "patch dropout"):
        assert feature in message, message
    glu = timm_vit(mlp_layer=timm.layers.GluMlp)  # sigmoid GLU (SwiGLU is supported: tests/test_families.py)
    with pytest.raises(ValueError, match=r"GluMlp: only SwiGLUPacked"):
        vit_fast.optimize(glu)
    with pytest.raises(ValueError, match="expected a timm VisionTransformer"):
        vit_fast.optimize(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"blocks without their LayerNorms \(norm_layer=nn.Identity\)"):
        vit_fast.optimize(timm_vit(norm_layer=torch.nn.Identity))
    with pytest.raises(ValueError, match="backend must be one of"):
        vit_fast.optimize(timm_vit(), backend="cuda")
    with pytest.raises(ValueError, match="bool_masked_pos"):
        vit_fast.optimize(hf_vit())(images(), bool_masked_pos=torch.zeros(2, 4, dtype=torch.bool))


CLASS_PATCHES = {
    "Linear": (torch.nn.Linear, lambda self, x: torch.nn.functional.linear(x, self.weight * 0.5, self.bias)),
    "LayerNorm": (torch.nn.LayerNorm, lambda self, x: 2 * torch.nn.functional.layer_norm(
        x, self.normalized_shape, self.weight, self.bias, self.eps)),
    "GELU": (torch.nn.GELU, lambda self, x: torch.nn.functional.relu(x)),
    "Conv2d": (torch.nn.Conv2d, lambda self, x: self._conv_forward(x, self.weight * 0.5, self.bias)),
    "Dropout": (torch.nn.Dropout, lambda self, x: x * 0.5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("patched", list(CLASS_PATCHES))
def test_a_forward_replaced_on_a_torch_class_applies_as_on_timm(patched, backend, monkeypatch):
    """A library replacing nn.Linear.forward (or GELU's, Conv2d's, Dropout's, LayerNorm's) on the class: timm calls
    the new forward, and so does vit_fast: such a module is called (reading its weights and rates instead is 0.02-0.44
    off); vit_fast's own LayerNorm computes F.layer_norm as timm's does, on both backends."""
    cls, forward = CLASS_PATCHES[patched]
    source = timm_vit().train()  # dropout rates 0: deterministic, but the dropout modules are called in training
    model = vit_fast.optimize(source, backend=backend)
    monkeypatch.setattr(cls, "forward", forward)
    x = images().requires_grad_()
    out, expected = model(x), source(x)
    assert_close(out, expected, RTOL, name=f"logits, {patched}.forward replaced")
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), source.parameters()):
        assert_close(p.grad, q.grad, RTOL, name=f"{name}'s gradient, {patched}.forward replaced")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_stripped_or_set_per_block_by_hand_keeps_each_blocks_rates(backend):
    """Dropouts replaced by nn.Identity (head_drop, pos_drop, every block's attn_drop: stripped by hand) and rates set
    on one block: optimize converts the model (an Identity raised AttributeError: 'Identity' object has no attribute
    'p'), every dropout at its source's rate (0 for an Identity; block 0's rates were applied to every block), and
    the logits are timm's."""
    source = timm_vit(drop_rate=0.1, pos_drop_rate=0.1, attn_drop_rate=0.1)
    source.head_drop, source.pos_drop = torch.nn.Identity(), torch.nn.Identity()
    for block in source.blocks:
        block.attn.attn_drop = torch.nn.Identity()
    source.blocks[1].attn.proj_drop.p, source.blocks[1].mlp.drop2.p = 0.3, 0.25
    model = vit_fast.optimize(source, backend=backend)
    rates = {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert {"head_drop", "pos_drop", "blocks.0.attn.attn_drop", "blocks.1.mlp.drop2"} <= set(rates)
    for name, rate in rates.items():
        theirs = source.get_submodule(name)
        assert rate == (0.0 if isinstance(theirs, torch.nn.Identity) else theirs.p), name
    assert rates["blocks.1.attn.proj_drop"] == 0.3 and rates["blocks.0.attn.proj_drop"] == 0.0
    with torch.no_grad():
        assert_close(model(images()), source(images()), RTOL, name="logits")


def test_a_patch_convolution_other_than_a_patchify_is_refused_by_name():
    """The converters rebuild the patch convolution as kernel = stride = patch: one with padding is refused by name
    (converted without it, logits would be 0.17 off timm)."""
    timm_model, tv = timm_vit(), torchvision_vit()
    timm_model.patch_embed.proj = torch.nn.Conv2d(3, 64, 16, 16, padding=2)
    tv.conv_proj = torch.nn.Conv2d(3, 64, 16, 16, dilation=1, padding=(0, 2))
    for model in (timm_model, tv):
        with pytest.raises(ValueError, match=r"a patch convolution other than kernel = stride = \(16, 16\).*padding"):
            vit_fast.optimize(model)


def test_hooks_or_forwards_set_on_a_source_that_is_rebuilt_are_refused_by_name():
    """timm and torchvision models are rebuilt of new modules: a hook or a forward set on a source module (a feature
    hook, torch's weight_norm pre-hook, accelerate's hooks) would be dropped: it is refused by name. A transformers
    model keeps its own modules, hooks included."""
    hooked, patched, tv = timm_vit(), timm_vit(), torchvision_vit()
    hooked.blocks[1].register_forward_hook(lambda m, args, out: out * 2)
    patched.blocks[0].mlp.forward = lambda x: x
    tv.encoder.layers[0].mlp.register_forward_pre_hook(lambda m, args: None)
    for model, where in ((hooked, "'blocks.1'"), (patched, "'blocks.0.mlp'"),
                         (tv, "'encoder.layers.encoder_layer_0.mlp'")):
        with pytest.raises(ValueError, match=f"hooks or a forward set on the instance on {where}"):
            vit_fast.optimize(model)
    source = hf_vit()
    calls = []
    source.vit.layers[0].mlp.register_forward_hook(lambda m, args, out: calls.append(1))
    with torch.no_grad():
        vit_fast.optimize(source, backend="torch")(images())
    assert calls == [1]


def test_triton_backend_without_kernels_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a CPU-only machine outside the test suite
    with pytest.raises(RuntimeError, match="backend='triton' needs a model on CUDA"):
        vit_fast.optimize(timm_vit(), backend="triton")


@pytest.mark.parametrize("name", ["vit_base_patch16_xp_224", "vit_relpos_base_patch16_224",
                                  "vit_base_patch16_rope_reg1_gap_256"])
def test_other_block_kinds_are_listed_not_crashed_on(name):
    """Parallel-scaling blocks (a VisionTransformer with blocks lacking .attn), rel-pos and rope ViTs (other
    classes): timm_unsupported lists what is missing, optimize and from_timm refuse with that list."""
    from vit_fast.interop.optimize import timm_unsupported

    ref = timm.create_model(name, pretrained=False, img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=1,
                            num_classes=5)
    problems = timm_unsupported(ref)
    assert problems and all(isinstance(p, str) for p in problems)
    expected = "ParallelScalingBlock" if "xp" in name else type(ref).__name__
    assert any(expected in p for p in problems), problems
    with pytest.raises(ValueError, match=expected):
        vit_fast.optimize(ref)
    with pytest.raises(ValueError, match=expected):
        vit_fast.from_timm(ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rectangular_patch_runs_as_on_the_source(backend):
    """A rectangular patch (timm's patch_size=(8, 4), transformers' [16, 8]): the patch embedding runs as the
    source's convolution (the kernel takes square patches), the rest on the chosen path; the same logits and
    gradients (the images' included). The Triton path raised at the first forward on transformers' and refused
    timm's."""
    for ref in (timm_vit(patch_size=(8, 4)), hf_vit(patch_size=[16, 8])):
        model = vit_fast.optimize(ref, backend=backend)
        x_ref, x = images().requires_grad_(), images().requires_grad_()
        out_ref, out = ref(x_ref), model(x)
        out_ref, out = (getattr(o, "logits", o) for o in (out_ref, out))
        assert_close(out, out_ref, RTOL, name=f"{type(ref).__name__} logits")
        out_ref.square().sum().backward()
        out.square().sum().backward()
        assert_close(x.grad, x_ref.grad, RTOL, name=f"{type(ref).__name__} d images")
        grads = {n: p.grad for n, p in model.named_parameters()}
        for name, p in ref.named_parameters():
            if name in grads and p.grad.abs().max() < 1e-6:  # the key bias's: 0 but for rounding (softmax's shift)
                assert grads[name].abs().max() < 1e-6, name
            elif name in grads:
                assert_close(grads[name], p.grad, RTOL, name=f"{type(ref).__name__} d {name}")


def test_converter_gives_its_problems_as_a_list():
    from vit_fast.interop.convert import timm_unsupported

    assert timm_unsupported(timm_vit()) == []
    problems = timm_unsupported(timm_vit(patch_drop_rate=0.1, global_pool="avg", pool_include_prefix=True))
    assert "patch dropout (patch_drop_rate > 0)" in problems and "pool_include_prefix=True" in problems
    assert timm_unsupported(timm_vit(pre_norm=True)) == []  # CLIP's pre-norm converts (tests/test_families.py)
    # what the kernels cannot take is refused at conversion, not at the first fused forward
    assert timm_unsupported(timm_vit(patch_size=(8, 4))) == []  # its patch embedding runs as a convolution
    assert timm_unsupported(timm_vit(embed_dim=256, num_heads=1)) == [
        "head_dim 256 (the fused attention kernels take 1..128)"]
    assert timm_unsupported(timm_vit(norm_layer=functools.partial(torch.nn.LayerNorm, eps=0.0))) == [
        "LayerNorm eps <= 0 (the LayerNorm kernels need eps > 0)"]
