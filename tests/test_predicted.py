"""torch.compile counted by lowering it (vit_fast/tools/inductor_count.py) and the predicted-time model (issue 25)."""
import collections
import functools

import pytest
import torch

from vit_fast.tools import inductor_count, predict, traffic

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
    assert predict.predicted_op_s(op, "H100", torch.bfloat16) == pytest.approx(1e9 / 3e12 + predict.LAUNCH_OVERHEAD_S)
    op = traffic.Op("mm", "GEMM", 1, 0.0, 0.0, 1e12)
    lib = predict.predicted_op_s(op, "H100", torch.bfloat16)
    assert lib == pytest.approx(1e12 / (989e12 * predict.LIBRARY_EFFICIENCY["GEMM"]) + predict.LAUNCH_OVERHEAD_S)
    tri = traffic.Op("_linear_act_fwd_kernel", "GEMM", 1, 0.0, 0.0, 1e12, triton=True)
    full = predict.predicted_op_s(tri, "H100", torch.bfloat16, {"linear_act_fwd": 1.0})
    low = predict.predicted_op_s(tri, "H100", torch.bfloat16, {"linear_act_fwd": 0.35})
    assert low > full > lib  # a Triton GEMM at a 100% ceiling is calibrated below cuBLAS's assumed efficiency
    assert (low - predict.LAUNCH_OVERHEAD_S) == pytest.approx((full - predict.LAUNCH_OVERHEAD_S) / 0.35)
    # the ceiling is looked up by the report's kernel name, then the family; the calibration can be overridden
    assert predict.predicted_op_s(tri, "H100", torch.bfloat16, {"GEMM": 0.35}) == pytest.approx(low)
    ideal = predict.predicted_op_s(tri, "H100", torch.bfloat16, {}, calibration=1.0)
    assert ideal == pytest.approx(1e12 / 989e12 + predict.LAUNCH_OVERHEAD_S)
    assert predict.kernel_key("_attention_bwd_kernel") == "attention_bwd"


def _path(name, ops):
    groups = traffic.aggregate(ops, torch.bfloat16)
    return traffic.PathResult(name, groups, batch=4)


def test_predicted_step_and_families_sum_the_ops():
    ops = [traffic.Op("mm", "GEMM", 1, 0.0, 0.0, 2e12), traffic.Op("mm", "GEMM", 1, 0.0, 0.0, 2e12),
           traffic.Op("add", "elementwise", 1, 3e9, 3e9, 0.0),
           traffic.Op("_attention_fwd_kernel", "attention", 1, 0.0, 0.0, 1e12, triton=True)]
    r = _path("vit_fast", ops)
    fam = predict.predicted_by_family(r, "A100", torch.bfloat16, {"attention_fwd": 0.5})
    assert list(fam) == ["GEMM", "attention", "elementwise"]  # FAMILIES order
    lo = predict.LAUNCH_OVERHEAD_S
    assert fam["GEMM"] == pytest.approx(2 * (2e12 / (312e12 * 0.70) + lo))
    assert fam["attention"] == pytest.approx(1e12 / (312e12 * 0.5 * predict.TRITON_CALIBRATION["A100"]) + lo)
    assert fam["elementwise"] == pytest.approx(6e9 / 2e12 + lo)
    step = predict.predicted_step(r, "A100", torch.bfloat16, {"attention_fwd": 0.5}, flops=1e13)
    assert step["seconds"] == pytest.approx(sum(fam.values()))
    assert step["images_per_s"] == pytest.approx(4 / step["seconds"])
    assert step["mfu"] == pytest.approx(1e13 / (step["seconds"] * 312e12))
    assert predict.missing_ceilings(r, {}) == ["_attention_fwd_kernel"]
    assert predict.missing_ceilings(r, {"attention_fwd": 0.5}) == []


def test_classify_kernel_names():
    cases = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": "GEMM",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN": "GEMM",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "GEMM",
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8": "GEMM",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>": "attention",
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "embed",
        "cudnn::engines_precompiled::conv_wgrad_kernel": "embed",
        # cuDNN's generated SDPA kernels: the helpers of its backward name no 'flash', and must not read as conv
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x1": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x64x64_4x1x1_kernel0_0": "attention",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>": "norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "elementwise",
        "void at::native::cunn_SoftMaxForward<4, float, float, LogSoftMaxForwardEpilogue>": "other",
        "void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "other",
        "triton_per_fused_native_layer_norm_0": "elementwise",  # inductor's fusions, as its count groups them
        "triton_poi_fused_add_gelu_1": "elementwise",
        "triton_tem_fused_mm_2": "GEMM",
        "_linear_act_fwd_kernel": "GEMM",
        "_attention_bwd_kernel": "attention",
        "_layer_norm_fwd_kernel": "norm",
        "_patch_embed_dweight_kernel": "embed",
        "_bias_dropout_add_fwd_kernel": "elementwise",
    }
    got = {name: predict.classify_kernel(name) for name in cases}
    assert got == cases


