"""Tests of the short-sequence attention kernels (kernels/attention/short_fwd.py, short_bwd.py), in the Triton
interpreter on CPU and compiled on a GPU: against float64 (forward and every gradient, within the dtype bound and
2x eager's error), poisoned allocations, the ViT token counts the issue names (N = 1, 17, 50, 197, 257), awkward
head dims, query_rows, the qkv bias's gradient, dropout with the flash kernels' mask, bitwise repeatability, clear
refusals, the route that picks them, torch.compile, and 0 spills in their ahead-of-time builds."""
import copy

import pytest
import torch

import vit_fast
from tests.numerics import DEVICE, assert_close, bound
from tests.test_attention import check_2x_eager, make_linear, make_qkv, run
from vit_fast.kernels import attention as A
from vit_fast.kernels.attention import config as AC
from vit_fast.kernels.attention import interface as AI

pytestmark = pytest.mark.usefixtures("poisoned_allocations")  # every launcher allocation NaN (ints -1)
DTYPES16 = (torch.float16, torch.bfloat16)


@pytest.fixture
def launches(monkeypatch):
    """Which family's launchers ran: {'short_fwd': n, 'short_bwd': n, 'flash_fwd': n, 'flash_bwd': n}."""
    counts = dict.fromkeys(("short_fwd", "short_bwd", "flash_fwd", "flash_bwd"), 0)
    for key, name in (("short_fwd", "_launch_short_fwd"), ("short_bwd", "_launch_short_bwd"),
                      ("flash_fwd", "_launch_fwd"), ("flash_bwd", "_launch_bwd"),
                      ("flash_fwd", "_launch_packed_fwd"), ("flash_bwd", "_launch_packed_bwd")):
        def counted(*args, _real=getattr(AI, name), _key=key):
            counts[_key] += 1
            return _real(*args)
        monkeypatch.setattr(AI, name, counted)
    return counts


def test_segments_pad_to_16_rows_in_at_most_three_powers_of_two():
    assert AC.short_segments(197) == (128, 64, 16)  # ViT-B/16 at 224: 208 rows, not 256
    assert AC.short_segments(257) == (256, 16)  # ViT-L/14, DINOv2 at 224
    assert AC.short_segments(50) == (64,)
    assert AC.short_segments(1) == (16,)
    assert AC.short_segments(17) == (32,)
    assert AC.short_segments(240) == (128, 64, 64)  # a fourth segment is rounded into the third
    for n in range(1, 400):
        segments = AC.short_segments(n)
        assert sum(segments) >= n and sum(segments) - n < 64 and len(segments) <= 3
        assert all(s >= 16 and s & (s - 1) == 0 for s in segments)


