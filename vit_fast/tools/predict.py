"""Predicted step time of timm eager, timm under torch.compile and vit_fast, counted the same way (issue 25).

Every path's step is counted by `vit-fast traffic` (vit_fast.tools.traffic; torch.compile through
vit_fast.tools.inductor_count) as ops with launches, bytes and FLOPs. Each op is predicted as

    max(bytes / bandwidth, FLOPs / (dense peak x efficiency)) + launches x LAUNCH_OVERHEAD_S

and a step is the sum over its ops (one stream, one op after another). The efficiency is

- for a Triton tensor-core kernel (vit_fast's; inductor's GEMM templates under max-autotune): its SASS ceiling,
  live from `vit-fast report` (vit_fast.tools.sass, the same compile the report makes, cached) x
  TRITON_CALIBRATION[gpu]; the ceiling is an upper bound, the calibration what a 100% ceiling has measured;
- for a library op (cuBLAS GEMMs, SDPA / FlashAttention, cuDNN convolution): LIBRARY_EFFICIENCY, sourced below;
- memory-bound kernels (no FLOPs counted: elementwise, LayerNorm, inductor's fusions, vit_fast's joins) run at
  the measured copy bandwidth, whoever generated them.

MFU = model FLOPs (3 x the analytic forward FLOPs of vit_fast.model.forward_flops, as `vit-fast bench` counts
them) / (step x dense peak). Everything here is PREDICTED; where a GPU is at hand `vit-fast traffic --predict`
also times the paths (:func:`profile_families`, in a subprocess without the Triton interpreter) and prints
predicted beside measured per op family (:func:`join_families`).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from vit_fast.tools.traffic import FAMILIES, PATH_LABELS, ROOFLINE, Op, PathResult, _row, triton_family

# Dense 16-bit tensor peaks, datasheet (CONTRIBUTING.md 5); bandwidths are ROOFLINE's measured copy figures
# (H100 3.0 TB/s read + write for a device copy; A100 2.0).
DENSE_PEAK_TFLOPS = {"H100": 989.0, "A100": 312.0}
GPU_ARCH = {"H100": 90, "A100": 80}
LAUNCH_OVERHEAD_S = 4e-6  # per kernel launch, back to back on one stream (a few microseconds)
# Library ops. cuBLAS: an 8192^3 bf16 GEMM measured 769-798 TFLOP/s on H100/H200 (0.78-0.81 of 989); ViT's GEMMs
# are smaller (M = 50k tokens at batch 256, N, K = 384-4096) with more tile-quantisation and epilogue
# overhead: 0.70 assumed. FlashAttention / SDPA at head_dim 64 and 197 tokens: 0.40 (the tutorial
# flash-attention forward measures 0.40-0.61 of peak; short sequences sit at the low end). cuDNN's patch
# convolution, the loss and anything else with FLOPs: 0.50 (they are < 1% of the FLOPs).
LIBRARY_EFFICIENCY = {"GEMM": 0.70, "attention": 0.40, "embed": 0.50, "other": 0.50, "norm": 0.50, "elementwise": 0.50}
# Triton tensor-core kernels: SASS ceiling x this factor. The tutorial GEMM reads a 100% ceiling and is measured at
# 53% of peak on an H100 at 3072^3 (where cuBLAS measured 59%) and 69-86% on an A100 (triton #3672, #743): the
# low end, so Triton is not flattered. On H100 this puts a 100%-ceiling Triton GEMM (0.53) below cuBLAS (0.70).
TRITON_CALIBRATION = {"H100": 0.53, "A100": 0.69}
PREDICT_PATHS = ("timm_eager", "timm_compile", "vit_fast", "vit_fast_bf16_residual")
PREDICT_PRESETS = ("vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224")
# Issue 25's targets, for ViT-B/16 bf16 batch 256 on H100.
TARGET_PRESET = "vit_base_patch16_224"
TARGETS = dict(vs_eager=1.6, vs_compile=1.25, bytes_vs_compile=0.70)


def kernel_key(name: str) -> str:
    """A counted Triton launch's function name as `vit-fast report` names its spec:
    '_linear_act_fwd_kernel' -> 'linear_act_fwd'."""
    key = name.strip("_")
    return key[: -len("_kernel")] if key.endswith("_kernel") else key


def efficiency(op: Op, gpu: str, ceilings: dict | None = None, calibration: float | None = None) -> float:
    """The fraction of dense peak an op's FLOPs run at. `ceilings` maps a report kernel name (or, as a fallback,
    a family) to its SASS ceiling on `gpu`'s arch; a Triton kernel with FLOPs but no ceiling gets 1.0 (see
    :func:`missing_ceilings`, which the table prints)."""
    if not op.triton:
        return LIBRARY_EFFICIENCY.get(op.family, 0.5)
    ceilings = ceilings or {}
    ceiling = ceilings.get(kernel_key(op.name), ceilings.get(op.family, 1.0))
    return ceiling * (TRITON_CALIBRATION[gpu] if calibration is None else calibration)


def predicted_op_s(op: Op, gpu: str, dtype: torch.dtype, ceilings: dict | None = None,
                   calibration: float | None = None) -> float:
    """One op's predicted seconds on `gpu` (all its launches)."""
    peak = DENSE_PEAK_TFLOPS[gpu] * 1e12 * (0.5 if dtype == torch.float32 else 1.0)
    compute = op.flops / (peak * efficiency(op, gpu, ceilings, calibration)) if op.flops else 0.0
    return max(op.bytes / (ROOFLINE[gpu]["tb_per_s"] * 1e12), compute) + op.launches * LAUNCH_OVERHEAD_S


