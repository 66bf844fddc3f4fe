"""The fused model (backend='triton', kernels in the Triton interpreter on CPU) against the reference.

Tiny ViTs (depth 2, width 64, 4 heads, 32x32 images, patch 8): logits and every parameter gradient,
the dropout / drop-path paths, AMP, AdamW trajectories, activation checkpointing and torch.compile.
"""
import collections
import copy
import warnings

import pytest
import torch

import vit_fast
from vit_fast._compat import monkeypatch_setting  # torch settings served by __getattr__
from vit_fast.layers import DropPath

from .numerics import assert_close, bound, errors
from .test_backend import OpLog

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
VARIANT = dict(TINY, global_pool="avg", reg_tokens=2, no_embed_class=True, init_values=0.1, drop_path_rate=0.5)
FP32 = bound(torch.float32, "dot")


def make_pair(seed: int = 0, **config):
    """(fused, reference) models with the same random weights (biases and LayerNorm affine made non-trivial)."""
    torch.manual_seed(seed)
    ref = vit_fast.VisionTransformer(**config, backend="torch")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name or name in ("cls_token", "reg_token"):
                p.add_(0.1 * torch.randn_like(p))
    return copy.deepcopy(ref).set_backend("triton"), ref


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().square().mean()


def compare_grads(fused, ref, rtol, atol=None):
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        if q.grad.norm() < 1e-9:  # mathematically zero (k_norm.bias: softmax ignores a shift of all keys)
            assert p.grad.abs().max() < 1e-7, name
            continue
        assert_close(p.grad, q.grad, rtol, name, atol)


def test_fused_matches_reference_fp32_and_launches_what_the_readme_says():
    fused, ref = make_pair(**TINY)
    ref = ref.double()
    x = torch.randn(2, 3, 32, 32)
    with OpLog() as fwd:
        out = fused(x)
    out_ref = ref(x.double())
    assert_close(out, out_ref, FP32, "logits")
    with OpLog() as bwd:
        loss_of(out).backward()
    loss_of(out_ref).backward()
    compare_grads(fused, ref, FP32)
    depth = 2
    assert sorted(fwd.kernels()) == sorted(["patch_embed_fwd"] + ["add_layer_norm_fwd"] * (1 + 2 * depth)
                                           + ["attention_fwd", "linear_act_fwd"] * depth)
    assert sorted(bwd.kernels()) == sorted(["patch_embed_bwd"] + ["add_layer_norm_bwd"] * (1 + 2 * depth)
                                           + ["attention_bwd", "linear_act_bwd"] * depth)
    # backward cuBLAS GEMMs: dX and dW of qkv, proj and fc1 and fc2's dW per block (fc2's dgrad is linear_act_bwd)
    # + the head's 2; one aten reduction, the head bias: every other bias / LayerNorm grad comes from the kernels.
    counts = collections.Counter(bwd.compute_aten())
    assert counts["mm"] == 7 * depth + 2 and counts["sum"] == 1, counts
    # per block forward: the qkv GEMM with its bias, proj / fc2 without (fc1 is linear_act's); the head's addmm
    assert sorted(fwd.compute_aten()) == sorted(["addmm"] * (1 + depth) + ["mm"] * (2 * depth))


@pytest.mark.parametrize("config", [dict(TINY), dict(TINY, reg_tokens=2, init_values=0.1)], ids=["cls", "cls_reg_ls"])
def test_class_token_pooling_runs_the_last_block_on_token_0_only(monkeypatch, config):
    """forward() under class-token pooling: the last block's proj, joins and MLP see B rows, not B * N,
    and logits and every gradient equal the full-token path's (forward_features + head)."""
    fused, _ = make_pair(**config)
    full = copy.deepcopy(fused)
    x = torch.randn(3, 3, 32, 32)
    rows = []
    original = vit_fast.layers.Mlp.branch

    def recording(self, h):
        rows.append(h.shape[:-1].numel())
        return original(self, h)

    monkeypatch.setattr(vit_fast.layers.Mlp, "branch", recording)
    out = fused(x)
    tokens = 1 + config.get("reg_tokens", 0) + 16
    assert rows == [3 * tokens, 3], rows
    out_full = full.forward_head(full.forward_features(x))
    assert_close(out, out_full, FP32, "logits")
    loss_of(out).backward()
    loss_of(out_full).backward()
    compare_grads(fused, full, FP32)