def test_supported_table():
    bf16 = torch.bfloat16
    assert AC.short_held(197, 64) and AC.short_held(208, 64) and not AC.short_held(209, 64)
    assert not AC.short_held(197, 64, dropout=True) and not AC.short_held(129, 64, dropout=True)
    assert AC.short_held(128, 64, dropout=True)
    assert not AC.short_held(257, 64)  # ViT-L/14: the sm_90 forward spills at 272 rows
    for n in (1, 197, 208, 209, 257, 577, 640):  # up to 640 x 64 elements: the streamed backward beyond the held rows
        assert AC.short_supported(n, 64, bf16)
    assert AC.short_supported(257, 128, bf16) and AC.short_supported(320, 128, bf16)
    assert not AC.short_supported(577, 128, bf16) and not AC.short_supported(321, 128, bf16)
    assert not AC.short_supported(641, 64, bf16) and not AC.short_supported(1370, 64, bf16)  # DINOv2 at 518 px
    assert not AC.short_supported(1000, 32, bf16)  # at most 640 tokens, however narrow the head
    assert not AC.short_supported(17, 64, torch.float32)  # fp32 runs the flash kernels
    for n in range(1, 641):  # every tile a power of two, whatever N
        for arch in (80, 90):
            cfg = AC.short_config(n, 64, bf16, arch)
            powers = (cfg.bwd.block_m, cfg.bwd.block_n) if cfg.dq_workspace else \
                (cfg.fwd.block_m, cfg.bwd.block_n, *cfg.segments)
            assert all(x >= 16 and x & (x - 1) == 0 for x in powers)
            assert cfg.dq_workspace == (cfg.fwd is None) == (not AC.short_held(n, 64))
            assert AC.short_config(n, 64, bf16, arch, dropout=True).dq_workspace == (not AC.short_held(n, 64, True))
            if cfg.fwd is not None:
                assert cfg.fwd.block_n == cfg.bwd.block_m == sum(cfg.segments) >= n


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("B, N, H, D, arch", [
    (1, 197, 1, 64, 80),  # ViT-B/16: segments 128 + 64 + 16, 16 keys per backward step
    (1, 208, 1, 64, 90),  # the most rows, on the sm_90 table (one stage, 16 keys per step)
    (2, 50, 3, 72, 80),  # SigLIP So400m's head_dim, padded to 128 columns
    (2, 17, 2, 32, 80),  # 32 keys per backward step, one segment
    (1, 1, 2, 64, 80),  # one token
    (1, 80, 1, 128, 80),  # the widest head
    # past the held rows: the flash forward and the streamed backward (dQ in the fp32 workspace)
    (1, 257, 2, 64, 90),  # ViT-L/14, DINOv2 and CLIP at 224 px: 32 q rows per step on sm_90
    (1, 577, 1, 64, 80),  # 384 px at patch 16: five key blocks of 128
    (1, 257, 1, 128, 90),  # the widest head at 257 tokens: 64 keys per block
    (2, 300, 1, 72, 80),  # SigLIP's head_dim, padded columns
])
def test_matches_float64(dtype, B, N, H, D, arch, monkeypatch, launches):
    monkeypatch.setattr(AI, "gpu_arch", lambda device: arch)
    qkv = make_qkv(B, N, H, D, dtype, seed=N)
    check_2x_eager(lambda x: A.attention(x, H, kernel="short"), lambda x: A.attention_ref(x, H), [qkv], ["dqkv"])
    held = AC.short_held(N, D)
    assert launches["short_fwd"] == launches["short_bwd"] == 1 and launches["flash_fwd"] == (0 if held else 1)
    assert launches["flash_bwd"] == 0


@pytest.mark.parametrize("N, query_rows", [(197, None), (197, 1), (197, 100), (257, None), (257, 1), (257, 100)])
def test_attention_linear_query_rows_and_bias_gradient(N, query_rows, launches):
    """The qkv Linear with a large bias, every query or the first M (class-token pooling): output, d(x), d(W) and
    d(bias), the column sum of the short backward's d(qkv) (dQ held, and streamed at 257 tokens)."""
    H = 2
    x, w, b = make_linear(2, N, H, 64, torch.bfloat16)
    check_2x_eager(lambda x, w, b: A.attention_linear(x, w, b, H, query_rows=query_rows, kernel="short"),
                   lambda x, w, b: A.attention_linear_ref(x, w, b, H, query_rows=query_rows), [x, w, b],
                   ["dx", "dweight", "dbias"])
    assert launches["short_bwd"] == 1 and launches["flash_bwd"] == 0


# 197 with dropout: streamed (held only to 144 rows), 32 q rows per step on sm_90, 16 on sm_80, 64 keys at D = 32,
# 32 at D = 72 on sm_80
@pytest.mark.parametrize("N, arch, D", [(37, 80, 64), (129, 90, 64), (197, 90, 64), (197, 80, 64), (197, 80, 32),
                                        (197, 80, 72)])
def test_dropout_draws_the_flash_kernels_mask(N, arch, D, monkeypatch):
    """Forward and backward regenerate the mask ``attention_dropout_mask`` draws (the flash kernels' bits)."""
    B, H, p, seed = 2, 2, 0.25, 4321
    monkeypatch.setattr(AI, "gpu_arch", lambda device: arch)
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE)
    check_2x_eager(lambda x: A.attention(x, H, dropout_p=p, training=True, kernel="short"),
                   lambda x: A.attention_ref(x, H, dropout_p=p, training=True, dropout_mask=keep),
                   [make_qkv(B, N, H, D, torch.float16)], ["dqkv"])