def _launch_ops(r: PathResult):
    """(launches, one average launch as an Op) per op group of a counted path."""
    for (family, name, triton), g in r.groups.items():
        n = max(g["launches"], 1.0)
        yield n, Op(name, family, 1, g["read"] / n, g["written"] / n, g["flops"] / n, triton=triton)


def predicted_by_family(r: PathResult, gpu: str, dtype: torch.dtype, ceilings: dict | None = None,
                        calibration: float | None = None) -> dict[str, float]:
    """Predicted seconds per op family (FAMILIES order, families the path has)."""
    out: dict[str, float] = {}
    for n, op in _launch_ops(r):
        out[op.family] = out.get(op.family, 0.0) + n * predicted_op_s(op, gpu, dtype, ceilings, calibration)
    return {fam: out[fam] for fam in FAMILIES if fam in out}


def model_flops(preset: str, batch: int) -> float:
    """Training FLOPs of one step as `vit-fast bench` counts MFU: 3 x the analytic forward FLOPs."""
    from vit_fast.model import forward_flops
    from vit_fast.presets import get_config

    return 3.0 * forward_flops(get_config(preset)) * batch


def predicted_step(r: PathResult, gpu: str, dtype: torch.dtype, ceilings: dict | None = None,
                   calibration: float | None = None, flops: float | None = None) -> dict:
    """Predicted step seconds, images/s and MFU. `flops` defaults to the FLOPs the path's count found."""
    seconds = sum(predicted_by_family(r, gpu, dtype, ceilings, calibration).values())
    flops = r.totals()["flops"] if flops is None else flops
    return dict(seconds=seconds, images_per_s=r.batch / seconds, mfu=flops / (seconds * DENSE_PEAK_TFLOPS[gpu] * 1e12))


def ceilings_from_report(arch: int, dtype_name: str = "bf16", presets=(TARGET_PRESET,)) -> dict[str, float]:
    """The worst SASS ceiling per Triton kernel over the configs `presets` launch in training (no dropout), live
    from `vit-fast report` (compiled ahead of time on first use, then cached; a changed kernel recompiles)."""
    from vit_fast.tools import report

    out: dict[str, float] = {}
    for row in report.run_report(tuple(presets), (dtype_name,), (arch,), tensor_core_only=True):
        if row.ceiling is None or "DROPOUT=True" in row.config:
            continue
        out[row.kernel] = min(out.get(row.kernel, 1.0), row.ceiling)
    return out


def missing_ceilings(r: PathResult, ceilings: dict) -> list[str]:
    """Triton kernels with tensor-core FLOPs that the ceilings do not cover (predicted at a 100% ceiling)."""
    return sorted({op.name for _, op in _launch_ops(r) if op.triton and op.flops
                   and kernel_key(op.name) not in ceilings and op.family not in ceilings})