def _step_both(fused, ref, x):
    """One training step of each model, gradients fresh."""
    for model in (fused, ref):
        model.zero_grad(set_to_none=True)
        loss_of(model(x)).backward()


class _Halve(torch.nn.Module):
    def forward(self, x):
        return 0.5 * x


def test_dropout_modules_obey_their_own_mode_and_replacements_are_called():
    """The fused joins drop by each dropout module's own mode, as torch does: put in eval by hand in a training
    model they drop nothing (the fused path dropped anyway: random logits); left training in an eval model (MC
    dropout) they drop (it never did). A module in a dropout's place is called (an Identity or another module: an
    AttributeError on .p). Forward and gradients as the reference path's, the one-Function block included."""
    fused, ref = make_pair(**dict(TINY, proj_drop_rate=0.3))
    x = torch.randn(3, 3, 32, 32)
    dropouts = [name for name, m in ref.named_modules() if type(m) is torch.nn.Dropout and m.p > 0]
    assert any(".attn.proj_drop" in n for n in dropouts) and any(".mlp.drop2" in n for n in dropouts)
    for model in (fused, ref):
        model.train()
        for name in dropouts:
            model.get_submodule(name).eval()
    for _ in range(2):  # the second step: the one-Function block where it runs
        _step_both(fused, ref, x)
        assert_close(fused(x), ref(x), 1e-5)
        compare_grads(fused, ref, 1e-4)

    for model in (fused, ref):  # MC dropout: an eval model with its dropout modules training
        model.eval()
        for name in dropouts:
            model.get_submodule(name).train()
    with torch.no_grad():
        a, b = fused(x), fused(x)
        mean = ref(x)
    assert not torch.equal(a, b) and not torch.equal(a, mean)

    for model in (fused, ref):
        model.train()
        for block in model.blocks:
            block.attn.proj_drop, block.mlp.drop1, block.mlp.drop2 = _Halve(), torch.nn.Identity(), _Halve()
    for _ in range(2):  # the second step: the one-Function block where it runs
        _step_both(fused, ref, x)
        assert_close(fused(x), ref(x), 1e-5)
        compare_grads(fused, ref, 1e-4)


class _ClampedLayerScale(vit_fast.layers.block.LayerScale):
    def forward(self, x):
        return x * self.gamma.clamp(max=0.05)


@pytest.mark.parametrize("replace", ["relu_act", "silu_act", "swiglu_gelu_act", "rms_qk_norm", "scaled_q",
                                     "timm_layer_scale", "layer_scale_subclass", "timm_drop_path"])
def test_modules_put_in_place_of_the_activation_or_qk_norm_are_applied(replace):
    """An MLP activation, a q/k norm, a LayerScale or a drop-path replaced by hand (another activation, RMSNorm,
    timm's LayerScale / DropPath, a subclass with its own forward, any module) runs on the fused path as on the
    reference path: the kernels applied the activation named at construction, skipped any q/k norm that was not a
    LayerNorm and read only vit_fast's own LayerScale / DropPath, silently. Forward and gradients, the one-Function
    block's second call too."""
    import timm.layers

    config = dict(TINY, mlp_layer="swiglu") if replace == "swiglu_gelu_act" else TINY
    fused, ref = make_pair(**config)
    for model in (fused, ref):
        for block in model.blocks:
            if replace == "relu_act":
                block.mlp.act = torch.nn.ReLU()
            elif replace == "silu_act":
                block.mlp.act = torch.nn.SiLU()
            elif replace == "swiglu_gelu_act":
                block.mlp.act = torch.nn.GELU()
            elif replace == "rms_qk_norm":
                block.attn.q_norm = torch.nn.RMSNorm(block.attn.head_dim, eps=1e-6)
                block.attn.k_norm = torch.nn.RMSNorm(block.attn.head_dim, eps=1e-6)
            elif replace == "scaled_q":
                block.attn.q_norm = _Halve()
            elif replace == "timm_layer_scale":
                block.ls1 = timm.layers.LayerScale(64, 0.1)
            elif replace == "layer_scale_subclass":
                block.ls2 = _ClampedLayerScale(64, 1.0)
            else:
                block.drop_path1 = timm.layers.DropPath(1.0)  # every sample dropped: the same draw on both paths
    x = torch.randn(3, 3, 32, 32)
    for _ in range(2):  # the second step: the one-Function block where it runs
        _step_both(fused, ref, x)
        assert_close(fused(x), ref(x), 1e-5)
        compare_grads(fused, ref, 1e-4)


