"""`vit-fast traffic`: the aten and Triton counters, the batch and depth extrapolations, and the fused
path against timm eager (issue 7)."""
import pytest
import torch
import triton

from vit_fast.kernels._utils import kernel_op
from vit_fast.tools import traffic

from . import fixture_kernels as fixture

TINY = "vit_tiny_patch16_224"
# Issue 25's levels reached on vit_tiny at batch 256 (counted value in the comment; bound with a small margin).
# vit_fast / timm torch.compile bytes: 0.713, over issue 25's 0.70 since the qkv bias's gradient is a column sum
# re-reading d(qkv) (0.70 GB of 22.3 here; without it 0.690): the attention kernels' per-tile partials moved fewer
# bytes but measured 0.29 ms per ViT-B/16 b256 block against the sum's 0.075 (H200, 2026-11-27): time decides.
BYTES_VS_COMPILE = 0.72
BYTES_VS_COMPILE_BF16 = 0.635  # with residual_in_fp32=False: 0.627
LAUNCHES = 397  # vit_fast launches per step: 395 (torch.compile 604, eager 657)
# PREDICTED H100 step, ceilings at 100% (the bytes model): the bytes of the
# qkv bias's column sum counted, not the measured cost of the partials it replaced
SPEEDUP_VS_EAGER = 1.67  # eager / vit_fast 1.684
SPEEDUP_VS_COMPILE = 1.38  # compile / vit_fast 1.398
SPEEDUP_VS_COMPILE_BF16 = 1.53  # compile / vit_fast with residual_in_fp32=False 1.548


def test_aten_ops_count_tensor_bytes_flops_and_skip_views():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    bias = torch.randn(16)
    with traffic.StepCounter(instrument_triton=False) as c:
        y = a @ b                              # mm: reads a, b; writes y
        y = y.view(16, 64).t().t()             # views: no launch
        z = y + bias.view(16, 1).expand(16, 64)  # expanded stride-0 operand counts its 16 floats once
    assert [o.name for o in c.ops] == ["mm", "add"]
    mm, add = c.ops
    assert (mm.family, mm.bytes_read, mm.bytes_written, mm.flops) == ("GEMM", (64 * 32 + 32 * 16) * 4, 64 * 16 * 4,
                                                                      2 * 64 * 32 * 16)
    assert (add.family, add.bytes_read, add.bytes_written, add.flops) == ("elementwise", (16 * 64 + 16) * 4,
                                                                          16 * 64 * 4, 0)
    assert z.shape == (16, 64)


def test_roofline_is_the_slower_of_compute_and_memory():
    op = traffic.Op("mm", "GEMM", 1, bytes_read=3e9, bytes_written=0, flops=790e12 * 1e-3)
    assert op.roofline_s("H100", torch.bfloat16) == pytest.approx(1e-3)  # 1 ms of compute, 1 ms of bytes
    assert op.roofline_s("A100", torch.bfloat16) == pytest.approx(790 / 312 * 1e-3)
    assert op.roofline_s("A100", torch.float32) == pytest.approx(2 * 790 / 312 * 1e-3)  # TF32 at half rate


@kernel_op("vit_fast_test::rows_times_vector")
def rows_times_vector(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)          # no kernel: not counted
    scratch = torch.zeros(5)         # a fill kernel in the launcher: counted as an aten op
    M, N = x.shape
    fixture._rows_times_vector_kernel[(triton.cdiv(M, 4),)](y, x, w, M, N, BLOCK_M=4, BLOCK_N=triton.next_power_of_2(N))
    return y + scratch.sum() * 0


def test_triton_launch_counts_unmasked_lanes_and_distinct_addresses():
    """10 rows x 7 columns in programs of 4 rows: 3 programs, each reading all of w (28 B)."""
    x, w = torch.randn(10, 7), torch.randn(7)
    with traffic.StepCounter() as c:
        y = rows_times_vector(x, w)
    torch.testing.assert_close(y, x * w)
    names = [o.name for o in c.ops]
    assert names == ["zeros", "_rows_times_vector_kernel", "sum", "mul", "add"], names
    k = c.ops[1]
    assert k.triton and k.family == "other" and k.launches == 1
    assert k.bytes_read == (70 + 7) * 4            # x once, w once (distinct addresses)
    assert k.requested == (70 + 3 * 7 + 70) * 4    # w requested by each of 3 programs; y written once
    assert k.bytes_written == 70 * 4 and k.flops == 0
    # The interpreter's copies of the arguments to and from the host are not counted as aten ops.
    assert not any(o.name == "copy_" for o in c.ops)


def test_identical_launch_is_replayed_with_the_same_counts():
    x, w = torch.randn(10, 7), torch.randn(7)
    memo = {}
    with traffic.StepCounter(memo=memo) as c:
        rows_times_vector(x, w)
        rows_times_vector(x, w)                # same layouts: replayed
        rows_times_vector(x[:9], w)            # another shape: interpreted
    kernels = [o for o in c.ops if o.triton]
    assert c.replayed == 1 and len(kernels) == 3 and len(memo) == 2
    first, again, other = kernels
    assert (again.bytes_read, again.bytes_written, again.requested) == (first.bytes_read, first.bytes_written,
                                                                        first.requested)
    assert other.bytes_read == (63 + 7) * 4