@pytest.mark.parametrize("N", [37, 150])  # 150: streamed
def test_dropout_with_query_rows_and_the_bias_gradient(N, monkeypatch):
    """attention_linear with dropout, the first query only (class-token pooling) and the qkv bias's gradient."""
    B, H, D, p, seed = 2, 2, 32, 0.25, 77
    monkeypatch.setattr(AI, "next_seed", lambda device: torch.tensor([seed], device=device))
    keep = A.attention_dropout_mask(seed, B, H, N, p, device=DEVICE)
    check_2x_eager(lambda x, w, b: A.attention_linear(x, w, b, H, dropout_p=p, training=True, query_rows=1,
                                                      kernel="short"),
                   lambda x, w, b: A.attention_linear_ref(x, w, b, H, dropout_p=p, training=True, dropout_mask=keep,
                                                          query_rows=1),
                   make_linear(B, N, H, D, torch.float16), ["dx", "dweight", "dbias"])


def test_lse_and_attention_maps_agree_with_the_flash_kernels():
    qkv = make_qkv(2, 197, 2, 64, torch.bfloat16, seed=3)
    out_s, lse_s = A.attention_with_lse(qkv, 2, kernel="short")
    out_f, lse_f = A.attention_with_lse(qkv, 2)
    assert_close(lse_s, lse_f, 1e-6, "lse")  # fp32 from the same bf16 scores
    assert_close(out_s, out_f, bound(torch.bfloat16, "dot"), "out")
    maps = A.attention_probs(qkv, lse_s, 2, rows=[0, 196])
    assert_close(maps.sum(-1), torch.ones_like(maps.sum(-1)), 1e-5, "rows of the attention maps")


@pytest.mark.parametrize("N", [197, 257])
def test_bitwise_repeatable(N):
    x, w, b = make_linear(1, N, 2, 64, torch.bfloat16)
    grad = torch.randn(1, N, 128).to(DEVICE, torch.bfloat16)
    fn = lambda x, w, b: A.attention_linear(x, w, b, 2, kernel="short")  # noqa: E731
    first, second = run(fn, [x, w, b], grad), run(fn, [x, w, b], grad)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(g1, g2) for g1, g2 in zip(first[1], second[1]))


@pytest.mark.parametrize("N", [197, 257])  # held, streamed
def test_stride0_and_transposed_output_gradients_and_a_sliced_qkv_refused(N, launches):
    """.sum() hands the backward an expanded (stride-0) d(out), a transposed d(out) has unit row stride: both
    against float64, the .sum() one also bitwise repeatable. A packed qkv sliced from a wider buffer (row stride
    3HD + 64) is refused by name, as on the flash route."""
    B, H, D = 2, 2, 64
    qkv = make_qkv(B, N, H, D, torch.bfloat16, seed=N + 1)
    grads = []
    for _ in range(2):
        x = qkv.clone().requires_grad_()
        A.attention(x, H, kernel="short").sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    ref = qkv.double().requires_grad_()
    A.attention_ref(ref, H).sum().backward()
    assert_close(grads[0], ref.grad, bound(torch.bfloat16, "dot"), "dqkv from .sum()")
    d_out = torch.randn(B, H * D, N, dtype=torch.bfloat16).to(DEVICE).transpose(1, 2)  # (B, N, HD), row stride 1
    x = qkv.clone().requires_grad_()
    A.attention(x, H, kernel="short").backward(d_out)
    ref = qkv.double().requires_grad_()
    A.attention_ref(ref, H).backward(d_out.double())
    assert_close(x.grad, ref.grad, bound(torch.bfloat16, "dot"), "dqkv from a transposed d(out)")
    wide = torch.cat([qkv, torch.randn(B, N, 64).to(DEVICE, torch.bfloat16)], dim=-1)
    with pytest.raises(ValueError, match=r"expected a contiguous qkv .* got strides \(\d+, 448, 1\)"):
        A.attention(wide[..., : 3 * H * D], H, kernel="short")
    assert launches["short_bwd"] == 3 and launches["flash_bwd"] == 0


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="expected fp16 or bf16 inputs"):
        A.attention(make_qkv(1, 17, 2, 32, torch.float32), 2, kernel="short")
    with pytest.raises(ValueError, match=r"at most 640 .* at most 40960 \(640 tokens up to head_dim 64, 320 up to "
                                         r"128\); got N=657, head_dim=64 \(672 x 64\).*kernel='flash'"):
        A.attention(make_qkv(1, 657, 1, 64, torch.bfloat16), 1, kernel="short")
    with pytest.raises(ValueError, match=r"got N=577, head_dim=80 \(592 x 128\)"):
        A.attention(make_qkv(1, 577, 1, 80, torch.bfloat16), 1, dropout_p=0.1, training=True, kernel="short")
    with pytest.raises(ValueError, match=r"expected kernel one of \['flash', 'short'\], got 'fast'"):
        A.attention(make_qkv(1, 17, 2, 32, torch.bfloat16), 2, kernel="fast")