def test_class_token_pooling_keeps_every_row_while_the_last_block_draws_dropout_masks(monkeypatch):
    """Proj/MLP dropout masks are drawn per row: in training with proj dropout the last block runs on every
    token, and forward() draws the same masks as forward_features + head (bitwise, same seed). Drop-path
    (one value per image) and attention dropout (over every token) keep the pruning, with the full path's
    logits and gradients under the same seed."""
    rows = []
    original = vit_fast.layers.Mlp.branch
    monkeypatch.setattr(vit_fast.layers.Mlp, "branch", lambda self, h: rows.append(h.shape[:-1].numel()) or
                        original(self, h))
    x = torch.randn(3, 3, 32, 32)
    fused, _ = make_pair(**TINY, proj_drop_rate=0.2)
    torch.manual_seed(5)
    out = fused(x)
    assert rows == [3 * 17, 3 * 17], rows
    torch.manual_seed(5)
    assert torch.equal(out, fused.forward_head(fused.forward_features(x)))
    fused.eval()
    rows.clear()
    fused(x)
    assert rows == [3 * 17, 3], "eval draws no mask: the last block runs on token 0 again"

    fused, _ = make_pair(**TINY, drop_path_rate=0.5, attn_drop_rate=0.2)
    full = copy.deepcopy(fused)
    rows.clear()
    torch.manual_seed(6)
    out = fused(x)
    assert rows == [3 * 17, 3], rows
    torch.manual_seed(6)
    out_full = full.forward_head(full.forward_features(x))
    assert_close(out, out_full, FP32, "logits with drop-path and attention dropout")
    loss_of(out).backward()
    loss_of(out_full).backward()
    compare_grads(fused, full, FP32)


def test_hooks_anywhere_in_the_blocks_fire_with_the_same_result():
    """The fused chain calls Block.forward_pair, GEMMs and kernels directly; a hook on a block, on a part of
    it (attention, fc1) or a full backward hook makes the model call those modules, with the same result."""
    fused, _ = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32)
    out = fused(x)
    loss_of(out).backward()
    for where in ("blocks.1", "blocks.1.attn", "blocks.0.mlp.fc1", "backward:blocks.0", "norm", "blocks",
                  "blocks.0.mlp.drop1"):
        hooked = copy.deepcopy(fused)
        hooked.zero_grad()
        seen = []
        module = hooked.get_submodule(where.removeprefix("backward:"))
        if where.startswith("backward:"):
            module.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_out[0].shape))
        else:
            module.register_forward_hook(lambda m, args, output: seen.append(output.shape))
        out_hooked = hooked(x)
        loss_of(out_hooked).backward()
        assert len(seen) == 1, (where, seen)
        assert_close(out_hooked, out, FP32, f"logits, hook on {where}")
        compare_grads(hooked, fused, FP32)


def test_a_hook_that_changes_the_final_norms_output_is_applied():
    """The last join computes the final norm in its kernel only while calling it would do no more: a forward hook
    that edits its output (and torch's pruning, a pre-hook recomputing the weight) must run, as on timm."""
    fused, ref = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32)
    for model in (fused, ref):  # token-dependent: class-token pooling must not hand it the class token alone
        model.norm.register_forward_hook(lambda m, args, output: output * 2.0 + output.mean(1, keepdim=True))
    out, expected = fused(x), ref(x)
    assert_close(out, expected, FP32, "logits, hook editing the final norm's output")
    loss_of(out).backward()
    loss_of(expected).backward()
    compare_grads(fused, ref, FP32)


@pytest.mark.parametrize("where", ["blocks.1", "blocks.0.mlp", "blocks.0.attn.qkv", "blocks.1.mlp.act", "norm",
                                   "patch_embed.proj", "blocks.0.attn.q_norm", "blocks"])
