"""Tests of kernels/attention.py (Triton interpreter on CPU; the same tests run compiled on a GPU).

Every kernel result is compared with a float64 reference; low-precision results must also stay
within 2x the error of eager PyTorch in the same dtype (the FlashAttention rule, CONTRIBUTING.md 4).
All launcher allocations are poisoned with NaN, so an element a kernel forgets to write fails.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import vit_fast.kernels._utils as kutils
from tests.numerics import DEVICE, DTYPES, assert_close, bound, dtype_id, errors
from vit_fast._compat import monkeypatch_setting  # torch settings served by __getattr__
from vit_fast.kernels import attention as A
from vit_fast.kernels.attention import interface as AI

pytestmark = pytest.mark.usefixtures("poisoned_allocations")  # every launcher allocation NaN (ints -1)
SLACK = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}  # the "+ small atol" of the 2x rule


def make_qkv(B, N, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, 3 * H * D, generator=g, device="cpu").to(device=DEVICE, dtype=dtype)


def make_linear(B, N, H, D, dtype, bias_std=0.5, seed=5):
    """x (B, N, C), the qkv Linear's weight (3C, C) and a bias large enough to matter (q, k and v shift
    by ~half their spread), C = H * D."""
    g = torch.Generator().manual_seed(seed)
    C = H * D
    x = torch.randn(B, N, C, generator=g, device="cpu")
    weight = torch.randn(3 * C, C, generator=g, device="cpu") * C**-0.5
    bias = bias_std * torch.randn(3 * C, generator=g, device="cpu")
    return [t.to(DEVICE, dtype) for t in (x, weight, bias)]


def run(fn, inputs, grad):
    """fn(*inputs) forward + backward with grad; returns (out, [input grads]). Inputs keep their strides."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [x.grad for x in inputs]


def check_2x_eager(fn, ref_fn, inputs, names, seed=1):
    """Forward and every gradient: error vs float64 within the dtype bound and within 2x eager."""
    dtype = inputs[0].dtype
    out_shape = ref_fn(*inputs).shape
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(out_shape, generator=g, device="cpu").to(device=DEVICE, dtype=dtype)
    mine = run(fn, inputs, grad)
    eager = run(ref_fn, inputs, grad)
    ref = run(ref_fn, [x.double() for x in inputs], grad.double())
    for name, m, e, r in zip(["out"] + names, [mine[0], *mine[1]], [eager[0], *eager[1]], [ref[0], *ref[1]]):
        eager_rel = errors(e, r)[0]
        assert_close(m, r, rtol=bound(dtype, "dot"), name=f"{name} ({dtype})")
        assert_close(m, r, rtol=2 * eager_rel + SLACK[dtype], name=f"{name} vs 2x eager ({eager_rel:.2e})")
    return mine


# ---------------------------------------------------------------------------------------------- #
# Correctness against the float64 reference
# ---------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [32, 48, 64, 80, 88, 96, 128])
def test_dtype_head_dim_matrix(dtype, D):
    """Full dtype x head_dim matrix on a small awkward shape (N=7 < one tile, B=2, H=3)."""
    qkv = make_qkv(2, 7, 3, D, dtype)
    check_2x_eager(lambda x: A.attention(x, 3), lambda x: A.attention_ref(x, 3), [qkv], ["dqkv"])


@pytest.mark.parametrize("dtype, B, N, H, D", [
    *[(dtype, *shape) for dtype in DTYPES for shape in [(1, 197, 1, 64), (2, 50, 3, 88), (1, 1, 12, 64)]],
    (torch.float16, 1, 257, 1, 80), (torch.bfloat16, 1, 257, 1, 80),  # fp32 tiles are 16-32 rows: N=50 is multi-tile
], ids=dtype_id)
def test_vit_shapes(dtype, B, N, H, D):
    """ViT token counts (multi-tile, masked last tile, N=1) on few heads, every dtype."""
    qkv = make_qkv(B, N, H, D, dtype)
    check_2x_eager(lambda x: A.attention(x, H), lambda x: A.attention_ref(x, H), [qkv], ["dqkv"])


@pytest.mark.parametrize("B,N,H,D", [(2, 17, 12, 32), (1, 577, 1, 64), (1, 65, 2, 64), (1, 131, 1, 48)])
def test_more_shapes_fp16(B, N, H, D):
    """H=12, N=577 (ViT-B/16 at 384px), one past a tile (65) and a prime (131)."""
    qkv = make_qkv(B, N, H, D, torch.float16)
    check_2x_eager(lambda x: A.attention(x, H), lambda x: A.attention_ref(x, H), [qkv], ["dqkv"])


def test_scale_argument():
    qkv = make_qkv(1, 20, 2, 32, torch.float32)
    check_2x_eager(lambda x: A.attention(x, 2, scale=0.3), lambda x: A.attention_ref(x, 2, scale=0.3), [qkv], ["dqkv"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_attention_qkv_non_contiguous_vs_sdpa(dtype):
    """Separate q, k, v with three different non-contiguous layouts; also matches F.sdpa."""
    B, H, N, D = 2, 3, 33, 40
    g = torch.Generator().manual_seed(3)
    # (B, H, N, D) head-interleaved
    q = torch.randn(B, N, H, D, generator=g, device="cpu").to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, H, D, N, generator=g, device="cpu").to(DEVICE, dtype).transpose(2, 3)  # D-major
    v = torch.randn(B, H, N, 2 * D, generator=g, device="cpu").to(DEVICE, dtype)[..., ::2]  # stride 2 along D
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    seen, real_fwd = [], AI._launch_fwd

    def launch_fwd(q_, k_, v_, *args):  # the kernel reads the strided tensors themselves, no copies
        seen.append((q_.stride(), k_.stride(), v_.stride()))
        return real_fwd(q_, k_, v_, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AI, "_launch_fwd", launch_fwd)
        out, grads = check_2x_eager(A.attention_qkv, A.attention_qkv_ref, [q, k, v], ["dq", "dk", "dv"])
    assert seen == [(q.stride(), k.stride(), v.stride())]
    sdpa = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert_close(out, sdpa, rtol=bound(dtype, "dot"), name="attention_qkv vs F.sdpa")


def test_packed_matches_sdpa_and_timm_attention():
    """Drop-in for timm's Attention: its qkv Linear -> our kernel -> its proj == its eager forward."""
    from timm.models.vision_transformer import Attention

    torch.manual_seed(0)
    module = Attention(dim=192, num_heads=3, qkv_bias=True).to(DEVICE)
    module.fused_attn = False  # timm's plain eager path
    x = torch.randn(2, 50, 192, device=DEVICE, requires_grad=True)
    expected = module(x)
    expected.square().sum().backward()
    x_grad, w_grad = x.grad.clone(), module.qkv.weight.grad.clone()
    x.grad = None
    module.zero_grad()

    qkv = module.qkv(x)
    out = module.proj(A.attention(qkv, 3))
    out.square().sum().backward()
    assert_close(out, expected, rtol=bound(torch.float32, "dot"), name="vs timm Attention")
    assert_close(x.grad, x_grad, rtol=bound(torch.float32, "dot"), name="dx vs timm")
    assert_close(module.qkv.weight.grad, w_grad, rtol=bound(torch.float32, "dot"), name="dW_qkv vs timm")

    B, N = 2, 50
    q, k, v = qkv.detach().reshape(B, N, 3, 3, 64).permute(2, 0, 3, 1, 4).double()
    sdpa = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, 192)
    assert_close(A.attention(qkv.detach(), 3), sdpa, rtol=bound(torch.float32, "dot"), name="vs F.sdpa")