# ----------------------------------------------------------------------------------------------
# Tables


def model_label(preset: str) -> str:
    from vit_fast.presets import get_config

    cfg = get_config(preset)
    size = {384: "S", 768: "B", 1024: "L", 192: "Ti", 1280: "H"}.get(cfg.embed_dim, str(cfg.embed_dim))
    return f"ViT-{size}/{cfg.patch_size[0]}"


def format_predicted(results: dict[str, list[PathResult]], dtype: torch.dtype, ceilings: dict) -> str:
    """The PREDICTED table: per model and path, step ms, images/s and MFU on H100 and A100.
    `ceilings` is {preset: {gpu: {kernel: ceiling}}}."""
    head = ("model", "path (PREDICTED, not measured)", "H100 ms", "img/s", "MFU", "A100 ms", "img/s", "MFU")
    widths = (9, 44, 8, 7, 5, 8, 7, 5)
    lines = [_row(head, widths)]
    for preset, paths in results.items():
        for r in paths:
            cells = [model_label(preset), PATH_LABELS.get(r.path, r.path)]
            for gpu in ("H100", "A100"):
                p = predicted_step(r, gpu, dtype, ceilings.get(preset, {}).get(gpu), flops=model_flops(preset,
                                                                                                          r.batch))
                cells += [f"{p['seconds'] * 1e3:.1f}", f"{p['images_per_s']:.0f}", f"{p['mfu']:.0%}"]
            lines.append(_row(cells, widths))
    lines.append(describe_model())
    for preset, by_gpu in ceilings.items():
        for gpu, c in by_gpu.items():
            shown = ", ".join(f"{k} {v:.0%}" for k, v in sorted(c.items()))
            lines.append(f"SASS ceilings ({model_label(preset)}, sm_{GPU_ARCH[gpu]}, live from vit-fast report): "
                         f"{shown}")
    for preset, paths in results.items():
        for r in paths:
            for gpu, c in ceilings.get(preset, {}).items():
                missing = missing_ceilings(r, c)
                if missing:
                    lines.append(f"no ceiling for {', '.join(missing)} ({PATH_LABELS.get(r.path, r.path)}, {gpu}): "
                                 "predicted at a 100% ceiling")
    return "\n".join(lines)


def describe_model() -> str:
    return (f"model: per op max(bytes / bandwidth, FLOPs / (dense peak x efficiency)) + "
            f"{LAUNCH_OVERHEAD_S * 1e6:.0f} us per launch; peaks {DENSE_PEAK_TFLOPS} TFLOP/s, bandwidth "
            f"{ {g: v['tb_per_s'] for g, v in ROOFLINE.items()} } TB/s; library efficiency GEMM "
            f"{LIBRARY_EFFICIENCY['GEMM']}, SDPA {LIBRARY_EFFICIENCY['attention']}, "
            f"conv {LIBRARY_EFFICIENCY['embed']}; "
            f"Triton tensor-core kernels: SASS ceiling x {TRITON_CALIBRATION}; MFU on 3 x analytic forward FLOPs")


def format_families(r: PathResult, dtype: torch.dtype, ceilings: dict) -> str:
    """Predicted ms per op family on H100 and A100, with launches and GB: where a path's time goes."""
    h100 = predicted_by_family(r, "H100", dtype, ceilings.get("H100"))
    a100 = predicted_by_family(r, "A100", dtype, ceilings.get("A100"))
    fams = r.by_family()
    head = ("family", "launches", "GB", "TFLOP", "H100 ms", "A100 ms")
    widths = (12, 8, 8, 7, 8, 8)
    lines = [f"{PATH_LABELS.get(r.path, r.path)}, PREDICTED per family:", _row(head, widths)]
    for fam, s in h100.items():
        t = fams.get(fam, {})
        lines.append(_row((fam, round(t.get("launches", 0)), f"{(t.get('read', 0) + t.get('written', 0)) / 1e9:.1f}",
                           f"{t.get('flops', 0) / 1e12:.1f}", f"{s * 1e3:.1f}", f"{a100[fam] * 1e3:.1f}"), widths))
    lines.append(_row(("total", "", "", "", f"{sum(h100.values()) * 1e3:.1f}", f"{sum(a100.values()) * 1e3:.1f}"),
                      widths))
    return "\n".join(lines)


