"""torch.compile counted by lowering it (vit_fast/tools/inductor_count.py) and the predicted-time model (issue 25)."""
import collections
import functools

import pytest
import torch

from vit_fast.tools import inductor_count, traffic

TINY = "vit_tiny_patch16_224"


@functools.cache
def _compiled_records(batch=2, depth=1):
    model = traffic.build_model("timm_eager", TINY, depth=depth)
    return inductor_count.count_compiled_step(model, batch, torch.bfloat16)


@functools.cache
def _eager_ops(batch=2, depth=1):
    model = traffic.build_model("timm_eager", TINY, depth=depth)
    return traffic.count_step(model, batch, torch.bfloat16)


@pytest.mark.slow
def test_compiled_step_against_direct_count():
    """Inductor's library calls are the eager step's GEMMs and attention: same FLOPs, same launches; the fused
    kernels move fewer bytes than eager's elementwise and norm ops."""
    records = _compiled_records()
    eager = _eager_ops()
    assert {r.graph for r in records} == {"forward", "backward"}
    calls = collections.Counter((r.graph, r.name) for r in records if r.kind == "extern")
    # depth 1: qkv, proj, fc1, fc2 and the head are addmm in forward; backward: dX and dW per linear (the head's
    # dX included) as mm; one SDPA each way; the patch-embedding convolution and its backward
    assert calls[("forward", "addmm")] == 5
    assert calls[("backward", "mm")] == 10
    assert sum(v for (g, n), v in calls.items() if "attention" in n) == 2
    assert all("MultiOutput" not in n for _, n in calls)

    def flops(ops, family):
        return sum(o.flops for o in ops if o.family == family)

    ops = inductor_count.to_ops(records)
    assert flops(ops, "GEMM") == pytest.approx(flops(eager, "GEMM"), rel=1e-9)
    assert flops(ops, "attention") == pytest.approx(flops(eager, "attention"), rel=1e-9)
    gemm_bytes = sum(o.bytes for o in ops if o.family == "GEMM")
    eager_gemm_bytes = sum(o.bytes for o in eager if o.family == "GEMM")
    assert gemm_bytes == pytest.approx(eager_gemm_bytes, rel=0.35)  # same matmuls; inductor may fold a transpose
    compiled_bytes = sum(o.bytes for o in ops)
    assert 0 < compiled_bytes < sum(o.bytes for o in eager)
    assert len(ops) < len(eager)
    fused = [r for r in records if r.kind == "triton"]
    assert fused and all(r.bytes_read + r.bytes_written > 0 for r in fused)


def test_predicted_op_model():
    op = traffic.Op("mm", "GEMM", 1, 1e9, 0.0, 0.0)
    # bytes-bound: 1 GB at 3 TB/s plus one launch
    assert traffic.predicted_op_s(op, "H100", torch.bfloat16) == pytest.approx(1e9 / 3e12 + traffic.LAUNCH_OVERHEAD_S)
    op = traffic.Op("mm", "GEMM", 1, 0.0, 0.0, 1e12)
    lib = traffic.predicted_op_s(op, "H100", torch.bfloat16)
    assert lib == pytest.approx(1e12 / (989e12 * traffic.LIBRARY_EFFICIENCY["GEMM"]) + traffic.LAUNCH_OVERHEAD_S)
    tri = traffic.Op("gelu_linear_fwd", "GEMM", 1, 0.0, 0.0, 1e12, triton=True)
    full = traffic.predicted_op_s(tri, "H100", torch.bfloat16, {"GEMM": 1.0})
    low = traffic.predicted_op_s(tri, "H100", torch.bfloat16, {"GEMM": 0.35})
    assert low > full > lib  # a Triton GEMM at a 100% ceiling is calibrated below cuBLAS's assumed efficiency
    assert (low - traffic.LAUNCH_OVERHEAD_S) == pytest.approx((full - traffic.LAUNCH_OVERHEAD_S) / 0.35)


def test_inductor_unavailable_is_clear(monkeypatch):
    from torch._inductor.graph import GraphLowering

    monkeypatch.delattr(GraphLowering, "compile_to_module")
    with pytest.raises(inductor_count.InductorCountUnavailable, match="compile_to_module"):
        inductor_count._Inductor()