def test_packed_backward_plans_follow_the_layout_of_out():
    """The packed backward's plan holds the per-head strides of out and grad_out: the same values in another layout
    (what a saved-tensor hook may hand back) give the same gradient as a first call in that layout, bitwise."""
    B, N, H, D = 1, 20, 2, 16
    qkv = make_qkv(B, N, H, D, torch.float32)
    out, lse = AI.attention_fwd(qkv, H, D**-0.5, 0.0, None, N)
    grad = torch.randn(B, N, H * D, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    column_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (out, grad)]

    def backward(out_, grad_):
        return AI.attention_bwd(grad_, qkv, None, out_, lse, H, D**-0.5, 0.0, None)[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AI._PACKED_BWD_PLANS, "plans", {})
        first = [backward(*layout) for layout in ((out, grad), (column_major[0], grad), (out, column_major[1]))]
    for i, layout in enumerate(((out, grad), (column_major[0], grad), (out, column_major[1]))):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(AI._PACKED_BWD_PLANS, "plans", {})
            assert torch.equal(first[i], backward(*layout)), i


def test_sum_backward_stride0_grad_and_determinism():
    """.sum() gives an expanded (stride-0) grad_out; two backward runs must be bitwise equal."""
    qkv = make_qkv(2, 70, 2, 64, torch.float16)
    grads = []
    for _ in range(2):
        x = qkv.clone().requires_grad_()
        A.attention(x, 2).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]), "backward is not bitwise deterministic"
    x = qkv.double().requires_grad_()
    A.attention_ref(x, 2).sum().backward()
    assert_close(grads[0], x.grad, rtol=bound(torch.float16, "dot"), name="dqkv from .sum()")


def test_gradient_layout_one_buffer():
    """The packed gradient is one contiguous (B, N, 3*H*D) tensor, as the qkv GEMM backward wants."""
    x = make_qkv(1, 9, 2, 32, torch.float32).requires_grad_()
    out = A.attention(x, 2)
    assert out.shape == (1, 9, 64) and out.is_contiguous()
    out.backward(torch.ones_like(out))
    assert x.grad.shape == x.shape and x.grad.is_contiguous()


# ---------------------------------------------------------------------------------------------- #
# Dropout
# ---------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_dropout_rate_within_3_sigma(p):
    """The drop rate is the quantised t / 256 (p = 0.1 -> 26/256), within 3 sigma of a binomial over all draws and
    within 4 sigma for each of the 16 column positions one Philox call serves (each reads its own byte)."""
    B, H, N = 2, 3, 64
    rate_q = kutils.dropout_rate(p)
    assert rate_q == round(256 * p) / 256
    keep = A.attention_dropout_mask(1234, B, H, N, p, device=DEVICE)
    n = keep.numel()
    rate = 1 - keep.float().mean().item()
    assert abs(rate - rate_q) < 3 * math.sqrt(rate_q * (1 - rate_q) / n), f"drop rate {rate:.4f} vs {rate_q} over {n}"
    per_position = 1 - keep.view(B, H, N, N // 16, 16).float().mean((0, 1, 2, 3))
    sigma = math.sqrt(rate_q * (1 - rate_q) / (n // 16))
    assert (per_position - rate_q).abs().max().item() < 4 * sigma, per_position
    assert not torch.equal(keep, A.attention_dropout_mask(1235, B, H, N, p, device=DEVICE)), "seed ignored"


def test_dropout_rate_quantisation_and_extremes():
    """p is quantised to t / 256 (halves up); t = 0 keeps everything (and draws no seed), t = 256 drops all."""
    rates = (0.0, 0.001, 0.1, 0.25, 0.5, 0.999, 1.0)
    assert [kutils.dropout_threshold(p) for p in rates] == [0, 0, 26, 64, 128, 256, 256]
    assert kutils.dropout_threshold(1.5 / 256) == 2  # round half up
    assert A.attention_dropout_mask(7, 1, 2, 40, 0.0, device=DEVICE).all()
    assert not A.attention_dropout_mask(7, 1, 2, 40, 1.0, device=DEVICE).any()
    qkv = make_qkv(1, 20, 2, 16, torch.float32)
    state = torch.get_rng_state()
    assert torch.equal(A.attention(qkv, 2, dropout_p=0.001, training=True), A.attention(qkv, 2))
    assert torch.equal(torch.get_rng_state(), state), "a rate that quantises to 0 must not draw a seed"


def test_dropout_mask_depends_only_on_seed_head_and_position():
    """Element (i, j) of head b * H + h draws from Philox counter (j // 16, i, b * H + h): the mask of a shorter
    sequence is the corner of a longer one's, whatever the tiling (the kernels tile it differently again)."""
    long = A.attention_dropout_mask(99, 2, 2, 80, 0.5, device=DEVICE)
    short = A.attention_dropout_mask(99, 2, 2, 37, 0.5, device=DEVICE)
    assert torch.equal(short, long[..., :37, :37])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_dropout_forward_and_backward_use_the_same_mask(monkeypatch, dtype):
    """Forward, dK/dV and dQ regenerate one mask: the kernel equals the reference handed that mask."""
    B, N, H, D, p, seed = 2, 37, 2, 32, 0.25, 4321
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE)
    qkv = make_qkv(B, N, H, D, dtype)
    check_2x_eager(lambda x: A.attention(x, H, dropout_p=p, training=True),
                   lambda x: A.attention_ref(x, H, dropout_p=p, training=True, dropout_mask=keep), [qkv], ["dqkv"])


@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("D", [72, 80])
def test_split_head_dim_tables(monkeypatch, arch, p, D):
    """SigLIP So400m's head_dim 72 and ViT-H's 80, run as 64 + 16 columns (their own tiles in attention_config)
    on the sm_80 and sm_90 tables, with and without dropout: N = 37 spans several of the smallest tiles."""
    B, N, H, seed = 1, 37, 2, 99
    assert AI._block_dims(D, True) == (64, 16) and A.attention_config(N, D, torch.float16, arch).fwd.split
    monkeypatch.setattr(AI, "gpu_arch", lambda device: arch)
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE) if p else None
    check_2x_eager(lambda x: A.attention(x, H, dropout_p=p, training=True),
                   lambda x: A.attention_ref(x, H, dropout_p=p, training=True, dropout_mask=keep),
                   [make_qkv(B, N, H, D, torch.float16)], ["dqkv"])


@pytest.mark.parametrize("N", [197, 211, 64, 208, 209])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_last_partial_step_on_sm90_tables(monkeypatch, N, p):
    """Every loop runs its full tiles unmasked, then the rest as one masked step: 16 wide when at most 16 are
    left, else one more full-width tile. On the sm_90 table (forward 128 x 64, dK/dV 32-row q steps, dQ 64-key
    steps) N = 197 leaves 5 rows / keys everywhere (the 16-wide steps), N = 211 leaves 19 (full-width masked
    steps), N = 64 none (no masked step at all), N = 208 exactly 16 and N = 209 17 (the boundary)."""
    B, H, D, seed = 1, 2, 64, 7
    monkeypatch.setattr(AI, "gpu_arch", lambda device: 90)
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    cfg = A.attention_config(N, D, torch.float16, 90, dropout=bool(p))
    assert (cfg.fwd.block_n, cfg.dkdv.block_m, cfg.dq.block_n) == (64, 32, 64)
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE) if p else None
    check_2x_eager(lambda x: A.attention(x, H, dropout_p=p, training=True),
                   lambda x: A.attention_ref(x, H, dropout_p=p, training=True, dropout_mask=keep),
                   [make_qkv(B, N, H, D, torch.float16)], ["dqkv"])


