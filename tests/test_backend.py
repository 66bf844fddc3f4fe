"""Backend choice ('auto' | 'triton' | 'torch') and the fused path of each module used alone.

The kernels run in the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1 without a GPU).
Launches are counted with a TorchDispatchMode: every kernel launcher is a ``vit_fast::`` custom op.
"""
import copy
import inspect

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import vit_fast
from vit_fast.backend import resolve_backend
from vit_fast.layers import Attention, Block, LayerNorm, Mlp, PatchEmbed

from .numerics import assert_close, bound

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
VIEW_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
            "detach", "alias", "slice", "select", "as_strided", "split", "unbind", "empty", "new_empty", "zeros",
            "new_zeros", "lift_fresh", "promote_types"}


class OpLog(TorchDispatchMode):
    """Records every dispatched op: vit_fast custom ops by name, aten ops by their packet name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        self.ops.append(f"{ns}::{func.__name__.split('.')[0]}")
        return func(*args, **(kwargs or {}))

    def kernels(self):
        return [op.split("::")[1] for op in self.ops if op.startswith("vit_fast::")]

    def compute_aten(self):
        """aten ops that do arithmetic (not views, allocations or copies)."""
        return [op.split("::")[1] for op in self.ops if op.startswith("aten::") and op.split("::")[1] not in VIEW_OPS]


# ------------------------------------------------------------------------------------- resolution
def test_resolve_rules(monkeypatch):
    cpu = torch.zeros(1)
    assert resolve_backend("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu) == "triton" and resolve_backend("triton", cpu) == "triton"
    meta = torch.empty(1, device="meta")
    assert resolve_backend("auto", meta) == "torch"
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        resolve_backend("triton", meta)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu)


def test_triton_on_cpu_without_interpreter_is_an_error_not_a_fallback(monkeypatch):
    model = vit_fast.VisionTransformer(**TINY, backend="triton")
    x = torch.randn(2, 3, 32, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with OpLog() as log, pytest.raises(RuntimeError, match="backend='triton' needs CUDA"):
        model(x)
    assert not log.kernels()
    model.set_backend("auto")  # auto on CPU without the interpreter: the reference path
    with OpLog() as log:
        model(x)
    assert not log.kernels() and "convolution" in log.compute_aten()


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_torch_func_transforms_run_the_reference_on_auto_and_refuse_triton():
    """torch.func.vmap / grad over a model: 'auto' runs the reference path inside the transform (the kernels'
    autograd Functions have no functorch rules: torch's internal setup_context error before), with the numbers of
    a plain per-sample loop; 'triton' refuses by name."""
    torch.manual_seed(0)
    model = vit_fast.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=5, backend="auto").eval()
    xs = torch.randn(2, 2, 3, 32, 32)
    with torch.no_grad():
        expected = torch.stack([model(x) for x in xs])
    assert_close(torch.func.vmap(model)(xs), expected, 1e-5)
    params = dict(model.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(model, p, (xs[0],)).square().sum())(params)
    model(xs[0]).square().sum().backward()
    for name, p in params.items():
        assert_close(grads[name], p.grad, 1e-4, name=name)
    model.set_backend("triton")
    with pytest.raises(ValueError, match="backend='triton' under a torch.func transform"):
        torch.func.vmap(model)(xs)


def test_a_float64_model_runs_the_reference_on_auto_and_triton_refuses_it_by_name():
    """model.double() (gradcheck, a float64 oracle): 'auto' runs the reference path, as timm in float64 (the patch
    embedding's dtype check failed, naming the images); 'triton' says the kernels do not compute in float64."""
    import timm

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=5).double()
    model = vit_fast.optimize(copy.deepcopy(source), backend="auto")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    assert torch.equal(model(x), source(x))
    model.set_backend("triton")
    with pytest.raises(ValueError, match="do not compute in float64|compute in float32, float16 or bfloat16"):
        model(x)


def test_a_scale_set_by_hand_is_applied_by_both_backends():
    """Attention.scale changed after construction (a temperature): the kernels applied it and the reference
    path's SDPA call did not, so the backends disagreed (2e-3 on tiny logits)."""
    torch.manual_seed(0)
    fused = vit_fast.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=5, backend="triton")
    reference = copy.deepcopy(fused).set_backend("torch")
    for model in (fused, reference):
        for blk in model.blocks:
            blk.attn.scale = 0.05
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(fused(x), reference(x), bound(torch.float32, "dot"))
        for blk in reference.blocks:
            blk.attn.fused_attn = False  # timm's explicit path: the scale as written
        assert_close(fused(x), reference(x), bound(torch.float32, "dot"))


