"""Fused patch embedding (kernels/patch_embed.py) against a float64 conv2d -> flatten -> cat -> add reference.

Every launch in this file writes into NaN-poisoned allocations (autouse fixture), so an output row,
gradient element or partial the kernels forget to write fails the comparison.
"""
import dataclasses
import math

import pytest
import torch

from tests.numerics import DTYPES, assert_close, bound, dtype_id, errors
from vit_fast._compat import monkeypatch_setting  # torch settings served by __getattr__
from vit_fast.kernels import patch_embed as pe
from vit_fast.kernels.patch_embed import patch_embed, patch_embed_bwd, patch_embed_fwd, patch_embed_ref

NAMES = ["images", "weight", "bias", "pos_embed", "cls_token", "reg_tokens"]
pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.fixture(autouse=True)
def ieee_fp32(monkeypatch):
    # fp32 bounds are for IEEE dots; on a GPU the kernel (like Conv2d) would use TF32 under this flag
    monkeypatch_setting(monkeypatch, torch.backends.cudnn, "allow_tf32", False)


def make_inputs(B, C, H, W, P, D, cls=True, regs=0, covers=True, dtype=torch.float32, bias=True, seed=0):
    """Random leaf tensors (requires_grad) in `dtype`, scaled so every token is O(1)."""
    g = torch.Generator().manual_seed(seed)
    prefix = int(cls) + regs
    num_patches = (H // P) * (W // P)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cpu") * scale).to(dtype).requires_grad_()

    return dict(
        images=rand(B, C, H, W),
        weight=rand(D, C, P, P, scale=1 / math.sqrt(C * P * P)),
        bias=rand(D) if bias else None,
        pos_embed=rand(1, num_patches + (prefix if covers else 0), D, scale=0.5),
        cls_token=rand(1, 1, D) if cls else None,
        reg_tokens=rand(1, regs, D) if regs else None,
    )


def call(fn, inputs, covers, **kwargs):
    return fn(*(inputs[n] for n in NAMES), pos_embed_covers_prefix=covers, **kwargs)


def reference(inputs, covers, dtokens):
    """float64 tokens and gradients of the eager stack."""
    leaves = {n: None if t is None else t.detach().double().requires_grad_() for n, t in inputs.items()}
    out = call(patch_embed_ref, leaves, covers)
    out.backward(dtokens.double())
    return out, {n: None if t is None else t.grad for n, t in leaves.items()}


def check_against_reference(inputs, covers, dtype, backward="randn"):
    out = call(patch_embed, inputs, covers)
    assert out.dtype == dtype
    dtokens = torch.randn_like(out) if backward == "randn" else torch.ones_like(out)
    if backward == "randn":
        out.backward(dtokens)
    else:
        out.float().sum().backward()  # stride-0 gradient
    ref, ref_grads = reference(inputs, covers, dtokens)
    tol = bound(dtype, "dot")
    assert_close(out, ref, tol, "tokens")
    for name, t in inputs.items():
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert_close(t.grad, ref_grads[name], tol, f"d{name}")
    if dtype != torch.float32 and backward == "randn":
        check_within_twice_eager(inputs, covers, dtokens, out, ref, ref_grads)


def check_within_twice_eager(inputs, covers, dtokens, out, ref, ref_grads):
    """The flash-attention rule: error vs float64 at most 2x that of eager PyTorch in the same dtype."""
    leaves = {n: None if t is None else t.detach().clone().requires_grad_() for n, t in inputs.items()}
    eager = call(patch_embed_ref, leaves, covers)
    eager.backward(dtokens)
    pairs = [("tokens", out, eager, ref)] + [
        (f"d{n}", t.grad, leaves[n].grad, ref_grads[n]) for n, t in inputs.items() if t is not None]
    for name, mine, theirs, exact in pairs:
        err, eager_err = errors(mine, exact)[0], errors(theirs, exact)[0]
        assert err <= 2 * eager_err + 1e-6, f"{name}: error {err:.2e} > 2x eager {eager_err:.2e}"


# (P, C, H, W, D, cls, regs, covers): square and non-square, P 8/14/16/32, C 1/3/4, prefix variants
CASES = {
    "p8_c3_cls": (8, 3, 32, 48, 64, True, 0, True),
    "p16_c1_regs_no_embed_class": (16, 1, 32, 48, 96, True, 4, False),
    "p14_c3_no_prefix": (14, 3, 28, 42, 80, False, 0, True),
    "p16_c4_square_regs_only": (16, 4, 32, 32, 48, False, 2, True),
    # P <= 2: a K tile spans 16 // P^2 channels, the last group part-masked (C = 5 with 4 per tile; 3 of 16)
    "p2_c5_regs": (2, 5, 6, 10, 32, True, 1, True),
    "p1_c3_no_embed_class": (1, 3, 5, 7, 24, True, 0, False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_forward_backward_matches_reference(case, dtype):
    P, C, H, W, D, cls, regs, covers = CASES[case]
    inputs = make_inputs(2, C, H, W, P, D, cls, regs, covers, dtype, seed=len(case))
    check_against_reference(inputs, covers, dtype)


def test_wide_and_large_patch():
    """D = 1280 (ViT-H width) on a tiny image and a P = 32 patch, no bias, cls without pos (no_embed_class)."""
    inputs = make_inputs(1, 1, 16, 16, 8, 1280, cls=True, covers=True, dtype=torch.bfloat16, seed=3)
    check_against_reference(inputs, True, torch.bfloat16)
    inputs = make_inputs(2, 1, 32, 64, 32, 64, cls=True, covers=False, bias=False, seed=4)
    check_against_reference(inputs, False, torch.float32)


def test_batch_across_reduction_tiles():
    """B = 9 crosses the batch-sum tile of the dpos/dcls/dreg reduction (8 images per step)."""
    inputs = make_inputs(9, 3, 16, 16, 8, 32, cls=True, regs=2, covers=True, seed=12)
    check_against_reference(inputs, True, torch.float32)


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_fp32_inputs(amp_dtype):
    """fp32 images and parameters under autocast: tokens in the autocast dtype, fp32 gradients."""
    inputs = make_inputs(2, 3, 32, 48, 16, 64, cls=True, regs=1, seed=5)
    with torch.autocast("cpu", dtype=amp_dtype):
        out = call(patch_embed, inputs, True)
        ref_amp = call(patch_embed_ref, inputs, True)
    assert out.dtype == amp_dtype and ref_amp.dtype == amp_dtype
    dtokens = torch.randn_like(out)
    out.backward(dtokens)
    ref, ref_grads = reference(inputs, True, dtokens)
    assert_close(out, ref, bound(amp_dtype, "dot"), "tokens")
    for name, t in inputs.items():
        assert t.grad.dtype == torch.float32, name
        assert_close(t.grad, ref_grads[name], bound(amp_dtype, "dot"), f"d{name}")


@pytest.mark.parametrize("route", ["kernel", "library"])
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_gemm_with_fp32_tokens(amp_dtype, route, monkeypatch):
    """The model's mixed precision: the GEMM in the autocast dtype, fp32 tokens (``tokens_dtype``; the convolution's
    output rounded to the autocast dtype before the fp32 cls and position adds, as eager's conv then promoting add).
    Tokens and every fp32 gradient against float64 and within twice eager's error (``patch_embed_ref`` under the
    same autocast); the dW GEMM on the kernel and on the library route."""
    inputs = make_inputs(2, 3, 32, 48, 16, 64, cls=True, regs=1, seed=6)
    if route == "library":
        monkeypatch.setattr(pe, "_patch_embed_dweight_kernel", None)
        monkeypatch.setattr(pe, "_dweight_candidates", lambda tile, dtype: [pe.LIBRARY_DWEIGHT])
    leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    with torch.autocast("cpu", dtype=amp_dtype):
        out = call(patch_embed, inputs, True, tokens_dtype=torch.float32)
        eager = call(patch_embed_ref, leaves, True, tokens_dtype=torch.float32)
    assert out.dtype == eager.dtype == torch.float32
    dtokens = torch.randn_like(out)
    out.backward(dtokens)
    eager.backward(dtokens)
    ref, ref_grads = reference(inputs, True, dtokens)
    pairs = [("tokens", out, eager, ref)] + [(f"d{n}", t.grad, leaves[n].grad, ref_grads[n])
                                             for n, t in inputs.items()]
    for name, mine, theirs, exact in pairs:
        assert mine.dtype == torch.float32, name
        err, eager_err = errors(mine, exact)[0], errors(theirs, exact)[0]
        assert err <= 2 * eager_err + 1e-6, f"{name}: error {err:.2e} > 2x eager {eager_err:.2e}"
    # eager's tokens but for a rare rounding tie of the convolution's output (its sums run in another order); an
    # fp32 output without that rounding differs from eager's in about 3 of 4 tokens
    assert ((out - eager).abs() > 1e-5).float().mean().item() <= 0.01


# (P, C, H, W): Np = 64 patches, a multiple of the dW row block (64 rows for 16-bit, 32 for fp32 on sm_80), made of
# whole 8-patch rows, or of 32-patch rows that a 32-row block covers piece by piece
ALIGNED_CASES = {"whole_patch_rows": (8, 3, 64, 64), "pieces_of_patch_rows": (2, 5, 4, 64)}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(ALIGNED_CASES), ids=list(ALIGNED_CASES))
def test_dweight_aligned_row_blocks(monkeypatch, case, dtype):
    """Row blocks that are alike whole patch rows take the dW gather with loop-invariant offsets (ALIGNED_BLOCKS);
    one split walks every block of 3 images (block starts carry over patch rows and images), channels-last images."""
    P, C, H, W = ALIGNED_CASES[case]
    monkeypatch.setattr(pe, "_DW_PROGRAMS_PER_SM", 0)  # a single split: one program per tile runs every row block
    block_m = pe.patch_embed_config(80, dtype).dweight.block_m
    assert pe._aligned_blocks((H // P) * (W // P), W // P, block_m)
    inputs = make_inputs(3, C, H, W, P, 48, cls=True, regs=1, covers=True, dtype=dtype, seed=13)
    inputs["images"] = inputs["images"].detach().to(memory_format=torch.channels_last).requires_grad_()
    check_against_reference(inputs, True, dtype)


@pytest.fixture
def library_dweight(monkeypatch):
    """The dW GEMM on the library route (what the autotuner may pick on a GPU), for every launch of a test."""
    monkeypatch.setattr(pe, "_patch_embed_dweight_kernel", None)  # launching the kernel would fail the test
    with pe.library_dweight_only():
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("case", ["p8_c3_cls", "p16_c1_regs_no_embed_class", "p14_c3_no_prefix", "p2_c5_regs"])
def test_library_dweight_matches_reference(library_dweight, case, dtype):
    """dW and dbias from the cuBLAS route (patches gathered once, fp32 accumulation) against float64, with the
    prefix rows of the patch matrix zero (cls, registers, none)."""
    P, C, H, W, D, cls, regs, covers = CASES[case]
    inputs = make_inputs(2, C, H, W, P, D, cls, regs, covers, dtype, seed=20 + len(case))
    check_against_reference(inputs, covers, dtype)


def test_library_dweight_autocast_strided_images_repeatable(library_dweight):
    """fp32 channels-last images under autocast and a strided dtokens: fp32 gradients within the 16-bit bound; two
    backward passes give the same bits; a stride-0 dtokens (``.sum()``) gives dW = the patch sums, dbias = B * Np."""
    inputs = make_inputs(3, 3, 32, 48, 16, 64, cls=True, regs=1, seed=21)
    inputs["images"] = inputs["images"].detach().to(memory_format=torch.channels_last).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(patch_embed, inputs, True)
    dtokens = torch.randn(out.shape[0], out.shape[1], 2 * out.shape[2])[..., ::2].to(torch.bfloat16)
    out.backward(dtokens)
    _, ref_grads = reference(inputs, True, dtokens)
    for name, t in inputs.items():
        assert t.grad.dtype == torch.float32, name
        assert_close(t.grad, ref_grads[name], bound(torch.bfloat16, "dot"), f"d{name}")
    args = [inputs[n].detach() for n in NAMES]
    args[1:] = [None if a is None else a.to(torch.bfloat16) for a in args[1:]]
    first = patch_embed_bwd(dtokens, *args, True, False)
    second = patch_embed_bwd(dtokens, *args, True, False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    stride0 = torch.ones(1, 1, out.shape[2], dtype=torch.bfloat16).expand(out.shape)
    dw, dbias = patch_embed_bwd(stride0, *args, True, False)[:2]
    patches = inputs["images"].detach().to(torch.bfloat16).double().unfold(2, 16, 16).unfold(3, 16, 16)
    assert_close(dw, patches.sum((0, 2, 3)).expand_as(dw), bound(torch.bfloat16, "dot"), "dW of a stride-0 gradient")
    assert torch.equal(dbias, torch.full_like(dbias, 3 * 6))


def test_sum_backward_and_strided_images():
    """.sum() gives a stride-0 dtokens; channels-last images are read through their strides."""
    inputs = make_inputs(2, 3, 32, 48, 8, 64, cls=True, regs=2, covers=False, seed=6)
    inputs["images"] = inputs["images"].detach().to(memory_format=torch.channels_last).requires_grad_()
    check_against_reference(inputs, False, torch.float32, backward="sum")


# parameters passed as views of contiguous leaves: (leaf shape, view) per name, B=2 C=3 16x24 P=8 D=32 R=2
_B, _C, _H, _W, _P, _D, _R = 2, 3, 16, 24, 8, 32, 2
_L = 1 + _R + (_H // _P) * (_W // _P)
PARAM_VIEWS = {
    "strided": dict(  # every other channel (and pixel) of a wider leaf
        weight=((_D, _C, 2 * _P, 2 * _P), lambda t: t[..., ::2, ::2]), bias=((2 * _D,), lambda t: t[::2]),
        pos_embed=((1, _L, 2 * _D), lambda t: t[..., ::2]), cls_token=((1, 1, 2 * _D), lambda t: t[..., ::2]),
        reg_tokens=((1, _R, 2 * _D), lambda t: t[..., 1::2])),
    "expanded": dict(  # stride-0 broadcasts of one value / one row
        weight=((1, _C, _P, _P), lambda t: t.expand(_D, -1, -1, -1)), bias=((1,), lambda t: t.expand(_D)),
        pos_embed=((1, 1, _D), lambda t: t.expand(1, _L, _D)), cls_token=((1, 1, 1), lambda t: t.expand(1, 1, _D)),
        reg_tokens=((1, 1, _D), lambda t: t.expand(1, _R, _D))),
}


@pytest.mark.parametrize("kind", list(PARAM_VIEWS))
def test_non_contiguous_parameters(kind):
    """Strided and expanded (stride-0) weight, bias, pos_embed, cls_token and reg_tokens: same tokens and
    same leaf gradients (autograd routes them back through the views) as the float64 reference."""
    g = torch.Generator().manual_seed(13)
    leaves = {n: torch.randn(shape, generator=g, device="cpu").requires_grad_()
              for n, (shape, _) in PARAM_VIEWS[kind].items()}
    images = torch.randn(_B, _C, _H, _W, generator=g, device="cpu")

    def run(fn, params, x):
        views = {n: view(params[n]) for n, (_, view) in PARAM_VIEWS[kind].items()}
        return fn(x, views["weight"], views["bias"], views["pos_embed"], views["cls_token"], views["reg_tokens"])

    out = run(patch_embed, leaves, images)
    dtokens = torch.randn(out.shape, generator=g, device="cpu")
    out.backward(dtokens)
    exact = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    ref = run(patch_embed_ref, exact, images.double())
    ref.backward(dtokens.double())
    tol = bound(torch.float32, "dot")
    assert_close(out, ref, tol, f"tokens ({kind})")
    for name, leaf in leaves.items():
        assert_close(leaf.grad, exact[name].grad, tol, f"d{name} ({kind})")


def test_timm_stack_matches():
    """timm PatchEmbed + _pos_embed with random weights (cls, registers, both pos conventions): same
    tokens and same parameter gradients as timm's autograd."""
    timm = pytest.importorskip("timm")
    for regs, no_embed_class in ((0, False), (2, True)):
        torch.manual_seed(7)
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                                  reg_tokens=regs, no_embed_class=no_embed_class).double()
        torch.nn.init.normal_(model.pos_embed)  # timm initialises it with small trunc_normal values
        images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
        expected = model._pos_embed(model.patch_embed(images))
        dtokens = torch.randn_like(expected)
        expected.backward(dtokens)
        proj = model.patch_embed.proj
        theirs = [proj.weight, proj.bias, model.pos_embed, model.cls_token, model.reg_token]
        mine = [p.detach().float().requires_grad_() if p is not None else None for p in theirs]
        out = patch_embed(images.float(), *mine, pos_embed_covers_prefix=not no_embed_class)
        assert_close(out, expected, bound(torch.float32, "dot"), f"tokens (regs={regs})")
        out.backward(dtokens.float())
        for name, a, b in zip(("weight", "bias", "pos_embed", "cls_token", "reg_token"), mine, theirs):
            if b is not None:
                assert_close(a.grad, b.grad, bound(torch.float32, "dot"), f"d{name} (regs={regs})")


def test_empty_batch_gives_empty_tokens_and_zero_grads():
    inputs = make_inputs(0, 3, 16, 16, 8, 32, regs=1)
    out = call(patch_embed, inputs, True)
    assert out.shape == (0, 2 + 4, 32)
    out.sum().backward()
    for name in NAMES:
        assert torch.equal(inputs[name].grad, torch.zeros_like(inputs[name])), name


def test_backward_is_bitwise_repeatable(monkeypatch):
    """Two backward passes give identical bits, also with the dW partials split over several programs."""
    config = pe.patch_embed_config(80, torch.float32)
    small = dataclasses.replace(config, dweight=dataclasses.replace(config.dweight, block_m=16))
    monkeypatch.setattr(pe, "patch_embed_config", lambda arch, dtype, aligned=True, tokens_dtype=None: small)
    M, D = 2 * 4 * 6, 64  # rows of the dW GEMM, width
    splits, _ = pe._dweight_split(M, D, 3 * 1, small.dweight, small.num_sms)
    assert splits == 3
    inputs = make_inputs(2, 3, 32, 48, 8, D, cls=True, regs=1, seed=8)
    check_against_reference(inputs, True, torch.float32)  # correct with a 3-way split
    out = call(patch_embed, {n: None if t is None else t.detach() for n, t in inputs.items()}, True)
    dtokens = torch.randn_like(out)
    args = [inputs[n].detach() for n in NAMES]
    first = patch_embed_bwd(dtokens, *args, True, True)
    second = patch_embed_bwd(dtokens, *args, True, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


class CountLaunches:
    def __init__(self, kernel, counter):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        self.counter.append(self.kernel.fn.__name__)
        return self.kernel[grid]


def test_launch_counts_and_no_image_grad(monkeypatch):
    """One forward launch; two backward launches, a third only when the images require grad, one for a
    frozen projection."""
    launches = []
    for name in ("_patch_embed_fwd_kernel", "_patch_embed_dweight_kernel", "_patch_embed_reduce_kernel",
                 "_patch_embed_dimages_kernel"):
        monkeypatch.setattr(pe, name, CountLaunches(getattr(pe, name), launches))
    inputs = make_inputs(2, 3, 16, 16, 8, 32, cls=True, seed=9)
    inputs["images"].requires_grad_(False)
    out = call(patch_embed, inputs, True)
    assert len(launches) == 1
    dtokens = torch.randn_like(out)
    out.backward(dtokens)
    assert len(launches) == 3 and inputs["images"].grad is None
    _, ref_grads = reference(inputs, True, dtokens)
    assert_close(inputs["weight"].grad, ref_grads["weight"], bound(torch.float32, "dot"), "dweight")
    inputs["images"].requires_grad_(True)
    call(patch_embed, inputs, True).backward(dtokens)
    assert len(launches) == 7 and launches[-1] == "_patch_embed_dimages_kernel"
    # a frozen projection (MoCo v3 style) skips the dW GEMM: one backward launch, still exact grads
    for name in ("images", "weight", "bias"):
        inputs[name] = inputs[name].detach()
    inputs["pos_embed"].grad = inputs["cls_token"].grad = None
    call(patch_embed, inputs, True).backward(dtokens)
    assert launches[7:] == ["_patch_embed_fwd_kernel", "_patch_embed_reduce_kernel"]
    for name in ("pos_embed", "cls_token"):
        assert_close(inputs[name].grad, ref_grads[name], bound(torch.float32, "dot"), f"frozen d{name}")


def test_poisoning_is_active():
    assert torch.isnan(torch.empty(4)).all()


def test_fp32_dot_precision_follows_the_conv_tf32_flag(monkeypatch):
    assert pe.input_precision(torch.float32) == "ieee"  # the fixture turned TF32 off
    monkeypatch_setting(monkeypatch, torch.backends.cudnn, "allow_tf32", True)
    assert pe.input_precision(torch.float32) == "tf32"
    assert pe.input_precision(torch.bfloat16) == "ieee"  # ignored for 16-bit dots


def test_the_tuning_keys_follow_the_tf32_flag(monkeypatch):
    """A tile timed with TF32 dots is not the choice for IEEE ones: the flag is part of each tuning key."""
    from vit_fast.kernels import _tuning

    keys = []
    real = _tuning.choose
    monkeypatch.setattr(_tuning, "choose", lambda op, key, *a, **k: keys.append((op, key)) or real(op, key, *a, **k))
    inputs = make_inputs(2, 3, 16, 16, 8, 32, seed=11)
    for tf32 in (False, True):
        monkeypatch_setting(monkeypatch, torch.backends.cudnn, "allow_tf32", tf32)
        call(patch_embed, inputs, True).sum().backward()
    by_op = {}
    for op, key in keys:
        by_op.setdefault(op, set()).add(key)
    assert "patch_embed_fwd" in by_op and all(len(k) == 2 for k in by_op.values()), by_op


def test_custom_ops_trace_under_compile():
    inputs = make_inputs(2, 3, 16, 32, 8, 32, cls=True, regs=1, seed=10)
    eager = call(patch_embed, inputs, True)
    compiled = torch.compile(lambda *a: patch_embed(*a), backend="aot_eager", fullgraph=True)
    out = compiled(*(inputs[n] for n in NAMES))
    assert torch.equal(out, eager)
    args = tuple(inputs[n].detach() for n in NAMES)
    torch.library.opcheck(patch_embed_fwd.default, args + (True, torch.float32),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(patch_embed_bwd.default, (torch.randn_like(eager),) + args + (True, True, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_small_patches_compile_for_gpu(monkeypatch):
    """P = 1 and 2 (one channel's patch is under tl.dot's 16 K-columns; the interpreter does not check it):
    every GEMM kernel of aot_specs compiles for sm_80 and sm_90 with tensor cores and no spills, in the
    report's compile workers (a real Triton build, not the interpreter)."""
    from vit_fast.tools.report import _compile_all, _python_fn

    # PyTorch's default: fp32 dots on TF32 cores
    monkeypatch_setting(monkeypatch, torch.backends.cudnn, "allow_tf32", True)

    todo = []
    for patch in (1, 2):
        for arch in (80, 90):
            for dtype in (torch.bfloat16, torch.float32):
                specs = pe.aot_specs(tokens=1 + (32 // patch) ** 2, width=192, dtype=dtype, arch=arch,
                                     patch_size=patch, img_size=32, batch=8)
                for spec in (s for s in specs if s.has_dot):
                    tile_k = spec.constexprs["CHANS"] * spec.constexprs["ROWS"] * spec.constexprs["PATCH_PAD"]
                    assert tile_k >= 16, spec.name
                    fn = _python_fn(spec.fn)
                    todo.append((f"{spec.name} out={spec.signature.get('Out')} P={patch} sm_{arch} {dtype}", (
                        fn.__module__, fn.__name__, spec.signature, spec.constexprs, spec.num_warps,
                        spec.num_stages, arch, spec.divisible_by_16)))
    results = dict(_compile_all(todo, workers=2, progress=None))
    assert len(results) == len(todo) == 28  # 16-bit: fp32 tokens (the model's) and 16-bit ones
    for where, result in results.items():
        assert result["error"] == "", f"{where}: {result['error']}"
        assert result["spill_bytes"] == 0 and result["tensor_cores"] != "NO", f"{where}: {result}"


@pytest.mark.parametrize("problem, match", [
    ("h_not_divisible", "not divisible by the patch size"),
    ("w_not_divisible", "not divisible by the patch size"),
    ("zero_height", r"H >= P and W >= P\), got 0x32"),
    ("zero_width", r"H >= P and W >= P\), got 32x0"),
    ("channels", "in_chans=3"),
    ("integer_images", "dtype"),
    ("pos_embed_length", r"pos_embed of shape \(1, 17, 32\)"),
    ("three_dim_images", "4 dims"),
    ("non_square_weight", "square patch"),
    ("bias_shape", "bias of shape"),
])
def test_bad_input_raises_value_error(problem, match):
    inputs = make_inputs(2, 3, 32, 32, 8, 32, cls=True, seed=11)
    x = inputs["images"].detach()
    bad = {
        "h_not_divisible": dict(images=x[:, :, :30]),
        "w_not_divisible": dict(images=x[:, :, :, :20]),
        "zero_height": dict(images=x[:, :, :0]),  # 0 % P == 0, but no patch to embed (M // Np in the kernel)
        "zero_width": dict(images=x[:, :, :, :0]),
        "channels": dict(images=x[:, :2]),
        "integer_images": dict(images=x.to(torch.int32)),
        "pos_embed_length": dict(pos_embed=inputs["pos_embed"][:, 1:]),
        "three_dim_images": dict(images=x[0]),
        "non_square_weight": dict(weight=inputs["weight"][..., :4]),
        "bias_shape": dict(bias=inputs["bias"][:16]),
    }[problem]
    inputs.update(bad)
    with pytest.raises(ValueError, match=match):
        call(patch_embed, inputs, True)


def test_bad_tokens_dtype_is_named():
    inputs = make_inputs(2, 3, 32, 32, 8, 32, cls=True, seed=11)
    with pytest.raises(ValueError, match=r"expected a tokens_dtype in \(float32, float16, bfloat16\), got torch.int32"):
        call(patch_embed, inputs, True, tokens_dtype=torch.int32)


@pytest.mark.parametrize("on_meta", ["weight", "pos_embed", "cls_token"])
def test_a_parameter_on_another_device_is_refused(on_meta):
    """One tensor on another device (a meta parameter left by load_state_dict(..., assign=True, strict=False)) was
    read as uninitialised memory: refused, naming both devices."""
    inputs = make_inputs(2, 3, 16, 16, 8, 32, seed=12)
    inputs = {n: None if t is None else t.detach() for n, t in inputs.items()}
    inputs[on_meta] = torch.empty_like(inputs[on_meta], device="meta")
    with pytest.raises(ValueError, match="patch_embed: expected all tensors on one device"):
        call(patch_embed, inputs, True)