@pytest.mark.parametrize("D, p", [(64, 0.0), (64, 0.25), (72, 0.0)])
def test_every_sm90_candidate_matches_float64(monkeypatch, D, p):
    """Each config autotuning may pick for sm_90's 16-bit forward and backward at 197 tokens (the static 128 rows
    on 8 warps, 64 rows on one warpgroup, the halved steps) runs forward and backward, with and without dropout, the
    qkv bias's gradient included (``attention_linear``), head_dim 64 and So400m's 72 (64 + 16 columns).
    The interpreter ignores num_warps, which is what the 4-warp candidates change: on a GPU this test compiles them
    (bench/gpu_session.sh runs it)."""
    B, N, H, seed = 1, 197, 2, 3
    monkeypatch.setattr(AI, "gpu_arch", lambda device: 90)
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    static = A.attention_config(N, D, torch.float16, 90, dropout=bool(p))
    candidates, forwards = AI._bwd_candidates(static), AI._fwd_candidates(static.fwd, D)
    halved = candidates[1]
    assert (halved.dq.block_m, halved.dq.num_warps, halved.dkdv.block_n) == (64, 4, 64)
    assert (forwards[1].block_m, forwards[1].num_warps) == (static.fwd.block_m // 2, 4)
    real_choose = AI._tuning.choose
    x, weight, bias = make_linear(B, N, H, D, torch.float16)
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE) if p else None
    launched = []
    for bwd, fwd in itertools.zip_longest(candidates, forwards):
        chosen = {"attention_bwd": bwd or candidates[0], "attention_fwd": fwd or forwards[0]}

        def choose(op, key, cands, launch, device, chosen=chosen):
            if op in chosen:
                assert chosen[op] in cands
                launched.append(chosen[op])
                return chosen[op]
            return real_choose(op, key, cands, launch, device)
        monkeypatch.setattr(AI._tuning, "choose", choose)
        check_2x_eager(lambda *t: A.attention_linear(*t, H, dropout_p=p, training=True),
                       lambda *t: A.attention_linear_ref(*t, H, dropout_p=p, training=True, dropout_mask=keep),
                       [x, weight, bias], ["dx", "dweight", "dbias"])
    assert set(candidates) | set(forwards) == set(launched)


@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
def test_unpeeled_wide_16bit_heads_with_dropout(monkeypatch, arch):
    """128-wide 16-bit heads with dropout keep one masked loop (Tile.peel False: their peeled builds spill), as
    fp32 does; 16-bit D <= 64 and the D = 72 / 80 split peel."""
    B, N, H, D, p, seed = 1, 37, 2, 96, 0.25, 5
    monkeypatch.setattr(AI, "gpu_arch", lambda device: arch)
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    cfg = A.attention_config(N, D, torch.float16, arch, dropout=True)
    assert not (cfg.fwd.peel or cfg.dq.peel or cfg.dkdv.peel)
    assert A.attention_config(N, 64, torch.float16, arch, dropout=True).fwd.peel
    assert A.attention_config(N, 72, torch.float16, arch, dropout=True).dq.peel
    assert A.attention_config(N, 80, torch.float16, arch, dropout=True).dq.peel
    assert not A.attention_config(N, 64, torch.float32, arch).fwd.peel
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE)
    check_2x_eager(lambda x: A.attention(x, H, dropout_p=p, training=True),
                   lambda x: A.attention_ref(x, H, dropout_p=p, training=True, dropout_mask=keep),
                   [make_qkv(B, N, H, D, torch.float16)], ["dqkv"])


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_scale_must_be_positive_and_finite(scale):
    """Padded keys are masked with -inf before the scale (it rides in the exponent's FFMA): a scale <= 0 would
    turn them into NaN or +inf, so it is refused by every functional."""
    qkv = make_qkv(1, 9, 2, 16, torch.float32)
    x, w, b = make_linear(1, 9, 2, 16, torch.float32)
    q = qkv[..., :32].unflatten(-1, (2, 16)).transpose(1, 2)
    calls = [lambda: A.attention(qkv, 2, scale=scale), lambda: A.attention_with_lse(qkv, 2, scale=scale),
             lambda: A.attention_linear(x, w, b, 2, scale=scale), lambda: A.attention_qkv(q, q, q, scale=scale)]
    for call in calls:
        with pytest.raises(ValueError, match="expected scale a finite number > 0"):
            call()