def test_a_forward_set_on_a_module_instance_runs_as_on_the_reference(where):
    """A forward set on a module instance (accelerate's hooks, which move offloaded weights in, do this; so does a
    user's patch) is called as torch calls it: the fused paths read such a module's weights or skip it (an
    Identity q_norm) as if it had its class's forward (0.1-0.6 off)."""
    fused, ref = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32)
    for model in (fused, ref):
        module = model.get_submodule(where)
        module.forward = (lambda original: lambda *args, **kwargs: 0.5 * original(*args, **kwargs) + 0.1)(
            module.forward)
    out, expected = fused(x), ref(x)
    assert_close(out, expected, FP32, f"logits, a forward set on {where}")
    loss_of(out).backward()
    loss_of(expected).backward()
    compare_grads(fused, ref, FP32)


def test_the_class_forward_set_back_on_an_instance_keeps_the_fused_chain():
    """accelerate's remove_hook_from_module leaves the class's own forward, bound, on the instance: that module's
    calls do nothing more than its class's, so the blocks still run as the fused chain, and optimize accepts it."""
    fused, ref = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32)
    for model in (fused, ref):
        mlp = model.blocks[0].mlp
        mlp.forward = mlp.forward  # what remove_hook_from_module does: module.forward = module._old_forward
    assert "forward" in fused.blocks[0].mlp.__dict__ and fused._fuses_across_blocks(fused.embed(x))
    assert_close(fused(x), ref(x), FP32, "logits, the class's forward set back")
    vit_fast.optimize(fused, backend="triton")


def test_parametrized_weights_are_read_once_per_forward_as_on_the_reference():
    """torch.nn.utils.parametrize computes a weight at each read; the fused paths read some several times per forward
    (twice for qkv, fc1, the norms), so spectral_norm's power iteration, which advances at every read in training,
    drifted from timm's (logits 2e-4, qkv gradients 3.5e-3 off). A parametrized module is called instead."""
    from torch.nn.utils import parametrizations, parametrize

    class Count(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.reads = 0

        def forward(self, weight):
            self.reads += 1
            return weight
    sites = ["patch_embed.proj", "blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.0.norm1", "blocks.1.norm2", "norm"]
    x = torch.randn(2, 3, 32, 32)
    fused, ref = make_pair(**TINY)
    for model in (fused, ref):
        for site in sites:
            parametrize.register_parametrization(model.get_submodule(site), "weight", Count())
    for model in (fused, ref):
        for site in sites:
            model.get_submodule(site).parametrizations.weight[0].reads = 0  # registering reads it once
        for _ in range(2):
            loss_of(model(x)).backward()
    reads = [{site: m.get_submodule(site).parametrizations.weight[0].reads for site in sites} for m in (fused, ref)]
    assert reads[0] == reads[1] == {site: 2 for site in sites}, reads
    fused, ref = make_pair(**TINY)
    for model in (fused, ref):
        torch.manual_seed(5)
        parametrizations.spectral_norm(model.blocks[0].attn.qkv)
        model.train()
    for _ in range(2):
        out, expected = fused(x), ref(x)
        assert_close(out, expected, FP32, "logits, spectral_norm on qkv in training")
    loss_of(out).backward()
    loss_of(expected).backward()
    compare_grads(fused, ref, FP32)


def test_a_patch_convolution_that_is_not_a_patchify_runs_as_a_module():
    """A patch projection with padding (the same patch grid) or a Conv2d subclass overriding ``_conv_forward``
    (weight standardisation) runs as a module: the patch-embedding kernel assumes kernel = stride = patch, no
    padding, and would ignore its own convolution (logits 0.01-0.17 off)."""
    class Standardised(torch.nn.Conv2d):
        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, (weight - weight.mean()) / weight.std(), bias)

    x = torch.randn(2, 3, 32, 32)
    for what in ("padding", "_conv_forward"):
        fused, ref = make_pair(**TINY)
        for model in (fused, ref):
            old = model.patch_embed.proj
            conv = (torch.nn.Conv2d(3, 64, 8, 8, padding=2) if what == "padding" else Standardised(3, 64, 8, 8))
            with torch.no_grad():
                conv.weight.copy_(old.weight[:, :, :conv.weight.shape[2], :conv.weight.shape[3]])
                conv.bias.copy_(old.bias)
            model.patch_embed.proj = conv
        out, expected = fused(x), ref(x)
        assert_close(out, expected, FP32, f"logits, patch convolution with {what}")
        loss_of(out).backward()
        loss_of(expected).backward()
        compare_grads(fused, ref, FP32)


