"""kernels/linear_act_tma.py: linear_act's persistent TMA GEMMs (the sm_90+ 16-bit candidates) against float64,
forward and every gradient, each activation, 197-token and ragged shapes with several tiles per program, the
pointer kernels' outputs on the same tile, bitwise repeatability, the fall-back where TMA's rules fail, the
candidate lists and the ahead-of-time specs. Run through linear_act with its static tiles switched to TMA."""
from __future__ import annotations

import pytest
import torch

from tests.numerics import DEVICE, assert_close, bound, check_matches_reference, randn
from tests.test_linear_act import eager_mlp, inputs
from vit_fast.kernels import linear_act as la
from vit_fast.kernels import linear_act_tma
from vit_fast.kernels._utils import interpreter_active
from vit_fast.kernels.linear_act import GemmTile, linear_act, linear_act_ref
from vit_fast.kernels.linear_act_tma import TmaTile

pytestmark = pytest.mark.usefixtures("poisoned_allocations")  # every launcher allocation NaN (ints -1)
PERSISTENT_PROGRAMS = linear_act_tma.persistent_programs  # the launchers' own count, before a fixture patches it


def _skip_before_sm90():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA kernels need sm_90+")


@pytest.fixture
def tma_launches(monkeypatch):
    """linear_act's 16-bit launches on the TMA kernels (``tma_only``: the static tiles, whatever the architecture
    or the autotuner), three persistent programs on every device (so each steps over several tiles, on a GPU too),
    and the TMA launches counted per pass."""
    _skip_before_sm90()
    monkeypatch.setattr(linear_act_tma, "persistent_programs", lambda device, tiles, per_sm: min(3, tiles))
    counts = {"fwd": 0, "bwd": 0}
    for name in counts:
        real = getattr(linear_act_tma, f"launch_{name}")

        def counted(*args, name=name, real=real, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(linear_act_tma, f"launch_{name}", counted)
    with la.tma_only():
        yield counts


@pytest.mark.parametrize("dtype,param_dtype,activation", [
    (torch.bfloat16, torch.float32, "gelu"),  # autocast's mix: bias read in fp32 in the epilogue
    (torch.bfloat16, torch.bfloat16, "gelu_tanh"),
    (torch.float16, torch.float16, "quick_gelu"),
])
def test_matches_reference(tma_launches, dtype, param_dtype, activation):
    """2 x 197 rows (a ragged last row tile), C = 72 and N = 80 (head-dim-like widths, one partial K step),
    H = 200 (a ragged hidden tile): forward and the four gradients vs float64 and the 2x-eager rule, on the
    TMA kernels (one forward and one dgrad launch)."""
    torch.manual_seed(0)
    ins = inputs((2, 197), 72, 200, 80, dtype, param_dtype, activation=activation)
    check_matches_reference(linear_act, linear_act_ref, ins, dtype, eager_fn=eager_mlp)
    assert tma_launches == {"fwd": 1, "bwd": 1}


def test_vit_b_width_several_tiles_per_program(tma_launches):
    """ViT-B's 768 -> 3072 at 197 tokens on three programs, each stepping over several tiles; no bias (HAS_BIAS off
    in both kernels)."""
    torch.manual_seed(1)
    ins = inputs((197,), 768, 3072, 768, torch.bfloat16, torch.float32, bias=False)
    check_matches_reference(linear_act, linear_act_ref, ins, torch.bfloat16, eager_fn=eager_mlp)
    assert tma_launches == {"fwd": 1, "bwd": 1}


def test_strided_rows_and_weight_column_slices(tma_launches):
    """x whose rows are a column slice of a wider tensor (row stride 2C) and weights sliced from wider ones: the
    descriptors carry the real strides."""
    torch.manual_seed(4)
    c, hid, n = 64, 128, 48
    x = randn(3, 50, 2 * c, grad=False).bfloat16()[..., :c].requires_grad_()
    w1 = randn(hid, c + 32, grad=False, scale=c ** -0.5)[:, :c].requires_grad_()
    w2 = randn(n, hid + 64, grad=False, scale=hid ** -0.5)[:, :hid].requires_grad_()
    check_matches_reference(linear_act, linear_act_ref, dict(x=x, w1=w1, b1=randn(hid), w2=w2), torch.bfloat16,
                            eager_fn=eager_mlp)
    assert tma_launches == {"fwd": 1, "bwd": 1}


def test_same_outputs_as_the_pointer_kernels_and_repeatable(tma_launches):
    """On one tile, the TMA kernels write what the pointer kernels write (h, act'(u), du, the bias gradient summed
    from its partials), twice the same bits. Bitwise against the pointer kernels in the interpreter (same dot
    order); on a GPU within one rounding of the output dtype."""
    torch.manual_seed(2)
    m, c, hid, n = 300, 64, 192, 48
    x, dy = randn(m, c, grad=False).bfloat16(), randn(m, n, grad=False).bfloat16()
    w1, w2 = randn(hid, c, grad=False, scale=c ** -0.5).bfloat16(), randn(n, hid, grad=False, scale=0.1).bfloat16()
    b1 = randn(hid, grad=False)
    tile = GemmTile(64, 64, 32, 4, 2)

    def run(t):
        h, dact, du = (torch.empty(m, hid, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        la.launch_fwd(h, dact, x, w1, b1, "gelu", True, t)
        db = la.launch_bwd(du, dy, w2, dact, True, t)
        return h, dact, du, db

    pointer, tma, again = run(tile), run(TmaTile.of(tile)), run(TmaTile.of(tile))
    assert tma_launches == {"fwd": 2, "bwd": 2}
    for name, a, b, c2 in zip(("h", "dact", "du", "db"), pointer, tma, again):
        assert torch.equal(b, c2), f"{name}: not repeatable"
        if interpreter_active():
            assert torch.equal(a, b), name
        else:
            assert_close(b.double(), a.double(), bound(torch.bfloat16), name)


def test_falls_back_to_the_pointer_kernels_where_tma_rules_fail(tma_launches):
    """A width whose bf16 rows are no multiple of 16 bytes (C = 100: 200 B) or an input view off a 16-byte
    boundary cannot be described to TMA: the same tile runs on the pointer kernels, with the same numbers."""
    torch.manual_seed(3)
    check_matches_reference(linear_act, linear_act_ref, inputs((50,), 100, 64, 32, torch.bfloat16, torch.float32),
                            torch.bfloat16)
    assert tma_launches["fwd"] == 0  # x (M, 100): rows of 200 B
    assert tma_launches["bwd"] == 1  # dy (M, 32), w2 (32, 64), act'(u) (M, 64): all on TMA's rules
    base = randn(51 * 64 + 1, grad=False).bfloat16()
    x = base[1:].view(51, 64).requires_grad_()  # 2 bytes past an aligned allocation
    ins = dict(inputs((51,), 64, 64, 32, torch.bfloat16, torch.float32), x=x)
    before = dict(tma_launches)
    check_matches_reference(linear_act, linear_act_ref, ins, torch.bfloat16)
    assert tma_launches["fwd"] == before["fwd"]
    # a gradient broadcast along rows (stride (0, 1), as from a loss reducing over rows) is not described to TMA
    before = dict(tma_launches)
    m, hid, n = 40, 64, 32
    dy = randn(n, grad=False).bfloat16().expand(m, n)
    w2 = randn(n, hid, grad=False, scale=0.1).bfloat16()
    dact = randn(m, hid, grad=False).bfloat16()
    tile = GemmTile(32, 32, 32, 4, 2)
    du_pointer, du_tma = (torch.empty(m, hid, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    la.launch_bwd(du_pointer, dy, w2, dact, False, tile)
    la.launch_bwd(du_tma, dy, w2, dact, False, TmaTile.of(tile))
    assert torch.equal(du_tma, du_pointer) and tma_launches == before
    assert_close(du_tma, (dy.double() @ w2.double()) * dact.double(), bound(torch.bfloat16), "du")


def _launch_candidates(monkeypatch, arch, dtype, activation="gelu"):
    """The candidate lists linear_act's forward and dgrad hand the autotuner on ``arch`` (their first runs)."""
    seen = {}

    def recording(op, key, candidates, launch, device, module=None):
        seen[op] = tuple(candidates)
        return candidates[0]

    monkeypatch.setattr(la, "gpu_arch", lambda device: arch)
    monkeypatch.setattr(la._tuning, "choose", recording)
    x = randn(20, 64, grad=False).to(dtype)
    w1, w2 = randn(128, 64, grad=False).to(dtype), randn(64, 128, grad=False).to(dtype)
    _, dact = la.linear_act_fwd(x, w1, None, activation, True)
    la.linear_act_bwd(randn(20, 64, grad=False).to(dtype), dact, w2, randn(128, grad=False))
    return seen["linear_act_fwd"], seen["linear_act_bwd"]


def test_candidates_the_launchers_hand_the_autotuner(monkeypatch):
    """The static tile first; in 16 bits the forward's co-resident tile (every activation; never the dgrad, where it
    spills); on sm_90 in 16 bits (unless VIT_FAST_TMA_GEMM=0) the static tile on the TMA kernels first (the static
    choice, measured faster on the H200) and the co-resident TMA tile in both passes; ``tma_only`` hands the static
    one on the TMA kernels alone; fp32 gets neither."""
    def tma(cands):
        return [c for c in cands if isinstance(c, TmaTile)]

    monkeypatch.setenv(linear_act_tma.ENV_SWITCH, "0")
    fwd, bwd = _launch_candidates(monkeypatch, 90, torch.bfloat16)
    assert fwd[0] == la.linear_act_config(torch.bfloat16, 90).fwd and fwd[-1] == la.CO_RESIDENT[90]
    assert not tma(fwd) and not tma(bwd)
    assert la.CO_RESIDENT[90] not in bwd and bwd[0] == la.linear_act_config(torch.bfloat16, 90).bwd
    monkeypatch.delenv(linear_act_tma.ENV_SWITCH)  # the default: on
    for arch, activation in ((80, "gelu"), (80, "quick_gelu")):
        fwd, bwd = _launch_candidates(monkeypatch, arch, torch.float16, activation)
        assert fwd[-1] == la.CO_RESIDENT[arch] and la.CO_RESIDENT[arch] not in bwd and not tma(fwd + bwd)
    for dtype in (torch.bfloat16, torch.float16):
        fwd, bwd = _launch_candidates(monkeypatch, 90, dtype)
        cfg = la.linear_act_config(dtype, 90)
        assert fwd[0] == TmaTile.of(cfg.fwd) and bwd[0] == TmaTile.of(cfg.bwd)
        assert tma(fwd) == [TmaTile.of(cfg.fwd), la.CO_RESIDENT_TMA]
        assert tma(bwd) == [TmaTile.of(cfg.bwd), la.CO_RESIDENT_TMA]
        assert cfg.fwd in fwd and la.CO_RESIDENT[90] in fwd and cfg.bwd in bwd  # the pointer tiles still timed
        assert la.CO_RESIDENT_TMA.programs_per_sm == 2 and TmaTile.of(cfg.fwd).programs_per_sm == 1
        assert not tma(_launch_candidates(monkeypatch, 80, dtype)[0])
        with la.tma_only():
            assert _launch_candidates(monkeypatch, 90, dtype) == ((TmaTile.of(cfg.fwd),), (TmaTile.of(cfg.bwd),))
    fwd, bwd = _launch_candidates(monkeypatch, 90, torch.float32)
    assert not tma(fwd + bwd) and la.CO_RESIDENT[90] not in fwd
    assert la.CO_RESIDENT[80] not in _launch_candidates(monkeypatch, 80, torch.float32)[0]
    with la.tma_only():
        assert not tma(sum(_launch_candidates(monkeypatch, 90, torch.float32), ()))


def test_co_resident_tiles_match_the_reference(tma_launches, monkeypatch):
    """The co-resident candidates (four warps, two programs per SM): the forward's on the pointer kernels (sm_90's
    and sm_80's tiles), and on the TMA kernels forward and dgrad with their own program count (two per SM on a GPU),
    at ViT-B's width on 197 rows, against float64, outputs NaN before the launch."""
    monkeypatch.setattr(linear_act_tma, "persistent_programs", PERSISTENT_PROGRAMS)
    torch.manual_seed(5)
    m, c, hid, n = 197, 768, 512, 768
    x, dy = randn(m, c, grad=False).bfloat16(), randn(m, n, grad=False).bfloat16()
    w1, w2 = randn(hid, c, grad=False, scale=c ** -0.5).bfloat16(), randn(n, hid, grad=False, scale=0.05).bfloat16()
    b1 = randn(hid, grad=False)
    u = (x.double() @ w1.double().t() + b1.double()).requires_grad_()
    gelu = torch.nn.functional.gelu(u, approximate="tanh")
    dgelu, = torch.autograd.grad(gelu.sum(), u)
    for fwd, bwd in ((la.CO_RESIDENT[90], la.linear_act_config(torch.bfloat16, 90).bwd),
                     (la.CO_RESIDENT[80], la.linear_act_config(torch.bfloat16, 80).bwd),
                     (la.CO_RESIDENT_TMA, la.CO_RESIDENT_TMA)):
        h, dact, du = (torch.full((m, hid), float("nan"), device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        la.launch_fwd(h, dact, x, w1, b1, "gelu_tanh", True, fwd)
        db = la.launch_bwd(du, dy, w2, dact, True, bwd)
        assert_close(h, gelu.detach(), bound(torch.bfloat16), f"h {fwd}")
        assert_close(dact, dgelu, bound(torch.bfloat16), f"act'(u) {fwd}")
        du64 = (dy.double() @ w2.double()) * dact.double()
        assert_close(du, du64, bound(torch.bfloat16), f"du {bwd}")
        assert_close(db, du64.sum(0), bound(torch.bfloat16), f"db1 {bwd}")
    assert tma_launches == {"fwd": 1, "bwd": 1}  # the pointer tiles ran the pointer kernels


def test_tma_compatible():
    t = torch.empty(4, 64, dtype=torch.bfloat16)
    assert not linear_act_tma.tma_compatible(torch.empty(64, dtype=torch.bfloat16).expand(4, 64))  # broadcast rows
    assert linear_act_tma.tma_compatible(t, t[:, :32])  # a column slice keeps the row stride
    assert not linear_act_tma.tma_compatible(torch.empty(4, 100, dtype=torch.bfloat16))  # 200 B rows
    assert not linear_act_tma.tma_compatible(t.view(-1)[1:129].view(2, 64))  # base off 16 bytes
    assert not linear_act_tma.tma_compatible(t.t())  # strided columns
    assert not linear_act_tma.tma_compatible(torch.empty(4, 64))  # fp32: the kernels are 16-bit only


def test_aot_specs_sm90_16bit_only():
    """The report compiles the TMA kernels on the static and on the co-resident tiles of sm_90 in fp16 / bf16
    (linear_act's aot_specs): each activation's forward (training and inference) and the dgrad, with tensor
    descriptors of the tiles' block shapes."""
    def tma_specs(**kwargs):
        return [s for s in la.aot_specs(**kwargs) if s.name.endswith("_tma")]

    specs = tma_specs(dtype=torch.bfloat16, arch=90)
    assert sorted(s.name for s in specs) == sorted(
        [f"linear_act_bwd{infix}_tma" for infix in ("", "_co_resident")]
        + [f"linear_act_fwd{infix}_tma" for infix in ("", "_co_resident")] * 6)
    for infix, tile in (("", la.linear_act_config(torch.bfloat16, 90).fwd), ("_co_resident", la.CO_RESIDENT_TMA)):
        fwd = next(s for s in specs if s.name == f"linear_act_fwd{infix}_tma" and s.constexprs["ACT"] == 0)
        assert fwd.signature["x_desc"] == f"tensordesc<bf16[{tile.block_m}, {tile.block_k}]>"
        assert fwd.signature["h_desc"] == f"tensordesc<bf16[{tile.block_m}, {tile.block_n // 2}]>"
        assert fwd.num_warps == tile.num_warps and fwd.num_stages == tile.num_stages
    assert all(s.has_dot for s in specs)
    assert tma_specs(dtype=torch.bfloat16, arch=80) == tma_specs(dtype=torch.float32, arch=90) == []