@pytest.mark.parametrize("img_size", [32, pytest.param(128, marks=pytest.mark.slow)])
def test_short_route_runs_the_short_kernels_where_they_fit(img_size, launches):
    """The model's 'short' route: under bf16 autocast every block's attention runs the short kernels (logits and
    every gradient within the bf16 bound of float64); in fp32 the same route runs the flash kernels. At 128 px /
    patch 8 (257 tokens) the short forward hands over to the flash forward and the backward is streamed."""
    from tests.test_tuning import tiny_model

    model = tiny_model(img_size=img_size)
    ref = copy.deepcopy(model).set_backend("torch").double()
    vit_fast.apply_route(model, vit_fast.Route(attention="short", source="test"))
    x = torch.randn(2, 3, img_size, img_size, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = model(x)
    out.square().mean().backward()
    out_ref = ref(x.double())
    out_ref.square().mean().backward()
    depth, held = len(model.blocks), img_size == 32
    assert launches["short_fwd"] == launches["short_bwd"] == depth and launches["flash_bwd"] == 0
    assert launches["flash_fwd"] == (0 if held else depth)
    rtol = bound(torch.bfloat16, "dot")
    assert_close(out, out_ref, rtol, "logits")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, rtol, name)
    model(x)  # fp32: the short kernels take 16-bit inputs only
    assert launches["flash_fwd"] == (1 if held else 2) * depth and launches["short_fwd"] == depth


def test_attend_on_the_short_route_follows_the_qkv_dtype(launches):
    """The layer's unfused-projection path (``attend``, a qkv it did not compute): the short kernels for a bf16
    qkv, the flash kernels for an fp32 one even under bf16 autocast (no refusal)."""
    from vit_fast.layers.attention import Attention

    layer = Attention(64, num_heads=2).to(DEVICE)
    layer.impl = "short"
    qkv = torch.randn(2, 17, 192, device=DEVICE)
    ref = A.attention_ref(qkv.double(), 2)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert_close(layer.attend(qkv), ref, bound(torch.float32, "dot"), "fp32 qkv")
    assert launches["flash_fwd"] == 1 and launches["short_fwd"] == 0
    assert_close(layer.attend(qkv.bfloat16()), ref, bound(torch.bfloat16, "dot"), "bf16 qkv")
    assert launches["short_fwd"] == 1


def test_short_route_model_compiles_with_fullgraph(launches):
    """A model on the 'short' route under torch.compile(fullgraph=True) and bf16 autocast: the route's choice of
    family traces, and the compiled forward and backward equal eager's."""
    from tests.test_tuning import tiny_model

    eager, compiled = tiny_model(), tiny_model()
    for model in (eager, compiled):
        vit_fast.apply_route(model, vit_fast.Route(attention="short", source="test"))
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    torch._dynamo.reset()
    step = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out_c, out_e = step(x), eager(x)
    out_c.float().square().mean().backward()
    out_e.float().square().mean().backward()
    assert launches["short_fwd"] == 2 * len(eager.blocks) and launches["flash_fwd"] == 0
    assert torch.equal(out_c, out_e)
    for (name, pc), pe in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiles_with_fullgraph():
    x, w, b = make_linear(1, 50, 2, 32, torch.bfloat16)
    grad = torch.randn(1, 50, 64).to(DEVICE, torch.bfloat16)
    fn = lambda x, w, b: A.attention_linear(x, w, b, 2, kernel="short")  # noqa: E731
    torch._dynamo.reset()
    compiled = run(torch.compile(fn, fullgraph=True, backend="aot_eager"), [x, w, b], grad)
    eager = run(fn, [x, w, b], grad)
    assert torch.equal(compiled[0], eager[0])
    assert all(torch.equal(c, e) for c, e in zip(compiled[1], eager[1]))