def test_dropout_quantised_rate_same_mask_and_deterministic(monkeypatch):
    """p = 0.1 runs as 26/256: the kernels scale kept values by 1 / (1 - 26/256) (1 / 0.9 would miss the fp32
    bound by far); forward, dK/dV (transposed tiles) and dQ use the mask the helper draws; two runs are
    bitwise equal in the output and the gradient."""
    B, N, H, D, p, seed = 1, 50, 2, 16, 0.1, 2024
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE)
    qkv = make_qkv(B, N, H, D, torch.float32, seed=3)
    mine = check_2x_eager(lambda x: A.attention(x, H, dropout_p=p, training=True),
                          lambda x: A.attention_ref(x, H, dropout_p=p, training=True, dropout_mask=keep), [qkv],
                          ["dqkv"])
    grad = torch.randn(B, N, H * D, generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE)
    again = run(lambda x: A.attention(x, H, dropout_p=p, training=True), [qkv], grad)
    assert torch.equal(mine[0], again[0]) and torch.equal(mine[1][0], again[1][0])


def test_dropout_off_paths_identical():
    """p=0 in training, and p>0 in eval, equal the no-dropout kernel bitwise; p>0 changes the output."""
    qkv = make_qkv(1, 40, 2, 32, torch.float32)
    plain = A.attention(qkv, 2)
    assert torch.equal(A.attention(qkv, 2, dropout_p=0.0, training=True), plain)
    assert torch.equal(A.attention(qkv, 2, dropout_p=0.5, training=False), plain)
    torch.manual_seed(7)
    dropped = A.attention(qkv, 2, dropout_p=0.5, training=True)
    assert not torch.equal(dropped, plain)
    torch.manual_seed(7)  # the seed comes from torch's generator: reproducible (and replayed by checkpointing)
    assert torch.equal(A.attention(qkv, 2, dropout_p=0.5, training=True), dropped)
    assert torch.equal(A.attention(qkv, 2, dropout_p=1.0, training=True), torch.zeros_like(plain))


# ---------------------------------------------------------------------------------------------- #
# Attention maps from the saved lse
# ---------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_attention_probs_from_lse(dtype):
    B, N, H, D = 2, 70, 2, 80
    qkv = make_qkv(B, N, H, D, dtype)
    out, lse = A.attention_with_lse(qkv, H)
    q, k, _ = qkv.double().reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    ref = ((q @ k.transpose(-2, -1)) * D**-0.5).softmax(-1)
    assert_close(lse, torch.logsumexp((q @ k.transpose(-2, -1)) * D**-0.5, -1), rtol=bound(dtype, "dot"), name="lse")
    full = A.attention_probs(qkv, lse, H)
    assert full.shape == (B, H, N, N) and full.dtype == torch.float32
    assert_close(full, ref, rtol=bound(dtype, "dot"), name="full map")
    cls = A.attention_probs(qkv, lse, H, rows=[0, 69, 5])
    assert_close(cls, ref[:, :, [0, 69, 5]], rtol=bound(dtype, "dot"), name="rows 0, 69, 5")
    assert torch.allclose(cls.sum(-1), torch.ones(B, H, 3, dtype=torch.float32, device=DEVICE), atol=1e-5)


# ---------------------------------------------------------------------------------------------- #
# Launch plumbing: grid, memory, config table, compile, bad input
# ---------------------------------------------------------------------------------------------- #
def test_grid_folds_batch_heads_onto_axis_0():
    grid = A.attention_grid(100_000, 197, 128)  # e.g. B=8334 x H=12: axis 1 would be illegal
    assert grid == (200_000,)
    assert A.attention_grid(1, 1, 16) == (1,)
    with pytest.raises(ValueError, match="grid limit"):
        A.attention_grid(2**30, 1025, 64)


def test_forward_allocates_only_out_and_lse(monkeypatch):
    """N=257: an N^2 buffer (B*H*N*N = 132098 elements) would dwarf out and lse."""
    from torch.utils._python_dispatch import TorchDispatchMode

    B, N, H, D = 1, 257, 2, 32
    allocations, largest = [], [0]
    real_empty = AI._empty
    def tracked_empty(shape, dtype, device):
        allocations.append((tuple(shape), dtype))
        return real_empty(shape, dtype, device)

    monkeypatch.setattr(AI, "_empty", tracked_empty)

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(t, torch.Tensor):
                    largest[0] = max(largest[0], t.numel())
            return result

    qkv = make_qkv(B, N, H, D, torch.float16)
    with Largest():
        A.attention(qkv, H)
    assert allocations == [((B, N, H * D), torch.float16), ((B, H, N), torch.float32)]
    assert largest[0] <= qkv.numel() < B * H * N * N


def test_config_table_and_aot_specs():
    for N in (1, 7, 50, 197, 257, 577, 1025):
        for D in (32, 64, 72, 80, 88, 128):
            for dtype in DTYPES:
                for arch, dropout in ((80, False), (80, True), (90, False), (90, True)):
                    cfg = A.attention_config(N, D, dtype, arch, dropout=dropout)
                    assert AI._bwd_candidates(cfg)[0] == cfg  # every candidate keeps the phases' shared rows/warps
                    for tile in (cfg.fwd, cfg.dkdv, cfg.dq):  # dropout's keep tile: columns in groups of 16
                        assert tile.block_m >= 16 and tile.block_n >= 16 and tile.num_warps in (4, 8)
                        assert tile.block_m % 16 == 0 and tile.block_n % 16 == 0
    specs = A.aot_specs(tokens=197, width=768, num_heads=12, dtype=torch.bfloat16, arch=90)
    stored_ds = {"attention_bwd_stored_ds_dkdv", "attention_bwd_stored_ds_dq"}  # the candidate, up to 640 tokens
    assert {s.name for s in specs} == {"attention_fwd", "attention_bwd", "attention_probs", "attention_short_fwd",
                                       "attention_short_bwd", "attention_short_bwd_streamed", *stored_ds}
    assert not stored_ds & {s.name for s in A.aot_specs(tokens=1025, width=768, num_heads=12, dtype=torch.bfloat16,
                                                        arch=90)}
    for s in specs:  # every kernel argument is typed, constexprs given, alignment as a real launch
        assert list(s.signature) == list(s.fn.arg_names), s.name
        assert all(s.signature[k] == "constexpr" for k in s.constexprs)
        assert {"stride_qn", "stride_qh"} & set(s.signature) <= set(s.divisible_by_16), s.name
        assert "seq_len" not in s.divisible_by_16  # 197 is no multiple of 16
    bwd = [s for s in specs if s.name == "attention_bwd"]
    assert sorted(s.constexprs["DROPOUT"] for s in bwd) == [False, True]
    short_bwd = [s for s in specs if s.name == "attention_short_bwd"]  # without dropout (held: 208 rows)
    streamed = [s for s in specs if s.name == "attention_short_bwd_streamed"]  # with dropout (held only to 144)
    assert [s.constexprs["DROPOUT"] for s in short_bwd + streamed] == [False, True]
    assert all(s.signature["DQAcc"] == s.signature["Delta"] == "*fp32" for s in streamed)