def _library_gemm_s(r: PathResult, gpu: str, dtype: torch.dtype) -> float:
    return sum(n * predicted_op_s(op, gpu, dtype) for n, op in _launch_ops(r) if op.family == "GEMM" and not op.triton)


def verdict(by_path: dict[str, PathResult], dtype: torch.dtype, ceilings: dict, gpu: str = "H100") -> str:
    """Issue 25's targets for one model on `gpu`, and the floor: what the step would be with every Triton
    tensor-core kernel at efficiency 1.0 (100% ceiling, no calibration), and how much of it cuBLAS holds."""
    fused = by_path["vit_fast"]
    c = ceilings.get(gpu)
    t = {p: predicted_step(r, gpu, dtype, c)["seconds"] for p, r in by_path.items()}
    # the floor: every Triton tensor-core kernel at efficiency 1.0 (no ceilings given -> 1.0, calibration 1.0)
    ideal = {p: predicted_step(r, gpu, dtype, {}, calibration=1.0)["seconds"] for p, r in by_path.items()}
    moved = {p: r.totals()["read"] + r.totals()["written"] for p, r in by_path.items()}
    lines = [f"targets (issue 25), {gpu}, PREDICTED:"]

    def check(label, value, target, higher=True):
        ok = value >= target if higher else value <= target
        lines.append(f"  {label}: {value:.2f}x (target {'>=' if higher else '<='} {target}x): "
                     f"{'met' if ok else 'NOT met'}")

    for p in [p for p in ("vit_fast", "vit_fast_bf16_residual") if p in by_path]:
        check(f"{PATH_LABELS[p]} vs timm eager", t["timm_eager"] / t[p], TARGETS["vs_eager"])
        check(f"{PATH_LABELS[p]} vs torch.compile", t["timm_compile"] / t[p], TARGETS["vs_compile"])
        check(f"{PATH_LABELS[p]} bytes / torch.compile's", moved[p] / moved["timm_compile"],
              TARGETS["bytes_vs_compile"], higher=False)
    gemm = _library_gemm_s(fused, gpu, dtype)
    need_eager, need_compile = t["timm_eager"] / TARGETS["vs_eager"], t["timm_compile"] / TARGETS["vs_compile"]
    for p in [p for p in ("vit_fast", "vit_fast_bf16_residual") if p in by_path]:
        lines.append(f"  floor, {PATH_LABELS[p]} with every Triton tensor-core kernel at 100% of peak (ceiling 1, "
                     f"calibration 1): {ideal[p] * 1e3:.1f} ms = {t['timm_eager'] / ideal[p]:.2f}x eager, "
                     f"{t['timm_compile'] / ideal[p]:.2f}x torch.compile (predicted {t[p] * 1e3:.1f} ms)")
    lines.append(f"  the targets need a step <= {need_eager * 1e3:.1f} ms (1.6x eager) and "
                 f"<= {need_compile * 1e3:.1f} ms "
                 f"(1.25x compile); vit_fast's cuBLAS GEMMs alone take {gemm * 1e3:.1f} ms "
                 f"(the same GEMMs as timm's, at {LIBRARY_EFFICIENCY['GEMM']} of peak), "
                 f"{gemm / t['vit_fast']:.0%} of its predicted {t['vit_fast'] * 1e3:.1f} ms")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Measured beside predicted (a CUDA GPU only)

_GEMM_MARKS = ("gemm", "xmma", "cutlass", "nvjet", "ampere_bf16", "ampere_fp16", "sm80_", "sm90_", "cublas")
_CONV_MARKS = ("conv", "implicit", "wgrad", "dgrad", "fprop", "cudnn")


@functools.cache
def _kernel_modules() -> dict[str, str]:
    """{@triton.jit function name: its module} over vit_fast.kernels, as the counter sees a launch."""
    import importlib
    import pkgutil

    import vit_fast.kernels as pkg

    out = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"vit_fast.kernels.{info.name}")
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                out[name] = mod.__name__
    return out