def test_blocks_that_are_not_vit_fasts_run_as_modules():
    """A block replaced by timm's Block or nn.Identity runs (an AttributeError on the fused chain), and torch's
    checkpoint_wrapper around each block checkpoints it (the chain called the inner block's forward_pair: nothing
    was recomputed, every activation kept)."""
    from timm.models.vision_transformer import Block as TimmBlock
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    fused, ref = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32)
    for replacement in (TimmBlock(64, 4, qkv_bias=True), torch.nn.Identity()):
        fused.blocks[1], ref.blocks[1] = copy.deepcopy(replacement), copy.deepcopy(replacement)
        assert_close(fused(x), ref(x), FP32, f"logits with {type(replacement).__name__} as block 1")

    class Half(torch.nn.Module):  # an adapter around a part (AdaptFormer, VPT-deep style)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 0.5 * self.inner(x)
    for where in ("blocks.0.attn", "blocks.0.mlp", "patch_embed.proj"):  # AttributeErrors: 'branch', 'weight'
        fused, ref = make_pair(**TINY)
        for model in (fused, ref):
            parent, name = where.rsplit(".", 1)
            setattr(model.get_submodule(parent), name, Half(model.get_submodule(where)))
        assert_close(fused(x), ref(x), FP32, f"logits with {where} wrapped")
    from vit_fast.layers import Attention, Block, Mlp, PatchEmbed

    def scaled_forward(cls):  # a user's subclass with a forward of its own
        def forward(self, *args, **kwargs):
            return 1.5 * cls.forward(self, *args, **kwargs)
        return type("Scaled" + cls.__name__, (cls,), {"forward": forward})
    for where, cls in (("blocks.1", Block), ("blocks.0.attn", Attention), ("blocks.0.mlp", Mlp),
                       ("patch_embed", PatchEmbed)):
        fused, ref = make_pair(**TINY)
        for model in (fused, ref):
            model.get_submodule(where).__class__ = scaled_forward(cls)
        assert_close(fused(x), ref(x), FP32, f"logits with {where} subclassed")
    fused, ref = make_pair(**TINY)
    for model in (fused, ref):
        model.blocks[0].attn.attn_drop = torch.nn.Identity()  # an AttributeError on .p
    assert_close(fused(x), ref(x), FP32, "logits with attn_drop an Identity")
    fused, ref = make_pair(**TINY)
    for model in (fused, ref):  # the patch kernel adds the position embedding: a norm put in before it was skipped
        torch.manual_seed(3)
        model.patch_embed.norm = torch.nn.LayerNorm(64, elementwise_affine=False)
    assert_close(fused(x), ref(x), FP32, "logits with a patch norm put in")

    fused, _ = make_pair(**TINY)
    saved = []

    def count(t):
        saved.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        expected = fused(x)
    kept_whole = sum(saved)
    for i, blk in enumerate(fused.blocks):
        fused.blocks[i] = checkpoint_wrapper(blk)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        out = fused(x)
    assert sum(saved) < kept_whole / 2, (sum(saved), kept_whole)
    assert_close(out, expected, FP32, "logits, every block checkpoint-wrapped")