@pytest.mark.slow
def test_ahead_of_time_builds_do_not_spill():
    """The short table's largest heads per (arch, dropout), and small ones, compile for sm_80 and sm_90 with no
    spill and tensor cores on every dot (the bar `vit-fast report` holds every launch to)."""
    from vit_fast.tools import report

    cases = [(197, 64, 12), (208, 64, 16), (129, 64, 4), (128, 64, 4), (197, 32, 6), (50, 64, 6), (80, 128, 2),
             (257, 64, 16), (577, 64, 12), (257, 128, 8), (257, 80, 16), (300, 72, 16)]  # streamed backward
    entries = {}
    for tokens, D, H in cases:
        for arch in report.ARCHS:
            for spec in AI._short_aot_specs(tokens, D, torch.bfloat16, arch, AI._launch_values(tokens, H, D)):
                entries[report.spec_key(spec, arch)] = [spec, arch, "bf16", [f"N={tokens} D={D}"]]
    assert {entry[0].name for entry in entries.values()} == {"attention_short_fwd", "attention_short_bwd",
                                                              "attention_short_bwd_streamed"}
    rows = report.compile_entries(entries, workers=2)
    bad = [f"{r.kernel} [{r.config}] sm_{r.arch}: {'; '.join(r.problems())}" for r in rows if r.problems()]
    assert not bad, "\n".join(bad)


def test_bytes_backward_touches_every_element_once_forward_rereads_only_k_and_v(traffic):
    """Counted in the interpreter (masked lanes excluded), ViT-B/16's 197 tokens: the backward reads qkv, out,
    dO and lse once and writes d(qkv) once, the minimum (one launch, no delta pre-pass, nothing recomputed from
    DRAM); the forward reads q once and k, v once per 64-row q tile (4 per head: L2 hits on a GPU), writes out and
    lse once."""
    B, N, H, D = 1, 197, 2, 64
    qkv = make_qkv(B, N, H, D, torch.bfloat16).requires_grad_()
    traffic.clear()
    out, lse = A.attention_with_lse(qkv, H, kernel="short")
    assert traffic.launches == ["_attention_short_fwd_kernel"]
    e, third = qkv.element_size(), qkv.numel() // 3
    assert traffic.bytes("read", qkv) == (third + 2 * third * 4) * e
    assert traffic.bytes("write", out) == out.numel() * e and traffic.bytes("write", lse) == lse.numel() * 4
    grad = torch.randn(out.shape).to(DEVICE, torch.bfloat16)
    traffic.clear()
    out.backward(grad)
    assert traffic.launches == ["_attention_short_bwd_kernel"]
    assert traffic.bytes("read", qkv) == qkv.numel() * e
    assert traffic.bytes("read", out) == out.numel() * e and traffic.bytes("read", grad) == grad.numel() * e
    assert traffic.bytes("read", lse) == lse.numel() * 4
    assert traffic.bytes("write", qkv.grad) == qkv.numel() * e


def test_bytes_streamed_backward(traffic):
    """Counted in the interpreter, 577 tokens (five key blocks of 128): the streamed backward reads k, v and out
    once, q, lse and delta once per key block, dO once more for delta, and writes d(qkv) once; its fp32 dQ workspace
    is written once per key block and read once per block after the first and once at the end (L2 traffic on a
    GPU: each program's 148 KB)."""
    B, N, H, D = 1, 577, 1, 64
    qkv = make_qkv(B, N, H, D, torch.bfloat16).requires_grad_()
    out, lse = A.attention_with_lse(qkv, H, kernel="short")
    grad = torch.randn(out.shape).to(DEVICE, torch.bfloat16)
    traffic.clear()
    out.backward(grad)
    assert traffic.launches == ["_attention_short_bwd_streamed_kernel"]
    blocks, e, third = 5, qkv.element_size(), qkv.numel() // 3
    assert traffic.bytes("read", qkv) == (third * blocks + 2 * third) * e
    assert traffic.bytes("read", out) == out.numel() * e
    assert traffic.bytes("read", grad) == grad.numel() * e * (blocks + 1)
    assert traffic.bytes("read", lse) == lse.numel() * 4 * blocks
    assert traffic.bytes("write", qkv.grad) == qkv.numel() * e