def classify_kernel(name: str) -> str:
    """The op family of a GPU kernel from its name, as the counts group them: vit_fast's Triton kernels by their
    module's family (traffic.triton_family), inductor's generated kernels as 'elementwise' (its fusions; its
    GEMM templates 'GEMM'), library kernels by their names (cuBLAS/CUTLASS GEMMs, FlashAttention, cuDNN)."""
    low = name.lower()
    if low.startswith("triton_tem") or "_tem_fused" in low:
        return "GEMM"
    if low.startswith(("triton_poi", "triton_per", "triton_red", "triton_")):
        return "elementwise"
    if low.startswith("_") and low.endswith("_kernel"):  # vit_fast's @triton.jit kernels keep their names
        return triton_family(_kernel_modules().get(name, low), low)
    # cuDNN's attention kernels carry 'sdpa' (its generated backward names no 'flash'): before the conv marks
    if any(m in low for m in ("flash", "fmha", "sdpa", "attention", "softmax_warp", "softmax_forward",
                              "softmax_backward")):
        return "attention" if "log_softmax" not in low else "other"
    if any(m in low for m in _CONV_MARKS) and "elementwise" not in low:
        return "embed"
    if any(m in low for m in _GEMM_MARKS):
        return "GEMM"
    if "layer_norm" in low or "layernorm" in low:
        return "norm"
    if "nll_loss" in low or "log_softmax" in low or "logsoftmax" in low:
        return "other"
    return "elementwise"


def measured_by_family(kernels) -> dict[str, dict]:
    """{family: {'seconds', 'launches'}} from (name, seconds) pairs of the kernels of `steps` steps, per step."""
    out: dict[str, dict] = {}
    for name, seconds in kernels:
        f = out.setdefault(classify_kernel(name), dict(seconds=0.0, launches=0))
        f["seconds"] += seconds
        f["launches"] += 1
    return {fam: out[fam] for fam in FAMILIES if fam in out}


def device_kernels(events) -> list[tuple[str, float]]:
    """(name, seconds) of the device-side events of a torch.profiler trace: the kernels (and memsets / copies),
    each with its own time range in microseconds; host-side events are left out."""
    return [(e.name, e.time_range.elapsed_us() / 1e6) for e in events
            if str(getattr(e, "device_type", "")).endswith("CUDA")]


def join_families(predicted: dict[str, float], measured: dict[str, dict], steps: int = 1) -> list[tuple]:
    """Rows (family, predicted s, measured s per step, measured launches per step, measured / predicted),
    FAMILIES order, a family present on either side; then a 'total' row."""
    rows = []
    for fam in [f for f in FAMILIES if f in predicted or f in measured]:
        p = predicted.get(fam, 0.0)
        m = measured.get(fam, {})
        ms, ml = m.get("seconds", 0.0) / steps, m.get("launches", 0) / steps
        rows.append((fam, p, ms, ml, ms / p if p else float("nan")))
    tp, tm = sum(r[1] for r in rows), sum(r[2] for r in rows)
    rows.append(("total", tp, tm, sum(r[3] for r in rows), tm / tp if tp else float("nan")))
    return rows


def format_joined(label: str, gpu_name: str, rows: list[tuple], step_s: float | None = None) -> str:
    head = ("family", "PREDICTED ms", "measured ms", "launches", "measured/pred")
    widths = (12, 12, 11, 8, 13)
    lines = [f"{label} on {gpu_name}: predicted beside measured (kernel time per step, profiler)", _row(head, widths)]
    for fam, p, m, n, ratio in rows:
        lines.append(_row((fam, f"{p * 1e3:.2f}", f"{m * 1e3:.2f}", f"{n:.0f}", f"{ratio:.2f}"), widths))
    if step_s is not None:
        lines.append(f"measured step (CUDA events, kernels + gaps): {step_s * 1e3:.2f} ms")
    return "\n".join(lines)


def gpu_kind(device_name: str) -> str:
    """Which predicted GPU a measured device is compared with (the model has H100 and A100 figures)."""
    return "A100" if "A100" in device_name else "H100"