def test_measured_joins_predicted_per_family():
    kernels = [("nvjet_tst_a", 1e-3), ("nvjet_tst_b", 3e-3), ("pytorch_flash::flash_fwd_kernel", 2e-3),
               ("triton_poi_fused_add_0", 0.5e-3), ("triton_per_fused_native_layer_norm_1", 0.5e-3)]
    measured = predict.measured_by_family(kernels * 2)  # two steps
    assert measured == {"GEMM": dict(seconds=pytest.approx(8e-3), launches=4),
                        "attention": dict(seconds=pytest.approx(4e-3), launches=2),
                        "elementwise": dict(seconds=pytest.approx(2e-3), launches=4)}
    rows = predict.join_families({"GEMM": 2e-3, "attention": 4e-3, "norm": 1e-3}, measured, steps=2)
    assert [r[0] for r in rows] == ["GEMM", "attention", "norm", "elementwise", "total"]
    gemm, attn, norm, elem, total = rows
    assert gemm == ("GEMM", 2e-3, pytest.approx(4e-3), 2, pytest.approx(2.0))
    assert attn[4] == pytest.approx(0.5)
    assert norm[2:4] == (0.0, 0)  # predicted only
    assert elem[1] == 0.0 and elem[4] != elem[4]  # measured only: no ratio (NaN)
    assert total[1:4] == (pytest.approx(7e-3), pytest.approx(7e-3), 5)
    text = predict.format_joined("ViT-B/16 vit_fast", "NVIDIA H100 80GB HBM3", rows, step_s=8e-3)
    assert "PREDICTED ms" in text and "measured step (CUDA events" in text and "8.00" in text
    # what the subprocess hands back, joined against counted paths
    r = _path("timm_eager", [traffic.Op("mm", "GEMM", 1, 0.0, 0.0, 1e12)])
    shown = predict.format_measured(TINY, [r], {"timm_eager": dict(families=measured, step_s=1e-2,
                                                                  gpu="NVIDIA A100-SXM4-80GB"),
                                                "vit_fast": dict(error="OutOfMemoryError")}, torch.bfloat16, {})
    assert "(predicted as A100)" in shown and "A100-SXM4" in shown


def test_device_kernels_from_profiler_events():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device, us):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("aten::mm", DeviceType.CPU, 50.0), event("nvjet_tst_a", DeviceType.CUDA, 30.0),
              event("triton_poi_fused_add_0", DeviceType.CUDA, 5.0)]
    kernels = predict.device_kernels(events)
    assert kernels == [("nvjet_tst_a", pytest.approx(30e-6)), ("triton_poi_fused_add_0", pytest.approx(5e-6))]
    assert predict.measured_by_family(kernels)["GEMM"]["launches"] == 1


def test_timing_skips_cleanly_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    measured = predict.measure_paths(TINY, 2, "bf16", ["timm_eager"])
    assert "no CUDA GPU" in measured["skipped"]
    assert "measured: skipped: no CUDA GPU" in predict.format_measured(TINY, [], measured, torch.bfloat16, {})
    with pytest.raises(RuntimeError, match="CUDA"):
        predict.profile_families("timm_eager", TINY, 2, torch.bfloat16)


def test_traffic_predict_cli_on_cpu(capsys, monkeypatch):
    """`vit-fast traffic --predict --measure on` without a GPU: the PREDICTED table, then a clear skip line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert traffic.main(["--model", TINY, "--paths", "timm_eager", "--count-depths", "1", "2", "--predict",
                         "--measure", "on"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "ViT-Ti/16" in out and "timm eager (SDPA attention)" in out
    assert "measured: skipped: no CUDA GPU" in out


def test_inductor_unavailable_is_clear(monkeypatch):
    from torch._inductor.graph import GraphLowering

    monkeypatch.delattr(GraphLowering, "compile_to_module")
    with pytest.raises(inductor_count.InductorCountUnavailable, match="compile_to_module"):
        inductor_count._Inductor()


@pytest.mark.skipif(torch.cuda.is_available(), reason="max-autotune lowers where a GPU can time its choices")
def test_max_autotune_without_a_gpu_is_unavailable_with_the_reason():
    """max-autotune benchmarks its GEMM choices on the device while lowering: without a GPU the count says so."""
    model = traffic.build_model("timm_eager", TINY, depth=1)
    with pytest.raises(inductor_count.InductorCountUnavailable, match="could not lower the forward graph"):
        inductor_count.count_compiled_step(model, 2, torch.bfloat16, mode="max-autotune")


def test_verdict_checks_the_targets_and_prints_the_floor():
    def path(name, gemm_tflop, other_gb, triton_tflop=0.0):
        ops = [traffic.Op("mm", "GEMM", 10, 0.0, 0.0, gemm_tflop * 1e12),
               traffic.Op("add", "elementwise", 10, other_gb * 1e9, 0.0, 0.0)]
        if triton_tflop:
            ops.append(traffic.Op("_linear_act_fwd_kernel", "GEMM", 10, 0.0, 0.0, triton_tflop * 1e12, triton=True))
        return _path(name, ops)

    by_path = {"timm_eager": path("timm_eager", 10, 100), "timm_compile": path("timm_compile", 10, 60),
               "vit_fast": path("vit_fast", 8, 10, triton_tflop=2)}
    text = predict.verdict(by_path, torch.bfloat16, {"H100": {"linear_act_fwd": 1.0}})
    t = {p: predict.predicted_step(r, "H100", torch.bfloat16, {"linear_act_fwd": 1.0})["seconds"]
         for p, r in by_path.items()}
    assert f"vs timm eager: {t['timm_eager'] / t['vit_fast']:.2f}x" in text
    assert "bytes / torch.compile's: 0.17x (target <= 0.7x): met" in text
    ideal = predict.predicted_step(by_path["vit_fast"], "H100", torch.bfloat16, {}, calibration=1.0)["seconds"]
    assert ideal < t["vit_fast"] and f"{ideal * 1e3:.1f} ms" in text