def test_tf32_only_when_allowed(monkeypatch):
    monkeypatch_setting(monkeypatch, torch.backends.cuda.matmul, "allow_tf32", False)
    assert AI.dot_input_precision(torch.float32) == "ieee"
    monkeypatch_setting(monkeypatch, torch.backends.cuda.matmul, "allow_tf32", True)
    assert AI.dot_input_precision(torch.float32) == "tf32"
    assert AI.dot_input_precision(torch.bfloat16) == "ieee"  # unused for 16-bit dots
    assert A.attention_config(197, 64, torch.float32, 80) == A.attention_config(197, 64, torch.float32, 80, "tf32")
    # the tf32 tile table (larger tiles than IEEE fp32) computes the same attention; tf32 rounding on a GPU
    qkv = make_qkv(1, 70, 2, 80, torch.float32)
    x64 = qkv.double().requires_grad_()
    A.attention_ref(x64, 2).sum().backward()
    x = qkv.clone().requires_grad_()
    out = A.attention(x, 2)
    out.sum().backward()
    assert_close(out, A.attention_ref(qkv.double(), 2), rtol=1e-3, name="tf32 out")
    assert_close(x.grad, x64.grad, rtol=1e-3, name="tf32 dqkv")


def test_torch_compile_fullgraph():
    qkv = make_qkv(1, 20, 2, 32, torch.float32).requires_grad_()
    compiled = torch.compile(lambda x: A.attention(x, 2), fullgraph=True, backend="aot_eager")
    out = compiled(qkv)
    out.sum().backward()
    x = qkv.detach().double().requires_grad_()
    ref = A.attention_ref(x, 2)
    ref.sum().backward()
    assert_close(out, ref, rtol=bound(torch.float32, "dot"), name="compiled out")
    assert_close(qkv.grad, x.grad, rtol=bound(torch.float32, "dot"), name="compiled dqkv")


def test_torch_compile_dropout_without_graph_breaks(monkeypatch):
    """No .item() graph break (the seed is a tensor), a fresh mask per call, eager's mask and dqkv
    for the same torch.manual_seed."""
    from tests.numerics import check_compiled_dropout

    # through attention_linear: the qkv GEMM and the (dqkv, dbias) op trace too
    inputs = [t.requires_grad_() for t in make_linear(1, 20, 2, 32, torch.float32)]
    check_compiled_dropout(lambda x, w, b: A.attention_linear(x, w, b, 2, dropout_p=0.2, training=True), inputs,
                           monkeypatch)


@pytest.mark.parametrize("make, match", [
    (lambda: (make_qkv(1, 4, 2, 32, torch.float32)[..., :-1], 2), "divisible by 3 \\* num_heads"),
    (lambda: (torch.zeros(1, 4, 3 * 2 * 160, device=DEVICE), 2), "head_dim in 1..128"),
    (lambda: (torch.zeros(1, 4, 96, dtype=torch.int32, device=DEVICE), 1), "dtype"),
    (lambda: (torch.zeros(4, 96, device=DEVICE), 1), "3 dims"),
    (lambda: (torch.zeros(1, 96, 4, device=DEVICE).transpose(1, 2), 1), "contiguous"),
    (lambda: (torch.zeros(1, 4, 96, device=DEVICE), 0), "positive int"),
])
def test_bad_input_raises_before_launch(make, match):
    qkv, heads = make()
    with pytest.raises(ValueError, match=match):
        A.attention(qkv, heads)


