"""The route (vit_fast/route.py) and the attention part's library route (vit_fast/sdpa.py): SDPA on the packed qkv
against a float64 reference at awkward ViT shapes, forward and backward, its gradient plumbing bitwise equal to
eager timm's, repeatable; the measured table's entries named and consistent with its own rule; a model's route
decided once and handed to every part."""
import copy

import pytest
import torch
import torch.nn.functional as F

import vit_fast
import vit_fast.sdpa
from vit_fast import route as route_module
from vit_fast.route import PART_IMPLS, Route, choice_from_times, measured_table, route_for_arch

from .numerics import DEVICE, assert_close, bound
from .test_tuning import tiny_model


def _reference(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """Float64 softmax attention from the packed (B, N, 3HD) qkv -> (B, N, HD)."""
    B, N, width = qkv.shape
    q, k, v = qkv.double().reshape(B, N, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)
    out = ((q @ k.transpose(-2, -1)) * scale).softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, N, -1)


@pytest.mark.parametrize("tokens", [1, 17, 197])
@pytest.mark.parametrize("heads,head_dim", [(2, 64), (3, 72), (2, 80)])
def test_packed_sdpa_matches_float64(tokens, heads, head_dim):
    torch.manual_seed(tokens + head_dim)
    qkv = torch.randn(2, tokens, 3 * heads * head_dim, device=DEVICE, requires_grad=True)
    scale = head_dim ** -0.5
    out = vit_fast.sdpa.packed_sdpa(qkv, heads, scale)
    assert out.shape == (2, tokens, heads * head_dim)
    qkv64 = qkv.detach().double().requires_grad_()
    ref = _reference(qkv64, heads, scale)
    rtol = bound(torch.float32, "dot")
    assert_close(out, ref, rtol, "out")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert_close(qkv.grad, qkv64.grad, rtol, "d(qkv)")