def test_backend_is_set_everywhere():
    assert vit_fast.ViTConfig().backend == "auto"  # kernels wherever they can run (CUDA, or the interpreter)
    assert all(inspect.signature(cls).parameters["backend"].default == "auto" for cls in (Block, LayerNorm))
    model = vit_fast.create_model("vit_tiny_patch16_224", depth=1, backend="torch")
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")}
    assert backends == {"torch"}
    model.set_backend("triton")
    assert {m.backend for m in model.modules() if hasattr(m, "backend")} == {"triton"}
    assert model.config.backend == "triton"
    assert isinstance(model.blocks[0].norm1, nn.LayerNorm) and isinstance(model.norm, LayerNorm)
    with pytest.raises(ValueError, match="backend must be one of"):
        Block(64, 4, backend="gpu")


# ------------------------------------------------------------------------------ modules used alone
def _fused_vs_reference(module: nn.Module, x: torch.Tensor, expected_kernels: list[str], rtol: float):
    """Run the module on both backends (same weights), compare output and every gradient, and check
    exactly which kernels the fused forward launched."""
    ref = copy.deepcopy(module)
    for m in ref.modules():
        if hasattr(m, "backend"):
            m.backend = "torch"
    x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    with OpLog() as log:
        out = module(x_fused)
    assert sorted(log.kernels()) == sorted(expected_kernels), log.kernels()
    assert_close(out, out_ref, rtol, "output")
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out.backward(grad)
    assert_close(x_fused.grad, x_ref.grad, rtol, "input grad")
    for (name, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, rtol, name)
    return log


def test_layer_norm_alone():
    torch.manual_seed(0)
    norm = LayerNorm(64, eps=1e-6, backend="triton")
    nn.init.normal_(norm.weight), nn.init.normal_(norm.bias)
    log = _fused_vs_reference(norm, torch.randn(2, 17, 64), ["add_layer_norm_fwd"], bound(torch.float32))
    assert not log.compute_aten()


def test_patch_embed_alone():
    torch.manual_seed(0)
    pe = PatchEmbed(32, 8, 3, 64, backend="triton")
    log = _fused_vs_reference(pe, torch.randn(2, 3, 32, 32), ["patch_embed_fwd"], bound(torch.float32, "dot"))
    assert not log.compute_aten()


def test_attention_alone_uses_packed_kernel():
    torch.manual_seed(0)
    attn = Attention(64, 4, qkv_bias=True, backend="triton")
    log = _fused_vs_reference(attn, torch.randn(2, 17, 64), ["attention_fwd"], bound(torch.float32, "dot"))
    assert sorted(log.compute_aten()) == ["addmm", "addmm"]  # qkv and proj GEMMs: no permute copies


def test_attention_with_qk_norm_routes_the_core_through_reference_ops():
    torch.manual_seed(0)
    attn = Attention(64, 4, qkv_bias=True, qk_norm=True, backend="triton")
    log = _fused_vs_reference(attn, torch.randn(2, 17, 64), [], bound(torch.float32, "dot"))
    assert "native_layer_norm" in log.compute_aten()


def test_mlp_alone():
    torch.manual_seed(0)
    mlp = Mlp(64, 256, act="gelu_tanh", backend="triton")
    nn.init.normal_(mlp.fc1.bias)
    log = _fused_vs_reference(mlp, torch.randn(2, 17, 64), ["bias_gelu_fwd"], bound(torch.float32, "dot"))
    assert sorted(log.compute_aten()) == ["addmm", "mm"]  # fc1 without bias, fc2 with


@pytest.mark.parametrize("init_values", [None, 0.5])
def test_block_alone(init_values):
    torch.manual_seed(0)
    blk = Block(64, 4, init_values=init_values, backend="triton")
    for name, p in blk.named_parameters():
        if name.endswith("bias"):
            nn.init.normal_(p, std=0.1)
    log = _fused_vs_reference(blk, torch.randn(2, 17, 64), ["add_layer_norm_fwd", "attention_fwd", "add_layer_norm_fwd",
                                                            "linear_act_fwd", "bias_dropout_add_fwd"],
                              bound(torch.float32, "dot"))
    # qkv with its bias (no separate add); proj without bias (the join adds it); fc1 is linear_act's Triton
    # GEMM (its bias in the epilogue), fc2 a cuBLAS GEMM without bias
    assert sorted(log.compute_aten()) == ["addmm", "mm", "mm"]