def test_batch_and_depth_extrapolation_match_direct_counts():
    """Counting at batch 2, 3 and depth 1, 2 then extrapolating equals counting batch 4 at depth 3 directly."""
    kw = dict(dtype=torch.bfloat16, depth=3, img_size=64)  # exactness does not depend on the size
    direct = traffic.measure("timm_eager_unfused_attn", TINY, 4, count_batches=(4,), count_depths=None, **kw)
    modelled = traffic.measure("timm_eager_unfused_attn", TINY, 4, count_batches=(2, 3), count_depths=(1, 2), **kw)
    assert set(direct.groups) == set(modelled.groups)
    for key, want in direct.groups.items():
        for k, v in want.items():
            assert modelled.groups[key][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (key, k)
    assert "extrapolated per op to batch 4" in modelled.how and "extrapolated to depth 3" in modelled.how
    # one block (the depth slope) = depth 3 minus depth 2, counted directly
    shallower = traffic.measure("timm_eager_unfused_attn", TINY, 4, count_batches=(4,), count_depths=None,
                                **{**kw, "depth": 2})
    zero = dict.fromkeys(traffic.TOTAL_KEYS, 0.0)
    for key, block in modelled.block_groups.items():
        for k, v in block.items():
            assert v == pytest.approx(direct.groups[key][k] - shallower.groups.get(key, zero)[k], rel=1e-9, abs=1e-9)
    per_image = modelled.block_by_family()
    assert per_image["total"] > 0
    assert per_image["total"] == pytest.approx(sum(v for f, v in per_image.items() if f != "total"))

def test_eager_timm_step_is_counted_completely():
    r = traffic.measure("timm_eager_unfused_attn", TINY, 2, count_batches=(2,))
    fam = r.by_family()
    assert set(fam) == {"GEMM", "attention", "norm", "elementwise", "embed", "other"}
    # 12 blocks x (qkv, proj, fc1, fc2) + head: forward addmm, backward 2 mm each (input grads of the
    # patch embedding are not needed).
    assert fam["GEMM"]["launches"] == 49 * 3
    assert fam["norm"]["launches"] == 25 * 2
    # ViT-Ti/16: 1.08 GFLOP per image forward in the linear layers, x3 for a training step, 2 images.
    assert fam["GEMM"]["flops"] == pytest.approx(3 * 2 * 2 * 197 * 12 * 442368 + 3 * 2 * 2 * 192 * 1000, rel=1e-6)
    assert r.totals()["H100"] < r.totals()["A100"]


@pytest.mark.slow
def test_fused_step_moves_fewer_bytes_and_launches_than_timm_eager():
    """vit_tiny, 224 px, bf16 autocast, one training step scaled to batch 256: the fused model (as built,
    and with residual_in_fp32=False) against timm eager with SDPA and with fused_attn=False.

    Counted at batch 2 and 3 (per op: fixed + per_image * batch, so the weight traffic that dominates a
    batch of 2 does not hide the activation traffic) and depth 1 and 2 (extrapolated, exact). The fused
    paths' Triton kernels run in the interpreter, identical launches replayed.

    The issue's target, at most 45% of eager's bytes, holds against timm eager with materialised
    attention (fused_attn=False) as built (0.449 counted; 0.395 with the bf16 residual stream). Against
    SDPA eager the bounds are the counted levels with a small margin (0.578 as built, 0.509 bf16 stream):
    there the GEMMs (cuBLAS on both paths) and FlashAttention alone are ~40% of eager's bytes (see
    docs/gpu-readiness.md, Performance). Both rose by about 0.02 when the qkv bias's gradient became a column
    sum re-reading d(qkv) (the kernels' per-tile partials moved fewer bytes but measured 0.29 ms per ViT-B/16
    block against the sum's 0.075 on the H200) and the patch embedding's tokens fp32 from a bf16 GEMM."""
    if not traffic.fused_model_available()[0]:
        pytest.skip(traffic.fused_model_available()[1])  # only on a CUDA machine without TRITON_INTERPRET
    eager_sdpa = traffic.measure("timm_eager", TINY, 256)
    eager = traffic.measure("timm_eager_unfused_attn", TINY, 256)
    counted = {}  # the two fused paths share most launches: each is interpreted once
    fused = traffic.measure("vit_fast", TINY, 256, replay=counted)
    fused_bf16 = traffic.measure("vit_fast_bf16_residual", TINY, 256, replay=counted)
    for r in (fused, fused_bf16):
        triton_families = {f for (f, _, triton) in r.groups if triton}
        assert {"GEMM", "attention", "norm", "elementwise", "embed"} <= triton_families  # every kernel family ran
    detail = ("\n" + traffic.format_summary([eager_sdpa, eager, fused, fused_bf16]) + "\n"
              + traffic.format_top_ops(fused, 10))
    bounds = [(fused, eager, 0.45), (fused, eager_sdpa, 0.59),
              (fused_bf16, eager, 0.40), (fused_bf16, eager_sdpa, 0.52)]
    for ours, reference, bound in bounds:
        f, e = ours.totals(), reference.totals()
        ratio = (f["read"] + f["written"]) / (e["read"] + e["written"])
        assert f["launches"] < e["launches"], f"{ours.path} vs {reference.path}: launches" + detail
        assert ratio <= bound, f"{ours.path} / {reference.path} bytes = {ratio:.3f} > {bound}" + detail
    _hold_predicted_levels(eager_sdpa, fused, fused_bf16, detail)


def _hold_predicted_levels(eager, fused, fused_bf16, detail):
    """Issue 25 on vit_tiny: against timm under torch.compile (counted through inductor), bytes and launches,
    and the PREDICTED H100 step against eager and compile, held to the levels reached (measured value in the
    comment, bound with a small margin). The SASS ceilings enter at 100% here: tests/test_sass.py holds them,
    this test holds what the counts decide (bytes, launches, which kernels carry the FLOPs)."""
    from vit_fast.tools import predict

    compiled = traffic.measure("timm_compile", TINY, 256)
    detail += "\n" + traffic.format_summary([eager, compiled, fused, fused_bf16])
    moved = {r.path: r.totals()["read"] + r.totals()["written"] for r in (compiled, fused, fused_bf16)}
    launches = {r.path: r.totals()["launches"] for r in (eager, compiled, fused, fused_bf16)}
    step = {r.path: predict.predicted_step(r, "H100", torch.bfloat16, {})["seconds"]
            for r in (eager, compiled, fused, fused_bf16)}
    levels = {  # (value, bound): vit_fast / compile bytes, launches; eager / vit_fast and compile / vit_fast time
        "bytes vs compile": (moved["vit_fast"] / moved["timm_compile"], BYTES_VS_COMPILE),
        "bytes vs compile, bf16 stream": (moved["vit_fast_bf16_residual"] / moved["timm_compile"],
                                          BYTES_VS_COMPILE_BF16),
        "launches": (launches["vit_fast"], LAUNCHES),
    }
    for label, (value, bound) in levels.items():
        assert value <= bound, f"{label}: {value:.3f} > {bound}" + detail
    speedups = {
        "eager / vit_fast": (step["timm_eager"] / step["vit_fast"], SPEEDUP_VS_EAGER),
        "compile / vit_fast": (step["timm_compile"] / step["vit_fast"], SPEEDUP_VS_COMPILE),
        "compile / vit_fast bf16 stream": (step["timm_compile"] / step["vit_fast_bf16_residual"],
                                           SPEEDUP_VS_COMPILE_BF16),
    }
    for label, (value, bound) in speedups.items():
        assert value >= bound, f"PREDICTED {label}: {value:.3f} < {bound}" + detail
    assert launches["timm_compile"] < launches["timm_eager"] and moved["timm_compile"] < sum(
        eager.totals()[k] for k in ("read", "written")), detail


def test_batch_spanning_gemm_counts_rows_with_data_not_tile_padding():
    """linear_act's rows run over batch x tokens: 50 rows in a 64- or 128-row tile count as 50, so counts at
    small batches extrapolate to 2*M*N*K at batch 256 (the padding there is at most one tile)."""
    from vit_fast.kernels.linear_act import linear_act

    x = torch.randn(50, 64, requires_grad=True)
    w1, b1, w2 = torch.randn(96, 64), torch.randn(96), torch.randn(64, 96)
    with traffic.StepCounter() as c:
        linear_act(x, w1, b1, w2, "gelu").sum().backward()
    fwd = [o for o in c.ops if o.name == "_linear_act_fwd_kernel"]
    bwd = [o for o in c.ops if o.name == "_linear_act_bwd_kernel"]
    assert len(fwd) == 1 and len(bwd) == 1
    assert fwd[0].flops == 2 * 50 * 64 * 96  # x @ w1^T
    assert bwd[0].flops == 2 * 50 * 64 * 96  # dy @ w2


def test_stored_predict_names_a_path_it_leaves_out(capsys, monkeypatch):
    """`--predict --stored` with a path the shipped counts lack: a line names the path and why (never dropped
    silently), and the stored paths are still predicted."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b16 = "vit_base_patch16_224"
    assert traffic.main(["--model", b16, "--paths", "timm_eager", "vit_fast_bf16_residual", "--predict",
                         "--stored"]) == 0
    out = capsys.readouterr().out
    left_out = traffic.PATH_LABELS["vit_fast_bf16_residual"]
    assert f"{b16}: {left_out}: left out: no stored counts for this path" in out
    assert f"{b16}: {traffic.PATH_LABELS['timm_eager']}" in out