def _eager_timm(qkv, heads, scale, p):
    B, N, _ = qkv.shape
    q, k, v = qkv.reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scale).transpose(1, 2).reshape(B, N, -1)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_packed_sdpa_is_eager_timm_with_fewer_copies_and_repeatable(dropout_p):
    """The same SDPA call as timm's eager attention (same dropout masks from the same seed): output and
    d(qkv) bitwise equal to eager's; and two runs bitwise equal."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 197, 3 * 2 * 64, device=DEVICE)
    grad = torch.randn(2, 197, 2 * 64, device=DEVICE)
    results = []
    for fn in (vit_fast.sdpa.packed_sdpa, vit_fast.sdpa.packed_sdpa, _eager_timm):
        x = qkv.clone().requires_grad_()
        torch.manual_seed(1)
        out = fn(x, 2, 0.125, dropout_p) if fn is _eager_timm else fn(x, 2, 0.125, dropout_p, training=True)
        out.backward(grad)
        results.append((out.detach(), x.grad))
    for out, dqkv in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(dqkv, results[0][1])


def test_packed_sdpa_refuses_a_bad_shape():
    with pytest.raises(ValueError, match=r"expected qkv of shape \(B, N, 3 \* heads \* head_dim\)"):
        vit_fast.sdpa.packed_sdpa(torch.randn(2, 5, 100, device=DEVICE), 3, 0.1)


def test_sdpa_route_runs_packed_sdpa_not_the_kernels_and_matches_float64(monkeypatch):
    model = tiny_model(init_values=0.1).to(DEVICE)
    ref = copy.deepcopy(model).set_backend("torch").double()
    vit_fast.apply_route(model, Route(attention="sdpa", mlp="bias_gelu", source="test"))
    calls = []
    real = vit_fast.sdpa.PackedSDPAFunction.apply
    monkeypatch.setattr(vit_fast.sdpa.PackedSDPAFunction, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr("vit_fast.kernels.attention.attention_linear",
                        lambda *a, **k: pytest.fail("attention kernel called on the sdpa route"))
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    out, expected = model(x), ref(x.double())
    assert len(calls) == len(model.blocks)
    rtol = bound(torch.float32, "dot")
    assert_close(out, expected, rtol, "logits")
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, rtol, name)


def test_route_is_decided_once_and_handed_to_every_part():
    model = tiny_model()
    assert vit_fast.route_of(model) == route_module.STATIC_ROUTE and not model.route_explicit
    model(torch.randn(1, 3, 32, 32))  # first forward: the device's default route (CPU: the static one)
    assert vit_fast.route_of(model).choices() == dict.fromkeys(PART_IMPLS, "fused")
    chosen = Route(patch_embed="eager", attention="sdpa", mlp="bias_gelu", join="eager", source="user")
    vit_fast.apply_route(model, chosen)
    model(torch.randn(1, 3, 32, 32))
    assert vit_fast.route_of(model) is chosen and model.patch_embed.impl == "eager"
    assert all(b.attn.impl == "sdpa" and b.mlp.impl == "bias_gelu" and b.join_impl == "eager" for b in model.blocks)
    assert Route(attention="sdpa").source == "set by hand" and Route().source == "static: every part fused"
    with pytest.raises(ValueError, match=r"attention expected one of \['fused', 'short', 'sdpa', 'eager'\]"):
        Route(attention="flash")
    with pytest.raises(ValueError, match="unknown part"):
        chosen.with_choices({"softmax": "fused"}, "x")


def test_measured_table_names_its_sources_and_follows_its_rule():
    """Every shipped entry says where it was measured (GPU, torch and triton versions, date), and its choice
    is what the rule gives for its times; sm_90's route comes from the table, other archs say nothing was
    measured."""
    table = measured_table()
    tie = table["tie_fraction"]
    assert 0 < tie < 0.1
    for arch, entries in table["archs"].items():
        assert set(entries) <= set(PART_IMPLS), arch
        for part, entry in entries.items():
            for needed in ("NVIDIA", "torch", "triton", "2026-"):
                assert needed in entry["source"], (arch, part, needed)
            assert set(entry["times_ms"]) <= set(PART_IMPLS[part])
            assert entry["choice"] == choice_from_times(part, entry["times_ms"], tie), (arch, part)
    assert route_for_arch(90).source.startswith("measured on sm_90")
    assert route_for_arch(75).source == "static: nothing measured on sm_75"


def test_rule_ignores_noise_and_never_defaults_to_a_nondeterministic_route():
    assert choice_from_times("mlp", {"fused": 1.0, "eager": 0.98}, 0.03) == "fused"
    assert choice_from_times("mlp", {"fused": 1.0, "eager": 0.90, "bias_gelu": 0.80}, 0.03) == "bias_gelu"
    # both SDPA routes (its backward is not bitwise repeatable on CUDA) are left out, however fast
    assert choice_from_times("attention", {"fused": 1.0, "sdpa": 0.5, "eager": 0.9}, 0.03) == "fused"
    assert choice_from_times("attention", {"fused": 1.0, "short": 0.8, "sdpa": 0.5, "eager": 0.6}, 0.03) == "short"


def test_deterministic_mode_keeps_tuning_off_the_nondeterministic_route():
    from vit_fast import tuning

    assert "sdpa" in tuning.candidates_for("attention")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert tuning.candidates_for("attention") == ("fused", "short")
    finally:
        torch.use_deterministic_algorithms(was)


def test_sdpa_route_compiles_fullgraph():
    """Under torch.compile the packed route is traced as plain torch calls (no graph break)."""
    torch._dynamo.reset()
    model = tiny_model().to(DEVICE)
    vit_fast.apply_route(model, Route(attention="sdpa", source="test"))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    out = compiled(x)
    out.sum().backward()
    assert_close(out, eager(x), bound(torch.float32, "dot"), "logits")


def test_a_model_takes_its_devices_route_when_moved_so_a_first_compiled_forward_runs_it(monkeypatch):
    """The default route is decided in eager code, when the model moves to a device (and at an eager forward on a
    device it has not settled): a model compiled before it ever ran eagerly runs the measured route as an eager one
    does, and the compiled region reads no table (file I/O dynamo does not trace; a CUDA-like default forced)."""
    torch._dynamo.reset()
    monkeypatch.setattr("vit_fast.model.default_route", lambda device: route_for_arch(90))
    model = tiny_model().to(DEVICE)
    assert vit_fast.route_of(model).source.startswith("measured on sm_90") and not model.route_explicit
    monkeypatch.setattr("vit_fast.model.default_route", lambda device: pytest.fail("the table read while tracing"))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(torch.randn(2, 3, 32, 32, device=DEVICE)).sum().backward()
    assert vit_fast.route_of(model).source.startswith("measured on sm_90")
    vit_fast.apply_route(model, route_module.STATIC_ROUTE)  # an explicit route survives a move
    model.to(torch.float64)
    assert vit_fast.route_of(model) == route_module.STATIC_ROUTE and model.route_explicit


def test_packed_sdpa_refuses_a_second_backward_clearly_and_yields_to_saved_tensor_hooks(monkeypatch):
    qkv = torch.randn(2, 17, 3 * 2 * 64, device=DEVICE, requires_grad=True)
    out = vit_fast.sdpa.packed_sdpa(qkv, 2, 0.125)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the attention a second time"):
        out.sum().backward()
    applied = []
    real = vit_fast.sdpa.PackedSDPAFunction.apply
    monkeypatch.setattr(vit_fast.sdpa.PackedSDPAFunction, "apply", lambda *a: applied.append(1) or real(*a))
    with torch.autograd.graph.save_on_cpu():  # as non-reentrant checkpointing: hooks must see every saved tensor
        hooked = vit_fast.sdpa.packed_sdpa(qkv, 2, 0.125)
    assert not applied and torch.equal(hooked, out)
    vit_fast.sdpa.packed_sdpa(qkv, 2, 0.125)
    assert applied


def test_measuring_leaves_the_route_as_it_was_and_routes_the_siglip_head():
    from vit_fast import tuning

    model = tiny_model()
    tuning.measure_fusions(model, batch_size=2, dtype=torch.float32)  # nothing timed on CPU; the flag kept
    assert not model.route_explicit
    siglip = vit_fast.create_model("vit_base_patch16_siglip_224", img_size=32, depth=1, embed_dim=64, num_heads=2)
    vit_fast.apply_route(siglip, Route(mlp="eager", source="test"))
    assert siglip.attn_pool.mlp.impl == "eager" and siglip.blocks[0].mlp.impl == "eager"