def test_bad_input_dropout_and_separate_shapes():
    with pytest.raises(ValueError, match="dropout_p"):
        A.attention(make_qkv(1, 4, 1, 32, torch.float32), 1, dropout_p=1.5, training=True)
    q = torch.zeros(1, 2, 5, 32, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        A.attention_qkv(q, q, torch.zeros(1, 2, 6, 32, device=DEVICE))
    with pytest.raises(ValueError, match="rows"):
        qkv = make_qkv(1, 4, 1, 32, torch.float32)
        A.attention_probs(qkv, A.attention_with_lse(qkv, 1)[1], 1, rows=[4])
    lse = A.attention_with_lse(qkv, 1)[1]
    for rows in (torch.tensor([True, False, True, False]), [0.7]):  # a mask, a float: not silently indices
        with pytest.raises(ValueError, match="expected rows as integer indices"):
            A.attention_probs(qkv, lse, 1, rows=rows)
    with pytest.raises(ValueError, match="expected scale a finite number > 0"):
        A.attention_probs(qkv, lse, 1, scale=-1.0)
    assert A.attention_probs(qkv, lse, 1, rows=[]).shape == (1, 1, 0, 4)  # no rows: an empty map


def test_device_without_kernels_raises(monkeypatch):
    """A CPU tensor without the interpreter: a RuntimeError naming CUDA, never a Triton crash."""
    monkeypatch.setattr(kutils, "interpreter_active", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        A.attention(torch.zeros(1, 4, 96), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padded_keys_stay_zero_when_every_score_is_very_negative(dtype):
    """N = 17 leaves padded key columns in the last tile. With every real score very negative, lse is
    very negative and exp(0 - lse) of a padded column overflows: it must be masked, not multiplied
    by the zero k row (inf * 0 = NaN in dq)."""
    B, H, N, D = 1, 1, 17, 16
    level = 10.0 if dtype == torch.float32 else 4.0  # scores -1600 (fp32) / -256 (fp16) in every entry
    q = torch.full((B, H, N, D), level, dtype=dtype, requires_grad=True)
    k = torch.full((B, H, N, D), -level, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(0), device="cpu").to(dtype).requires_grad_()
    grad = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1), device="cpu").to(dtype)
    A.attention_qkv(q, k, v, scale=1.0).backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    A.attention_qkv_ref(*leaves, scale=1.0).backward(grad.double())
    for name, got, ref in zip("qkv", (q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert torch.isfinite(got).all(), f"d{name} has non-finite values"
        # dq is 0 in exact arithmetic (uniform rows, equal keys): what is left is rounding of ds in the
        # input dtype times |k| = level, summed over 17 keys.
        atol = 1e-3 if dtype == torch.float32 else 1e-2  # fp32: scores of -1600 carry ~2e-4 absolute rounding
        assert (got.double() - ref).abs().max() <= atol, f"d{name}"


# ---------------------------------------------------------------------------------------------- #
# attention_linear: the qkv Linear (bias in its GEMM) + attention, the bias's gradient from the kernel
# ---------------------------------------------------------------------------------------------- #
LINEAR_GRADS = ["dx", "dweight", "dbias"]


@pytest.mark.parametrize("dtype, B, N, H, D", [
    (torch.float32, 2, 37, 3, 64),  # fp32 table: two 32-row backward tiles, masked last one
    (torch.float32, 2, 37, 2, 80),  # wide fp32
    (torch.float16, 1, 29, 2, 48),
    (torch.bfloat16, 2, 37, 3, 64),
    (torch.bfloat16, 2, 71, 2, 80),  # wide bf16: three 32-row backward tiles, masked last one
], ids=dtype_id)
def test_attention_linear_forward_and_gradients(dtype, B, N, H, D):
    """out, dx, dweight and dbias against the float64 reference and within 2x eager."""
    inputs = make_linear(B, N, H, D, dtype)
    fn = lambda x, w, b: A.attention_linear(x, w, b, H)  # noqa: E731
    out, grads = check_2x_eager(fn, lambda x, w, b: A.attention_linear_ref(x, w, b, H), inputs, LINEAR_GRADS)
    assert [g.dtype for g in grads] == [dtype] * 3
    x, w, b = (t.double() for t in inputs)
    assert errors(out, A.attention_linear_ref(x, w, None, H))[0] > 10 * bound(dtype, "dot"), "the bias is a no-op"


def _query_rows_case(monkeypatch, dtype, B, N, H, D, rows, p, arch, seed):
    """``attention_linear`` with query_rows and dropout on the ``arch`` table (the seed fixed): its inputs, the call
    and its float64-able reference with the same dropout mask."""
    monkeypatch.setattr(AI, "gpu_arch", lambda device: arch)
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE) if p else None

    def fn(x, w, b):
        return A.attention_linear(x, w, b, H, dropout_p=p, training=True, query_rows=rows)

    def ref(x, w, b):
        return A.attention_linear_ref(x, w, b, H, dropout_p=p, training=True, dropout_mask=keep, query_rows=rows)
    return make_linear(B, N, H, D, dtype), fn, ref


@pytest.mark.parametrize("dtype, N, rows, p, D, arch", [
    (torch.float32, 37, 1, 0.0, 64, 80), (torch.bfloat16, 37, 1, 0.25, 64, 80), (torch.bfloat16, 197, 5, 0.0, 64, 80),
    (torch.float16, 71, 40, 0.25, 64, 80), (torch.float32, 37, 37, 0.0, 64, 80), (torch.float16, 1, 1, 0.0, 64, 80),
    (torch.bfloat16, 9, 3, 0.25, 64, 80), (torch.float16, 197, 1, 0.25, 64, 90), (torch.float16, 131, 57, 0.0, 72, 90),
], ids=dtype_id)
def test_attention_linear_query_rows(monkeypatch, dtype, N, rows, p, D, arch):
    """query_rows = M (the last block under class-token pooling): out is (B, M, C) and bitwise the first M rows
    of the full output, every gradient bitwise that of the full output with zero gradient past row M (the dQ
    rows past M written as zeros, dK/dV summed over M queries), and within 2x eager of float64; on the sm_80 and
    sm_90 tables (128-row dQ tiles; 57 rows leave 25 past the 32-row dK/dV steps), head_dim 72 split too."""
    B, H = 2, 2
    inputs, fn, ref = _query_rows_case(monkeypatch, dtype, B, N, H, D, rows, p, arch, seed=11)
    mine = check_2x_eager(fn, ref, inputs, LINEAR_GRADS)
    assert mine[0].shape == (B, rows, H * D)
    grad = torch.zeros(B, N, H * D, dtype=dtype, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    grad[:, :rows] = torch.randn(B, rows, H * D, generator=g, device="cpu").to(DEVICE, dtype)
    full = run(lambda x, w, b: A.attention_linear(x, w, b, H, dropout_p=p, training=True), inputs, grad)
    assert torch.equal(mine[0], full[0][:, :rows])
    for name, got, want in zip(LINEAR_GRADS, mine[1], full[1]):
        assert torch.equal(got, want), name


def test_attention_linear_query_rows_checked():
    x, w, b = make_linear(1, 9, 2, 16, torch.float32)
    for bad in (0, 10, 2.0, True):
        with pytest.raises(ValueError, match="expected query_rows an int in 1..9"):
            A.attention_linear(x, w, b, 2, query_rows=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_attention_linear_bias_large_next_to_the_projection(dtype):
    """x @ W^T ~ -b (|b| ~ 16) and q, k, v = x @ W^T + b ~ 1: every rounding must be that of eager, on
    the biased q, k, v. (When the kernels took x @ W^T and folded the bias into the tiles they stream
    algebraically, this erred 8-23x eager in fp32 and 11-36x in bf16, in every output.)"""
    B, N, H, D = 2, 37, 2, 64
    x, weight, bias = make_linear(B, N, H, D, torch.float32, bias_std=16.0)
    x[..., 0] = 1.0  # a constant input channel whose weights cancel the bias
    weight[:, 0] = -bias
    fn = lambda x, w, b: A.attention_linear(x, w, b, H)  # noqa: E731
    check_2x_eager(fn, lambda x, w, b: A.attention_linear_ref(x, w, b, H), [t.to(dtype) for t in (x, weight, bias)],
                   LINEAR_GRADS)


def test_attention_linear_under_autocast():
    """As the model runs it: bf16 x and qkv, fp32 weight and bias; their gradients come back fp32 and
    within 2x eager timm's (the same ops under the same autocast) of float64."""
    B, N, H, D = 2, 37, 2, 64
    inputs = make_linear(B, N, H, D, torch.float32)
    inputs[0] = inputs[0].to(torch.bfloat16)
    grad = torch.randn(B, N, H * D, generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE, torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        mine = run(lambda x, w, b: A.attention_linear(x, w, b, H), inputs, grad)
        eager = run(lambda x, w, b: A.attention_linear_ref(x, w, b, H), inputs, grad)
    ref = run(lambda x, w, b: A.attention_linear_ref(x, w, b, H), [t.double() for t in inputs], grad.double())
    assert [t.dtype for t in mine[1]] == [torch.bfloat16, torch.float32, torch.float32]
    for name, m, e, r in zip(["out"] + LINEAR_GRADS, [mine[0], *mine[1]], [eager[0], *eager[1]], [ref[0], *ref[1]]):
        eager_rel = errors(e, r)[0]
        assert_close(m, r, rtol=2 * eager_rel + SLACK[torch.bfloat16], name=f"{name} vs 2x eager ({eager_rel:.2e})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_attention_linear_with_dropout(monkeypatch, dtype):
    """The mask regenerated in forward, dK/dV and dQ equals the reference handed the same mask."""
    B, N, H, D, p, seed = 2, 37, 2, 32, 0.25, 4321
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE)
    check_2x_eager(lambda x, w, b: A.attention_linear(x, w, b, H, dropout_p=p, training=True),
                   lambda x, w, b: A.attention_linear_ref(x, w, b, H, dropout_p=p, training=True, dropout_mask=keep),
                   make_linear(B, N, H, D, dtype), LINEAR_GRADS)


def test_attention_linear_sum_backward_and_determinism():
    """.sum() (stride-0 grad) backward; two runs bitwise equal in every gradient."""
    B, N, H, D = 2, 41, 2, 64
    inputs = make_linear(B, N, H, D, torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in inputs]
        A.attention_linear(*leaves, H).sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "not deterministic"
    leaves = [t.double().requires_grad_() for t in inputs]
    A.attention_linear_ref(*leaves, H).sum().backward()
    for name, got, leaf in zip(LINEAR_GRADS, grads[0], leaves):
        assert_close(got, leaf.grad, rtol=bound(torch.bfloat16, "dot"), name=f"{name} from .sum()")


def test_attention_linear_partial_gradients_and_non_contiguous_x():
    """Only the bias trainable (x, W frozen); no bias at all; a non-contiguous (transposed) x."""
    B, N, H, D = 2, 19, 2, 32
    x, weight, bias = make_linear(B, N, H, D, torch.float32)
    b = bias.clone().requires_grad_()
    A.attention_linear(x, weight, b, H).square().sum().backward()
    ref = bias.double().requires_grad_()
    A.attention_linear_ref(x.double(), weight.double(), ref, H).square().sum().backward()
    assert_close(b.grad, ref.grad, rtol=bound(torch.float32, "dot"), name="dbias alone")
    no_bias = A.attention_linear_ref(x.double(), weight.double(), None, H)
    assert_close(A.attention_linear(x, weight, None, H), no_bias, rtol=bound(torch.float32, "dot"), name="no bias")
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # (B, N, C) with batch stride C
    assert not strided.is_contiguous()
    check_2x_eager(lambda x, w, b: A.attention_linear(x, w, b, H), lambda x, w, b: A.attention_linear_ref(x, w, b, H),
                   [strided, weight, bias], LINEAR_GRADS)


def test_attention_linear_matches_timm_attention():
    """The model's wiring: attention_linear(x, qkv.weight, qkv.bias) -> proj equals timm's Attention
    (qkv_bias=True) in output and every gradient, the qkv bias's included."""
    from timm.models.vision_transformer import Attention

    torch.manual_seed(0)
    module = Attention(dim=96, num_heads=3, qkv_bias=True).to(DEVICE)
    module.fused_attn = False
    torch.nn.init.normal_(module.qkv.bias, std=0.5)
    x = torch.randn(2, 23, 96, device=DEVICE, requires_grad=True)
    expected = module(x)
    expected.square().sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    x.grad = None
    module.zero_grad()
    out = module.proj(A.attention_linear(x, module.qkv.weight, module.qkv.bias, 3))
    out.square().sum().backward()
    assert_close(out, expected, rtol=bound(torch.float32, "dot"), name="vs timm Attention")
    names = ["x"] + [n for n, _ in module.named_parameters()]
    for name, got, ref in zip(names, [x.grad] + [p.grad for p in module.parameters()], ref_grads):
        assert_close(got, ref, rtol=bound(torch.float32, "dot"), name=f"d{name} vs timm")


def test_attention_linear_lse_and_probs():
    """return_lse gives the lse of the biased scores; attention_probs on the biased qkv with it
    recomputes the softmax map."""
    B, N, H, D = 2, 29, 2, 80
    x, weight, bias = make_linear(B, N, H, D, torch.float32)
    out, lse = A.attention_linear(x, weight, bias, H, return_lse=True)
    qkv = F.linear(x, weight, bias)
    q, k, _ = qkv.double().reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-2, -1)) * D**-0.5
    assert_close(lse, torch.logsumexp(scores, -1), rtol=bound(torch.float32, "dot"), name="lse with bias")
    probs = A.attention_probs(qkv, lse, H, rows=[0, 28])
    assert_close(probs, scores.softmax(-1)[:, :, [0, 28]], rtol=bound(torch.float32, "dot"), name="probs with bias")


class _Launches:
    """Counts Triton launches (by kernel name) of the attention kernels, and the aten ops that run meanwhile."""

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.kernels, self.aten = [], []
        log = self

        class Counted:
            def __init__(self, name, fn):
                self.name, self.fn = name, fn

            def __getitem__(self, grid):
                log.kernels.append(self.name)
                return self.fn[grid]

        for name in ("_attention_fwd_kernel", "_attention_bwd_kernel"):
            monkeypatch.setattr(AI, name, Counted(name.strip("_").replace("_kernel", ""), getattr(AI, name)))
        # bound launches hold the kernel they were bound with
        for plans in (AI._FWD_PLANS, AI._BWD_PLANS, AI._PACKED_FWD_PLANS, AI._PACKED_BWD_PLANS):
            monkeypatch.setattr(plans, "plans", {})

        class Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                log.aten.append(func.__name__.split(".")[0])
                op = kutils.kernel_op_of(func)
                if op is not None:  # run the operator's body under the mode: see its aten ops
                    with self:
                        return op.function(*args, **(kwargs or {}))
                return func(*args, **(kwargs or {}))

        self.mode = Aten

    def run(self, fn):
        self.kernels, self.aten = [], []
        with self.mode():
            fn()
        return self.kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_attention_linear_launches(monkeypatch, dtype):
    """Forward: the qkv GEMM with its bias (no separate add) and 1 launch; backward 1 launch (no delta
    pre-pass) and, for a trained bias, one aten sum over d(qkv) (its gradient, as eager's addmm backward), nothing
    filled. Without a bias or with a frozen one: no sum."""
    B, N, H, D = 1, 37, 2, 64
    launches = _Launches(monkeypatch)
    for case in ("none", "frozen", "trained"):
        x, weight, bias = (t.requires_grad_() for t in make_linear(B, N, H, D, dtype))
        bias.requires_grad_(case != "frozen")
        out = []
        fwd = launches.run(lambda: out.append(A.attention_linear(x, weight, None if case == "none" else bias, H)))
        assert fwd == ["attention_fwd"]
        assert not {"add", "add_"} & set(launches.aten), launches.aten
        grad = torch.ones_like(out[0])
        backward = launches.run(lambda: out[0].backward(grad))
        assert backward == ["attention_bwd"], case
        assert launches.aten.count("sum") == (case == "trained"), launches.aten
        # (fill_ is the test's NaN poisoning of every allocation, ones_like the test's grad)
        fills = [op for op in launches.aten if op in ("zero_", "zeros", "zeros_like", "new_zeros")]
        assert not fills, launches.aten


@pytest.mark.parametrize("args, match", [
    (lambda x, w, b: (x[0], w, b, 2), "3 dims"),
    (lambda x, w, b: (x.int(), w, b, 2), "x with dtype"),
    (lambda x, w, b: (x, w[:, :-1], b, 2), r"weight of shape \(3 \* H \* D, 64\)"),
    (lambda x, w, b: (x, w[:-2, :], b[:-2], 2), r"divisible by 3 \* num_heads"),
    (lambda x, w, b: (x, w, b[:-1], 2), r"bias of shape \(192,\)"),
    (lambda x, w, b: (x, w, b.double(), 2), "bias with dtype in"),
    (lambda x, w, b: (x, w, b.to("meta"), 2), "bias on x's device"),
    (lambda x, w, b: (x, w, b, 0), "positive int"),
    (lambda x, w, b: (x[:, :0], w, b, 2), "at least one token"),
    (lambda x, w, b: (x, w.double(), b, 2), "weight with dtype in"),
    (lambda x, w, b: (x, w.half(), b, 2), "weight with x's dtype"),
    (lambda x, w, b: (x, w, b.half(), 2), "bias with x's dtype"),
])
def test_attention_linear_bad_input_raises_before_launch(args, match):
    with pytest.raises(ValueError, match=match):
        A.attention_linear(*args(*make_linear(1, 4, 2, 32, torch.float32)))


@pytest.mark.parametrize("dtype, N, rows, p, D, arch", [
    (torch.float16, 1, 1, 0.0, 64, 80), (torch.bfloat16, 17, 17, 0.25, 64, 80), (torch.float32, 50, 50, 0.0, 80, 80),
    (torch.bfloat16, 197, 197, 0.0, 64, 90), (torch.float16, 197, 1, 0.25, 64, 90),
    (torch.float16, 71, 40, 0.0, 72, 90),
], ids=dtype_id)
def test_stored_ds_backward_matches_float64(monkeypatch, dtype, N, rows, p, D, arch):
    """The stored-dS backward (``StoredDsConfig``: dK, dV and dS in one launch, dQ = scale dS K from the stored dS
    in a second), forced by ``stored_ds_only``: every gradient of ``attention_linear`` (the qkv bias's included)
    within 2x eager of float64, with dropout, query_rows < N (dQ rows past M zeros, no dS for them), the split
    D = 72 and the padded D = 80, on both tables; its workspace is poisoned (NaN) like every launcher allocation,
    so a dS entry read before it is written fails. Two runs bitwise equal."""
    B, H = 2, 2
    inputs, fn, ref = _query_rows_case(monkeypatch, dtype, B, N, H, D, rows, p, arch, seed=7)
    launched = []
    real = AI._launch_stored_ds_bwd
    monkeypatch.setattr(AI, "_launch_stored_ds_bwd", lambda *a: launched.append(a[0]) or real(*a))
    with AI.stored_ds_only():
        mine = check_2x_eager(fn, ref, inputs, LINEAR_GRADS)
        grad = torch.randn(B, rows, H * D, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
        again = run(fn, inputs, grad)
    assert launched and all(isinstance(c, A.StoredDsConfig) for c in launched)
    assert all(torch.equal(a, b) for a, b in zip(mine[1], again[1])), "not bitwise repeatable"


def test_a_batch_1_call_is_tuned_apart_from_the_training_batch():
    """The flash launches' tuning key holds batch x heads (bucketed): a sanity pass at batch 1 fills a few SMs and
    must not decide, and cache, the tile of the training batch's launches."""
    def key(op, B, H=12, N=197):
        q = torch.empty(B, H, N, 64, dtype=torch.bfloat16, device="meta")
        return AI._flash_plan(op, (q,) * 8, N, 0.0, "ieee", 90).launch.key
    for op in ("attention_fwd", "attention_bwd"):
        assert key(op, 1) != key(op, 256) and key(op, 200) == key(op, 256)


def test_stored_ds_offered_at_vit_lengths_only():
    """The autotuner gets the stored-dS backward as one more candidate (in its key) up to 640 tokens and a 512 MiB
    workspace; past either, for the forward and under ``one_launch_only``, the candidate lists stay the flash
    kernel's tiles."""
    def plan(op, B, N, H, D=64, dtype=torch.bfloat16):
        q = torch.empty(B, H, N, D, dtype=dtype, device="meta")
        return AI._flash_plan(op, (q,) * 8, N, 0.0, "ieee", 90)
    vit_b = plan("attention_bwd", 256, 197, 12)
    assert isinstance(vit_b.launch.candidates[-1], A.StoredDsConfig) and vit_b.launch.key[-1] == "stored_ds"
    assert vit_b.launch.candidates[:-1] == AI._bwd_candidates(A.attention_config(197, 64, torch.bfloat16, 90))
    for kept_out in (plan("attention_bwd", 1, 1025, 2), plan("attention_bwd", 4096, 577, 16),
                     plan("attention_fwd", 256, 197, 12)):
        assert not any(isinstance(c, A.StoredDsConfig) for c in kept_out.launch.candidates)
        assert kept_out.launch.key[-1] != "stored_ds"
    with AI.one_launch_only():
        assert plan("attention_bwd", 256, 197, 12).launch.candidates == vit_b.launch.candidates[:-1]
    with AI.stored_ds_only():
        long = AI._flash_plan("attention_bwd", (torch.empty(1, 2, 1025, 64, device="meta"),) * 8, 1025, 0.0, "ieee", 90)
        assert long.launch.candidates == (A.StoredDsConfig.of(A.attention_config(1025, 64, torch.float32, 90)),)