def profile_families(path: str, preset: str, batch: int, dtype: torch.dtype, steps: int = 5,
                     warmup: int = 3, device: str = "cuda", compile_backend: str = "inductor", by_kernel: bool = False,
                     **overrides) -> dict:
    """Time `path`'s training step (forward + cross-entropy + backward, no optimizer, as counted): kernel time
    per family from torch.profiler over `steps` steps, and the median step (CUDA events). ``device='cpu'``
    (the campaign's dry run): the aten ops' own CPU time stands in for kernels, the host clock for the step.
    ``by_kernel``: also "kernels", {kernel name: {"seconds", "launches"} per step}, slowest first."""
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA GPU")
    from vit_fast.presets import get_config
    from vit_fast.tools import bench

    cfg = get_config(preset, **overrides)
    model = bench.build(path, preset, device=device, compile_backend=compile_backend, **overrides)
    x = torch.randn(batch, cfg.in_chans, cfg.img_size[0], cfg.img_size[1], device=device)
    y = torch.randint(0, max(cfg.num_classes, 1), (batch,), device=device)

    def step():
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        step()
        if cuda:
            end.record()
            sync()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - start)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    kernels = device_kernels(prof.events()) if cuda else [
        (e.name, e.self_cpu_time_total / 1e6) for e in prof.events() if e.name.startswith("aten::")]
    fams = measured_by_family(kernels)
    result = dict(families={f: dict(seconds=v["seconds"] / steps, launches=v["launches"] / steps)
                            for f, v in fams.items()},
                  step_s=sorted(times)[len(times) // 2], gpu=torch.cuda.get_device_name() if cuda else "CPU")
    if by_kernel:
        totals: dict[str, list] = {}
        for name, seconds in kernels:
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
        result["kernels"] = {name: dict(seconds=seconds / steps, launches=launches / steps)
                             for name, (launches, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1])}
    return result


def measure_paths(preset: str, batch: int, dtype_name: str, paths, timeout: float = 1800) -> dict:
    """{path: profile_families(...) or {'error': why}} timed in a subprocess without the Triton interpreter
    (the counts run vit_fast's kernels interpreted; timing needs them compiled). Without CUDA: {'skipped': why}."""
    if not torch.cuda.is_available():
        return dict(skipped="no CUDA GPU on this machine: predicted figures only (measured columns need a GPU)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "vit_fast.tools.predict", "--time", preset, str(batch), dtype_name, *paths]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return dict(skipped=f"timing failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_measured(preset: str, results: list[PathResult], measured: dict, dtype: torch.dtype,
                    ceilings: dict) -> str:
    if "skipped" in measured:
        return f"{model_label(preset)}: measured: skipped: {measured['skipped']}"
    out = []
    for r in results:
        m = measured.get(r.path)
        if m is None:
            continue
        if "error" in m:
            out.append(f"{PATH_LABELS.get(r.path, r.path)}: not timed: {m['error']}")
            continue
        gpu = gpu_kind(m["gpu"])
        rows = join_families(predicted_by_family(r, gpu, dtype, ceilings.get(gpu)), m["families"])
        out.append(format_joined(f"{model_label(preset)} {PATH_LABELS.get(r.path, r.path)} (predicted as {gpu})",
                                 m["gpu"], rows, m["step_s"]))
    return "\n\n".join(out)


def _time_main(argv) -> int:
    """`python -m vit_fast.tools.predict --time PRESET BATCH DTYPE PATH...`: one JSON line {path: result}."""
    parser = argparse.ArgumentParser(prog="vit_fast.tools.predict")
    parser.add_argument("--time", action="store_true", required=True, help="time the paths (a CUDA GPU)")
    parser.add_argument("preset")
    parser.add_argument("batch", type=int)
    parser.add_argument("dtype", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out = {}
    for path in args.paths:
        try:
            out[path] = profile_families(path, args.preset, args.batch, dtype)
        except Exception as e:  # noqa: BLE001 - one path failing (memory, compile) must not hide the others
            out[path] = dict(error=f"{type(e).__name__}: {e}"[:300])
        torch.cuda.empty_cache()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_time_main(sys.argv[1:]))