@pytest.mark.filterwarnings("error:FSDP2-wrapped module")
def test_fsdp2_fully_shard_per_block_on_the_triton_backend(tmp_path):
    """fully_shard gathers parameters in each block's pre-forward hook: one gloo rank, same logits and
    gradients as the unsharded model. A block's output is not a view (FSDP2 warns on views)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    fused, _ = make_pair(**TINY)
    sharded = copy.deepcopy(fused)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        finer = copy.deepcopy(sharded)
        for blk in sharded.blocks:
            fully_shard(blk)
        fully_shard(sharded)
        for blk in finer.blocks:  # a finer wrapping: attention and MLP of each block
            fully_shard(blk.attn)
            fully_shard(blk.mlp)
        fully_shard(finer)
        x = torch.randn(2, 3, 32, 32)
        out = fused(x)
        loss_of(out).backward()
        for model in (sharded, finer):
            with warnings.catch_warnings():
                # nn.Linear returns a view of its 2-D GEMM output for 3-D input: FSDP2 warns on attention and
                # MLP units whatever the model (timm's too); the block units must not warn (their output is ours)
                warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(FSDP(Attention|Mlp)\)")
                out_sharded = model(x)
            assert_close(out_sharded, out, FP32, "logits")
            loss_of(out_sharded).backward()
            for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters()):
                assert_close(p.grad.full_tensor(), q.grad, FP32, name, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_variant_avg_pool_reg_tokens_layerscale_drop_path_train():
    fused, ref = make_pair(**VARIANT)
    fused.train(), ref.train()
    scales = []
    original = DropPath.sample_scale

    def recording(self, branch):
        s = original(self, branch)
        scales.append(s)
        return s

    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(123)
    out_ref = ref(x)
    torch.manual_seed(123)
    DropPath.sample_scale = recording
    try:
        out = fused(x)
    finally:
        DropPath.sample_scale = original
    kept = torch.cat([s for s in scales if s is not None])
    assert (kept == 0).any() and (kept == 2).any(), "the seed must drop some samples and keep others"
    assert_close(out, out_ref, FP32, "logits")
    loss_of(out).backward()
    loss_of(out_ref).backward()
    compare_grads(fused, ref, FP32)


@pytest.mark.parametrize("overrides", [
    dict(pos_embed="none", class_token=False, global_pool="avg", fc_norm=False),
    dict(dynamic_img_size=True, qk_norm=True, act="gelu_tanh", reg_tokens=1),
    dict(pos_embed="sincos", final_norm=False, init_values=1e-2),
], ids=["no_pos_no_cls", "dynamic_qknorm_tanh", "sincos_no_final_norm"])
def test_more_configs_forward_backward(overrides):
    fused, ref = make_pair(**{**TINY, "depth": 1, **overrides})
    ref = ref.double()
    size = (40, 24) if overrides.get("dynamic_img_size") else (32, 32)
    x = torch.randn(2, 3, *size)
    out, out_ref = fused(x), ref(x.double())
    assert_close(out, out_ref, FP32, "logits")
    loss_of(out).backward()
    loss_of(out_ref).backward()
    compare_grads(fused, ref, FP32)


def test_attention_maps_on_the_fused_model():
    fused, ref = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32)
    maps, maps_ref = fused.get_attention_maps(x, [0, -1]), ref.get_attention_maps(x, [0, -1])
    for i in (0, 1):
        assert_close(maps[i], maps_ref[i], FP32, f"attention map {i}")


@pytest.mark.parametrize("residual_in_fp32", [True, False], ids=["fp32_residual", "bf16_residual"])
def test_autocast_bf16_matches_reference_under_autocast(monkeypatch, residual_in_fp32):
    """Both paths under autocast, against fp64; with residual_in_fp32=False both keep the residual stream
    (the tokens entering the blocks and every join) in bf16. The first LayerNorm hands the qkv GEMM bf16
    straight from its kernel either way."""
    fused, ref = make_pair(**TINY, residual_in_fp32=residual_in_fp32)
    ref64 = copy.deepcopy(ref).double()
    x = torch.randn(2, 3, 32, 32)
    first_norm = []
    original = vit_fast.layers.norm.layer_norm_and_input
    monkeypatch.setattr(vit_fast.layers.norm, "layer_norm_and_input", lambda *args: first_norm.append(
        original(*args)) or first_norm[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stream = torch.float32 if residual_in_fp32 else torch.bfloat16
        assert fused.embed(x).dtype == ref.embed(x).dtype == stream
        out, out_ref = fused(x), ref(x)
    assert [(normed.dtype, tokens.dtype) for normed, tokens in first_norm] == [(torch.bfloat16, stream)]
    assert out.dtype == out_ref.dtype == torch.bfloat16
    out64 = ref64(x.double())
    err, err_eager = errors(out, out64)[0], errors(out_ref, out64)[0]
    assert err <= max(2 * err_eager, 1e-3) and err <= bound(torch.bfloat16, "dot"), (err, err_eager)
    loss_of(out).backward()
    loss_of(out_ref).backward()
    loss_of(out64).backward()
    for (name, p), (_, q), (_, r) in zip(fused.named_parameters(), ref.named_parameters(), ref64.named_parameters()):
        assert p.grad.dtype == torch.float32, name  # fp32 parameter grads
        err, err_eager = errors(p.grad, r.grad)[0], errors(q.grad, r.grad)[0]
        # the 2x-of-eager rule; the dtype's bound caps it where eager itself sits well inside that bound (a
        # LayerNorm weight's bf16 gradient, summed over every row in bf16, reaches ~0.98e-2 in eager here)
        cap = max(bound(torch.bfloat16, "dot"), 1.25 * err_eager)
        assert err <= max(2 * err_eager, 2e-3) and err <= cap, (name, err, err_eager)


def test_pure_bf16_model():
    fused, ref = make_pair(**{**TINY, "depth": 1})
    ref64 = copy.deepcopy(ref).double()
    fused, ref = fused.bfloat16(), ref.bfloat16()
    x = torch.randn(2, 3, 32, 32)
    out, out_ref, out64 = fused(x.bfloat16()), ref(x.bfloat16()), ref64(x.double())
    assert out.dtype == torch.bfloat16
    err, err_eager = errors(out, out64)[0], errors(out_ref, out64)[0]
    assert err <= max(2 * err_eager, 1e-3) and err <= bound(torch.bfloat16, "dot"), (err, err_eager)
    for model, y in ((fused, out), (ref, out_ref), (ref64, out64)):
        loss_of(y).backward()
    for (name, p), (_, q), (_, r) in zip(fused.named_parameters(), ref.named_parameters(), ref64.named_parameters()):
        assert p.grad.dtype == torch.bfloat16, name
        err, err_eager = errors(p.grad, r.grad)[0], errors(q.grad, r.grad)[0]
        # the 2x-of-eager rule; the dtype's bound caps it where eager itself sits well inside that bound (a
        # LayerNorm weight's bf16 gradient, summed over every row in bf16, reaches ~0.98e-2 in eager here)
        cap = max(bound(torch.bfloat16, "dot"), 1.25 * err_eager)
        assert err <= max(2 * err_eager, 2e-3) and err <= cap, (name, err, err_eager)


@pytest.mark.parametrize("amp,residual_in_fp32", [(False, True), (True, True), (True, False)],
                         ids=["fp32", "bf16_autocast", "bf16_autocast_bf16_residual"])
def test_five_adamw_steps_fused_vs_reference(amp, residual_in_fp32):
    # depth 1: five interpreted steps stay cheap
    fused, ref = make_pair(**{**TINY, "depth": 1, "residual_in_fp32": residual_in_fp32})
    torch.manual_seed(1)
    batches = [(torch.randn(1, 3, 32, 32), torch.randint(0, 10, (1,)))] * 5  # one batch: the loss must fall
    losses = {}
    for name, model in (("fused", fused), ("ref", ref)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        losses[name] = []
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    fused_l, ref_l = torch.tensor(losses["fused"]), torch.tensor(losses["ref"])
    assert (ref_l[-1] < ref_l[0]), "training must make progress for the comparison to mean anything"
    assert_close(fused_l, ref_l, bound(torch.bfloat16 if amp else torch.float32, "dot"), "loss trajectory")


def test_grad_checkpointing_with_dropout_gives_identical_gradients():
    config = dict(TINY, attn_drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.3, pos_drop_rate=0.1)
    fused, _ = make_pair(**config)
    fused.train()
    x = torch.randn(1, 3, 32, 32)
    results = []
    for checkpointing in (False, True):
        fused.zero_grad()
        fused.set_grad_checkpointing(checkpointing)
        torch.manual_seed(7)
        out = fused(x)
        loss_of(out).backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in fused.named_parameters()}))
    (out_plain, grads_plain), (out_ckpt, grads_ckpt) = results
    with torch.no_grad():
        torch.manual_seed(8)
        assert not torch.equal(fused(x), out_plain), "dropout must be active (another seed, another output)"
    assert torch.equal(out_ckpt, out_plain)
    for name, g in grads_plain.items():
        assert torch.equal(grads_ckpt[name], g), name


def test_torch_compile_fullgraph_matches_eager():
    fused, _ = make_pair(**{**TINY, "depth": 1, "init_values": 0.1})
    # depth 1 gets drop-path rate 0 from the linear rule: put it in by hand (the draw is traced too)
    fused.blocks[0].drop_path1, fused.blocks[0].drop_path2 = DropPath(0.5), DropPath(0.5)
    fused.train()
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(5)
    out = fused(x)
    loss_of(out).backward()
    grads = {n: p.grad.clone() for n, p in fused.named_parameters()}
    fused.zero_grad()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    torch.manual_seed(5)
    out_c = compiled(x)
    loss_of(out_c).backward()
    assert torch.equal(out_c, out)
    for name, p in fused.named_parameters():
        assert torch.equal(p.grad, grads[name]), name


def test_torch_compile_with_dropout_fullgraph(monkeypatch):
    """The kernels' dropout seed is a tensor drawn in the graph (kernels/_utils.next_seed) and read only
    inside the custom ops: the block compiles fullgraph without capture_scalar_outputs and matches eager."""
    monkeypatch_setting(monkeypatch, torch._dynamo.config, "capture_scalar_outputs", False)
    torch.manual_seed(0)
    blk = vit_fast.Block(64, 4, proj_drop=0.2, attn_drop=0.1, backend="triton").train()
    x = torch.randn(2, 17, 64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(blk)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(blk, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    out_c = compiled(x)
    assert not torch.equal(compiled(x), out_c), "a fresh dropout mask per compiled call"
    torch.manual_seed(1)
    out = blk(x)
    torch.manual_seed(2)
    assert torch.equal(out_c, out) and not torch.equal(blk(x), out)


@pytest.mark.parametrize("fused_blocks", [True, False], ids=["one_function_blocks", "per_part"])
def test_a_gradient_penalty_through_the_fused_model_raises_instead_of_being_dropped(fused_blocks):
    """A gradient taken with create_graph=True (a gradient penalty, a Hessian-vector product) cannot be
    differentiated through the fused kernels: it raises as it is taken, naming backend='torch'. once_differentiable
    alone would leave a Hessian-vector product asked of chosen inputs without the kernels' terms (its error node
    hangs on the gradients, off the path to those inputs)."""
    from vit_fast.tools.bench import _block_function

    fused, ref = make_pair(**TINY)
    x = torch.randn(2, 3, 32, 32, device=fused.pos_embed.device, requires_grad=True)
    with _block_function(fused_blocks):
        with pytest.raises(RuntimeError, match="no second derivative.*backend='torch'"):
            torch.autograd.grad(loss_of(fused(x)), x, create_graph=True)
        params = list(fused.parameters())
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(loss_of(fused(x)), params, create_graph=True)
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.functional.hvp(lambda images: loss_of(fused(images)), x.detach(), torch.ones_like(x))
        grads = torch.autograd.grad(loss_of(fused(x)), params)  # first order, as before
    expected = torch.autograd.grad(loss_of(ref(x)), list(ref.parameters()))
    for got, want in zip(grads, expected):
        assert_close(got, want, FP32, "a first-order gradient")


def test_drop_path_rate_one_drops_every_branch_as_timm_does():
    """keep = 0: every sample's branch is dropped (timm skips the 1/keep scale there); no NaN on either backend."""
    fused, ref = make_pair(**dict(TINY, drop_path_rate=1.0))
    x = torch.randn(2, 3, 32, 32, device=fused.pos_embed.device)
    for model in (fused.train(), ref.train()):
        out = model(x)
        assert torch.isfinite(out).all()
        loss_of(out).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_an_unknown_pool_type_is_refused():
    fused, _ = make_pair(**TINY)
    tokens = torch.randn(2, 17, 64, device=fused.pos_embed.device)
    with pytest.raises(ValueError, match="expected pool_type in .*'avgmax'.* got 'foo'"):
        fused.pool(tokens, "foo")
    assert torch.equal(fused.pool(tokens, "avgmax"), 0.5 * (tokens[:, 1:].amax(1) + tokens[:, 1:].mean(1)))
