"""kernels/layer_norm.py: layer_norm and add_layer_norm against float64 references (F.layer_norm
and the unfused residual join), forward and every gradient, dropout / LayerScale / drop-path,
autocast dtypes, determinism, launches and bytes per element."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import (
    DEVICE,
    DTYPES,
    assert_close,
    bound,
    check_compiled_dropout,
    check_matches_reference,
    kernel_keep_mask,
    randn,
)
from vit_fast.kernels import layer_norm as ln
from vit_fast.kernels._rows import RowTile
from vit_fast.kernels.bias_gelu import bias_dropout_add
from vit_fast.kernels.layer_norm import add_layer_norm, add_layer_norm_ref, layer_norm, layer_norm_ref

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


def ln_inputs(shape, dtype, param_dtype=None, eps=1e-6):
    d = shape[-1]
    param_dtype = param_dtype or dtype
    return dict(x=randn(*shape, dtype=dtype, scale=3.0) + 0.5, weight=randn(d, dtype=param_dtype),
                bias=randn(d, dtype=param_dtype), eps=eps)


def eager_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps)


def eager_add_layer_norm(x, residual, weight, bias, eps=1e-6, **kw):
    h = residual + x
    return eager_layer_norm(h, weight, bias, eps), h


# --------------------------------------------------------------------------- layer_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 5, 192), (3, 768), (1, 1408)])
def test_layer_norm_matches_reference(shape, dtype):
    torch.manual_seed(0)
    check_matches_reference(layer_norm, layer_norm_ref, ln_inputs(shape, dtype), dtype, eager_fn=eager_layer_norm)


@pytest.mark.parametrize("width", [64, 97, 384, 1024, 1280, 1664, 2048, 4096, 8192])
def test_layer_norm_widths_autocast_params(width):
    """Every ViT width and a prime one, bf16 activations with fp32 weight/bias: bf16 dx, fp32 grads."""
    torch.manual_seed(width)
    _, (dx, dw, db) = check_matches_reference(layer_norm, layer_norm_ref,
                                              ln_inputs((2, width), torch.bfloat16, torch.float32), torch.bfloat16)
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.bfloat16, torch.float32, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_out_dtype_for_an_fp32_stream(out_dtype):
    """The first norm of an fp32 residual stream under autocast: fp32 rows in, 16-bit normed out. Bitwise
    the fp32 LayerNorm cast to out_dtype (what autocast's cast of an fp32 output gives); the 16-bit dy
    gives bitwise the fp32 path's dx, dw, db for dy widened; and within the fp32 bound of float64."""
    torch.manual_seed(9)
    inputs = ln_inputs((3, 7, 768), torch.float32)
    x, w, b = (inputs[k].requires_grad_() for k in ("x", "weight", "bias"))
    y = layer_norm(x, w, b, 1e-6, out_dtype=out_dtype)
    y32 = layer_norm(x, w, b, 1e-6)
    assert y.dtype == out_dtype and torch.equal(y, y32.to(out_dtype))
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    grads32 = torch.autograd.grad(y32, (x, w, b), dy.float())
    for g, g32 in zip(grads, grads32):
        assert g.dtype == torch.float32 and torch.equal(g, g32)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = layer_norm_ref(x64, w64, b64, 1e-6)
    assert_close(y.float(), y64, bound(out_dtype), "y")
    for name, g, g64 in zip(("dx", "dw", "db"), grads, torch.autograd.grad(y64, (x64, w64, b64), dy.double())):
        assert_close(g, g64, bound(torch.float32), name)
    with pytest.raises(ValueError, match="out_dtype"):
        layer_norm(x, w, b, 1e-6, out_dtype=torch.int8)


@pytest.mark.parametrize("use", ["both", "normed", "input"])
def test_layer_norm_and_input_adds_the_streams_gradient_in_the_kernel(monkeypatch, use):
    """(LN(x), x) with x used again downstream: dx = LN's dx + the other use's gradient, equal to
    autograd's sum over a plain layer_norm (fp32 bound of float64), with no aten add in the backward;
    either output alone also works."""
    torch.manual_seed(11)
    inputs = ln_inputs((2, 9, 384), torch.float32)
    x, w, b = (inputs[k].requires_grad_() for k in ("x", "weight", "bias"))
    dy, dres = torch.randn(2, 9, 384, dtype=torch.bfloat16), torch.randn(2, 9, 384)

    def loss(normed, stream):
        terms = {"both": [(normed * dy).sum(), (stream * dres).sum()], "normed": [(normed * dy).sum()],
                 "input": [(stream * dres).sum()]}[use]
        return sum(t.float() for t in terms)

    normed, stream = ln.layer_norm_and_input(x, w, b, 1e-6, out_dtype=torch.bfloat16)
    assert stream is x or torch.equal(stream, x)
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenOps(TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    total = loss(normed, stream)
    with AtenOps() as ops:
        grads = torch.autograd.grad(total, (x, w, b), allow_unused=True)
    assert "add" not in ops.names, ops.names
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(loss(layer_norm_ref(x64, w64, b64, 1e-6), x64), (x64, w64, b64), allow_unused=True)
    for name, g, g64 in zip(("dx", "dw", "db"), grads, want):
        if g64 is None:
            assert g is None or not g.any(), name
        else:
            assert_close(g, g64, bound(torch.float32), name)


@pytest.mark.parametrize("eps", [1e-6, 1e-12])
@pytest.mark.parametrize("shape", [(0, 768), (1, 384), (2, 3, 4, 320), (37, 192)])
def test_layer_norm_shapes_and_eps(shape, eps):
    """0 rows, 1 row, 3 leading dims, and 37 rows (several row tiles and partial rows); HF's eps."""
    torch.manual_seed(1)
    (y,), (dx, dw, db) = check_matches_reference(layer_norm, layer_norm_ref, ln_inputs(shape, torch.float32, eps=eps),
                                                 torch.float32)
    assert y.shape == shape and dx.shape == shape
    if y.numel() == 0:
        assert torch.equal(dw, torch.zeros_like(dw)) and torch.equal(db, torch.zeros_like(db))


def test_layer_norm_non_contiguous_inputs_and_sum_backward():
    torch.manual_seed(2)
    base = randn(4, 6, 2 * 256, grad=False)
    w, b = randn(256), randn(256)
    for x in (base[..., ::2], randn(6, 4, 256, grad=False).transpose(0, 1), base[..., :256]):
        check_matches_reference(layer_norm, layer_norm_ref, dict(x=x.requires_grad_(), weight=w, bias=b, eps=1e-6),
                                torch.float32)
    x = base[..., 256:].requires_grad_()
    layer_norm(x, w, b).sum().backward()  # stride-0 grad of ones
    x64 = x.detach().double().requires_grad_()
    layer_norm_ref(x64, w.double(), b.double()).sum().backward()
    assert_close(x.grad, x64.grad, bound(torch.float32), "dx from .sum()", atol=1e-5)


def test_layer_norm_nan_inf_propagate_like_torch():
    x = torch.randn(4, 64, device=DEVICE)
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
    w, b = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    assert_close(layer_norm(x, w, b), F.layer_norm(x.double(), (64,), w.double(), b.double(), 1e-6), 1e-6, "LN")


def test_layer_norm_bad_input():
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(ValueError, match="at least 2 dims"):
        layer_norm(torch.randn(64), w, w)
    with pytest.raises(ValueError, match=r"weight of shape \(64,\)"):
        layer_norm(x, torch.randn(63), w)
    with pytest.raises(ValueError, match="expected bias as a tensor"):
        layer_norm(x, w, None)
    with pytest.raises(ValueError, match="dtype"):
        layer_norm(x.to(torch.int64), w, w)
    with pytest.raises(ValueError, match="hidden size of at most"):
        layer_norm(torch.randn(1, 20000), torch.randn(20000), torch.randn(20000))
    with pytest.raises(ValueError, match="residual of shape"):
        add_layer_norm(x, torch.randn(4, 32), w, w)
    with pytest.raises(ValueError, match=r"gamma of shape \(64,\)"):
        add_layer_norm(x, x, w, w, gamma=torch.randn(32))
    with pytest.raises(ValueError, match="dropout_p"):
        add_layer_norm(x, x, w, w, dropout_p=-0.1, training=True)


# --------------------------------------------------------------------------- add_layer_norm
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_plain_form(dtype):
    """add_layer_norm(x, residual, weight, bias, eps) exactly as the issue states it."""
    torch.manual_seed(3)
    inputs = dict(ln_inputs((2, 9, 384), dtype), residual=randn(2, 9, 384, dtype=dtype))
    check_matches_reference(add_layer_norm, add_layer_norm_ref, inputs, dtype, eager_fn=eager_add_layer_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("branch_bias,gamma,drop_path,dropout", [
    (True, False, False, False), (True, True, False, False), (False, False, True, False),
    (True, True, True, True), (False, True, False, True)])
def test_add_layer_norm_residual_join(dtype, branch_bias, gamma, drop_path, dropout):
    """Every factor of the join, with the kernel's own dropout mask in the reference."""
    b, n, d, p, seed = 3, 4, 192, 0.25, 21
    keep = kernel_keep_mask((b, n, d), p, seed, dtype) if dropout else None
    torch.manual_seed(4)
    inputs = dict(ln_inputs((b, n, d), dtype), residual=randn(b, n, d, dtype=dtype),
                  branch_bias=randn(d, dtype=dtype) if branch_bias else None,
                  gamma=randn(d, dtype=dtype, scale=0.5) if gamma else None,
                  sample_scale=torch.tensor([1 / 0.9, 0.0, 1 / 0.9], device=DEVICE) if drop_path else None,
                  dropout_p=p if dropout else 0.0, training=dropout)
    check_matches_reference(add_layer_norm, lambda **kw: add_layer_norm_ref(**kw, keep_mask=keep), inputs, dtype,
                            seed=seed)


def test_add_layer_norm_join_equals_bias_dropout_add():
    """The shared join: add_layer_norm's h is bias_dropout_add's output bit for bit (same seed)."""
    x, res, bb, gamma = randn(2, 5, 256, grad=False), randn(2, 5, 256, grad=False), randn(256), randn(256)
    w, b, scale = randn(256), randn(256), torch.tensor([2.0, 0.5], device=DEVICE)
    torch.manual_seed(7)
    _, h = add_layer_norm(x, res, w, b, branch_bias=bb, gamma=gamma, sample_scale=scale, dropout_p=0.4, training=True)
    torch.manual_seed(7)
    assert torch.equal(h, bias_dropout_add(x, bb, res, 0.4, True, gamma=gamma, sample_scale=scale))


def test_add_layer_norm_autocast_dtypes():
    """bf16 branch, fp32 residual stream and fp32 params: normed bf16, h fp32, fp32 param grads."""
    torch.manual_seed(5)
    inputs = dict(ln_inputs((2, 3, 768), torch.bfloat16, torch.float32), residual=randn(2, 3, 768),
                  branch_bias=randn(768), gamma=randn(768, scale=0.1))
    (y, h), grads = check_matches_reference(add_layer_norm, add_layer_norm_ref, inputs, torch.bfloat16)
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    assert [g.dtype for g in grads] == [torch.bfloat16] + [torch.float32] * 5  # x, weight, bias, residual, bb, gamma


@pytest.mark.parametrize("use", ["normed", "h"])
def test_add_layer_norm_gradient_through_one_output(use):
    """Only one output used downstream: the missing gradient is not read (nor materialised)."""
    torch.manual_seed(6)
    inputs = dict(ln_inputs((5, 320), torch.float32), residual=randn(5, 320), branch_bias=randn(320),
                  gamma=randn(320), dropout_p=0.2, training=True)
    keep = kernel_keep_mask((5, 320), 0.2, seed=10)
    if use == "h":  # the LN parameters do not reach h
        inputs["weight"].requires_grad_(False), inputs["bias"].requires_grad_(False)

    def pick(f):
        return lambda **kw: f(**kw)[0 if use == "normed" else 1]
    ref = pick(lambda **kw: add_layer_norm_ref(**kw, keep_mask=keep))
    check_matches_reference(pick(add_layer_norm), ref, inputs, torch.float32, seed=10)


def test_add_layer_norm_backward_is_deterministic():
    """13 rows x 1408 -> 3 programs' partial rows; two backward passes are bitwise equal."""
    torch.manual_seed(8)
    inputs = dict(ln_inputs((13, 1408), torch.bfloat16, torch.float32), residual=randn(13, 1408, dtype=torch.bfloat16),
                  branch_bias=randn(1408), gamma=randn(1408), dropout_p=0.1, training=True)
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    dy, dh = torch.randn(13, 1408, dtype=torch.bfloat16), torch.randn(13, 1408, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        torch.manual_seed(9)
        runs.append(torch.autograd.grad(add_layer_norm(**inputs), leaves, (dy, dh)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_layer_norm_launches_and_bytes(traffic):
    """layer_norm: fwd 1 launch (read x, write y: 2s), bwd 2 launches (read dy, x, write dx: 3s).
    add_layer_norm: fwd 1 launch (read x, residual, write normed, h: 4s), bwd 2 launches
    (read dy, dh_out, h, write dh: 4s; + x and dx with LayerScale: 6s)."""
    m, d = 20, 384
    x, res, dy, dh_out = (torch.randn(m, d, dtype=torch.bfloat16) for _ in range(4))
    w, b, gamma = torch.randn(d), torch.randn(d), torch.randn(d)

    def moved(kind, *ts):
        return [traffic.bytes(kind, t) for t in ts]

    y, _, mean, rstd = ln.add_layer_norm_fwd(x, None, w, b, None, None, None, 1e-6, 0.0, None)
    assert traffic.launches == ["_layer_norm_fwd_kernel"]
    assert moved("read", x) == [x.nbytes] and moved("write", y, mean, rstd) == [y.nbytes, 4 * m, 4 * m]
    traffic.clear()
    dx, _, _ = ln.add_layer_norm_bwd(dy, None, x, x, w, b, None, None, None, mean, rstd, 0.0, None, False)
    assert traffic.launches == ["_layer_norm_bwd_kernel", "_sum_partials_kernel"]
    assert moved("read", dy, x) == [dy.nbytes, x.nbytes] and moved("write", dx) == [dx.nbytes]
    traffic.clear()
    y, h, mean, rstd = ln.add_layer_norm_fwd(x, res, w, b, None, gamma, None, 1e-6, 0.1, torch.tensor([3]))
    assert traffic.launches == ["_layer_norm_fwd_kernel"]
    assert moved("read", x, res) == [x.nbytes, res.nbytes] and moved("write", y, h) == [y.nbytes, h.nbytes]
    traffic.clear()
    dh, dx, _ = ln.add_layer_norm_bwd(dy, dh_out, h, x, w, b, None, gamma, None, mean, rstd, 0.1,
                                      torch.tensor([3]), True)
    assert traffic.launches == ["_layer_norm_bwd_kernel", "_sum_partials_kernel"]
    assert moved("read", dy, dh_out, h, x) == [dy.nbytes, dh_out.nbytes, h.nbytes, x.nbytes]
    assert moved("write", dh, dx) == [dh.nbytes, dx.nbytes]


def test_torch_compile_fullgraph_traces_add_layer_norm():
    torch._dynamo.reset()
    inputs = dict(ln_inputs((2, 3, 64), torch.float32), residual=randn(2, 3, 64), gamma=randn(64))
    compiled = torch.compile(add_layer_norm, fullgraph=True, backend="aot_eager")
    y, h = compiled(**inputs)
    y_ref, h_ref = add_layer_norm(**inputs)
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    (y.sum() + h.sum()).backward()
    assert inputs["gamma"].grad is not None


def test_torch_compile_dropout_without_graph_breaks(monkeypatch):
    x, res, w, b, gamma = randn(2, 3, 64), randn(2, 3, 64), randn(64), randn(64), randn(64)

    def block(x, res, w, b, gamma):
        normed, h = add_layer_norm(x, res, w, b, gamma=gamma, dropout_p=0.5, training=True)
        return normed + h

    check_compiled_dropout(block, [x, res, w, b, gamma], monkeypatch)


@pytest.mark.parametrize("width,hidden", [(384, 1536), (1408, 6144)])
def test_aot_specs_match_kernels_and_config_tables(width, hidden):
    """Every AotSpec names each kernel argument once, in order, marks exactly the constexpr
    parameters as such, types every pointer, and uses the blocks the launchers' tables pick."""
    import inspect

    from vit_fast.kernels import bias_gelu as bg

    for arch in (80, 90):
        specs = ln.aot_specs(tokens=197, width=width, mlp_hidden=hidden, dtype=torch.bfloat16, arch=arch) + \
            bg.aot_specs(tokens=197, width=width, mlp_hidden=hidden, dtype=torch.bfloat16, arch=arch)
        assert {s.name for s in specs} >= {"layer_norm_fwd", "layer_norm_bwd", "bias_gelu_fwd", "bias_gelu_bwd",
                                           "bias_dropout_add_fwd", "bias_dropout_add_bwd", "sum_partials"}
        for s in specs:
            params = inspect.signature(s.fn.fn).parameters
            assert list(s.signature) == list(params), s.name
            constexprs = {name for name, prm in params.items() if "constexpr" in str(prm.annotation)}
            assert set(s.constexprs) == constexprs, s.name
            assert {k for k, v in s.signature.items() if v == "constexpr"} == constexprs, s.name
            pointers = [k for k in params if k[0].isupper() and k not in constexprs and k not in ("M", "N", "G")]
            assert pointers and all(s.signature[k].startswith("*") for k in pointers), s.name
            # what a real launch specialises: aligned pointers, widths and row strides of a width that is a
            # multiple of 16 (384, 1408); never the batch-dependent row / program counts
            assert set(pointers) <= set(s.divisible_by_16), s.name
            assert "N" in s.divisible_by_16 and not {"M", "G"} & set(s.divisible_by_16), s.name
            strides = {a for a in s.signature if a.startswith("stride_")}
            assert not strides or strides & set(s.divisible_by_16), s.name
            if s.name.startswith("layer_norm"):
                assert RowTile(s.constexprs["BLOCK_M"], s.constexprs["BLOCK_N"], s.num_warps) == \
                    ln.ln_config(width, arch, backward=s.name.endswith("_bwd"), spill_prone=ln.bwd_spill_prone(
                        s.constexprs["HAS_GAMMA"], s.constexprs["HAS_BRANCH_BIAS"], s.signature.get("DY") == "*fp32"))
            elif s.name.startswith("bias_gelu"):
                tile = bg.bwd_tile_config if s.name.endswith("_bwd") else bg.tile_config
                assert RowTile(s.constexprs["BLOCK_M"], s.constexprs["BLOCK_N"], s.num_warps) == tile(hidden, arch)


def test_aot_specs_claim_no_alignment_a_launch_does_not_have():
    """Width 200 (8 * 25): a launch passes N = 200 and row strides of 200, no multiple of 16, so only
    pointers (and the 0 strides of absent tensors) are compiled as 16-divisible."""
    from vit_fast.kernels import bias_gelu as bg

    specs = ln.aot_specs(tokens=197, width=200, mlp_hidden=808, dtype=torch.float16, arch=90) + \
        bg.aot_specs(tokens=197, width=200, mlp_hidden=808, dtype=torch.float16, arch=90)
    for s in specs:
        ints = {a for a in s.divisible_by_16 if not s.signature[a].startswith("*")}
        assert "N" not in ints and "tokens_per_sample" not in ints, s.name
        assert all(a.startswith("stride_") for a in ints), (s.name, ints)
    plain = next(s for s in specs if s.name == "layer_norm_fwd" and not s.constexprs["HAS_RESIDUAL"])
    assert {"stride_rm", "stride_hm"} <= set(plain.divisible_by_16)  # 0: no residual, no h output


def test_strided_and_expanded_parameters():
    from tests.numerics import strided_and_expanded
    torch.manual_seed(10)
    n = 384
    strided, expanded = strided_and_expanded(n)
    check_matches_reference(layer_norm, layer_norm_ref, dict(x=randn(3, n), weight=strided, bias=expanded),
                            torch.float32)
    (strided, expanded), (strided2, expanded2) = strided_and_expanded(n), strided_and_expanded(n)  # distinct leaves
    check_matches_reference(add_layer_norm, add_layer_norm_ref,
            dict(x=randn(3, n), residual=randn(3, n), weight=expanded, bias=strided, branch_bias=strided2,
                 gamma=expanded2), torch.float32)
