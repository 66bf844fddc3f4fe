"""The speed model corrected by measurement (issue 29, item 4).

The counted model (vit_fast.tools.predict) prices every op at a roofline: bytes at the copy bandwidth, FLOPs at
the dense peak, scaled by efficiencies taken from datasheets, papers and SASS ceilings. On the first GPU run
that was off by up to 3x (attention, whose SASS ceiling read 85-100% while it ran at 9% of peak). Here the
efficiencies come from measurement instead:

- an op's *implementation* is its family and who wrote it: ``library`` (cuBLAS, cuDNN, SDPA, aten's own
  kernels), ``vit_fast`` (its Triton kernels) or ``inductor`` (torch.compile's generated kernels);
- each implementation's *efficiency* is the fraction of the roofline it reached in a measured step: measured
  kernel time of a family (torch.profiler, shipped in vit_fast/data/measured/) over the roofline time of that
  family's counted ops (vit_fast/data/counts/). A family mixing implementations is solved once the others in it
  are known (timm eager's families are library-only, so they fix the library efficiencies first);
- a calibrated op takes roofline / efficiency + launches x LAUNCH_OVERHEAD_S; an implementation no measurement
  reaches keeps the uncalibrated model (predict.predicted_op_s) and is named as such.

The efficiencies are fitted on one model's profile (ViT-B/16 b256); the steps of the other models and of
torch.compile, measured in the same runs, are predictions the fit did not see (``held_out`` in
:func:`compare`). Everything here is a prediction unless a row says measured.
"""
from __future__ import annotations

import dataclasses
import json
from importlib import resources

import torch

from vit_fast.tools.predict import DENSE_PEAK_TFLOPS, LAUNCH_OVERHEAD_S, _launch_ops, predicted_op_s
from vit_fast.tools.traffic import FAMILIES, PATH_LABELS, Op, PathResult, _row

IMPLEMENTATIONS = ("library", "vit_fast", "inductor")
# fused AdamW per fp32 parameter: param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written
ADAMW_BYTES_PER_PARAM = 28


def implementation(op: Op) -> str:
    if op.name.startswith("inductor_"):
        return "inductor"
    return "vit_fast" if op.triton else "library"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One GPU run shipped as data (vit_fast/data/measured/<name>.json)."""
    name: str
    gpu: str  # the device name as torch reports it
    gpu_kind: str  # the model's name for it: "H200", "H100"
    source: str  # versions, date, revision, how
    dense_peak_tflops: float
    copy_tb_per_s: float
    batch: int
    dtype: str
    profile: dict  # {preset: {path: {"families": {family: ms}, "launches": {family: n}, "step_ms": ms}}}
    steps: dict  # {preset: {path: {"ms": ms, "how": str}}}: a training step with fused AdamW, GPU-bound

    @classmethod
    def from_json(cls, name: str, doc: dict) -> "Measurement":
        return cls(name, doc["gpu"], doc["gpu_kind"], doc["source"], float(doc["dense_peak_tflops"]),
                   float(doc["copy_tb_per_s"]), int(doc["batch"]), doc["dtype"], doc["profile"]["models"],
                   doc["steps"]["models"])


def measurement_from_campaign(doc: dict) -> dict:
    """A campaign's campaign.json (vit_fast.tools.campaign) as a shippable measurement (the form of
    vit_fast/data/measured/*.json): its profile rows, and its throughput rows at the profile's batch, a path's
    CUDA-graph step standing for its GPU time where one was measured."""
    from vit_fast.tools.bench import PEAK_TFLOPS

    meta, peaks, results = doc["meta"], doc.get("peaks", {}), doc["results"]
    kind = next((k for k in ("H200", "H100", "A100") if k in str(meta.get("gpu", ""))), str(meta.get("gpu")))
    versions = ", ".join(f"{k} {meta[k]}" for k in ("driver", "torch", "triton", "cuda") if meta.get(k))
    source = f"{meta.get('gpu')}, {versions}, {str(meta.get('date', ''))[:10]}, revision {meta.get('git', '?')}"
    profile: dict = {}
    for row in results.get("profile", []):
        p = profile.setdefault(row["model"], {}).setdefault(row["path"], dict(families={}, launches={}))
        p["families"][row["family"]] = row["kernel_ms_per_step"]
        p["launches"][row["family"]] = row["launches_per_step"]
        p["step_ms"] = row["step_ms"]
    batch = next((row["batch"] for row in results.get("profile", [])), 256)
    steps: dict = {}
    rows = [r for r in results.get("throughput", []) if "error" not in r and r.get("batch") == batch]
    for row in sorted(rows, key=lambda r: r["path"].endswith("_graph")):  # a graph row replaces its path's
        path = row["path"][: -len("_graph")] if row["path"].endswith("_graph") else row["path"]
        how = f"{row['model']} {row['path']}, campaign {source}"
        steps.setdefault(row["model"], {})[path] = dict(ms=row["step_ms"], how=how)
    return dict(about="A GPU campaign (vit-fast bench --campaign) as data for vit_fast/tools/calibration.py.",
                gpu=meta.get("gpu"), gpu_kind=kind, source=source,
                dense_peak_tflops=PEAK_TFLOPS.get(kind, peaks.get("gemm_bf16_tflops")),
                copy_tb_per_s=peaks.get("copy_gbps", 0.0) / 1e3, batch=batch, dtype="bf16",
                profile=dict(source="campaign stage_profile", models=profile),
                steps=dict(source="campaign throughput stages", models=steps))


def _data_files(folder: str) -> list:
    root = resources.files("vit_fast").joinpath("data", folder)
    return sorted((f for f in root.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)


def measurements() -> list[Measurement]:
    """Every GPU run shipped in vit_fast/data/measured/."""
    return [Measurement.from_json(f.name[: -len(".json")], json.loads(f.read_text())) for f in _data_files("measured")]


def stored_counts(preset: str) -> dict[str, PathResult]:
    """{path: PathResult} of `preset`'s counted step shipped in vit_fast/data/counts/ (`vit-fast traffic --json`),
    or {} where none is shipped."""
    for f in _data_files("counts"):
        doc = json.loads(f.read_text())
        if doc["model"] == preset:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[doc["dtype"]]
            return {path: PathResult.from_json(path, dict(p, batch=doc["batch"]), dtype)
                    for path, p in doc["paths"].items()}
    return {}


def stored_presets() -> list[str]:
    return [json.loads(f.read_text())["model"] for f in _data_files("counts")]


def roofline_work_s(op: Op, m: Measurement, dtype: torch.dtype) -> float:
    """One launch's roofline seconds on the measured GPU: bytes at its copy bandwidth or FLOPs at its dense peak
    (no launch overhead)."""
    peak = m.dense_peak_tflops * 1e12 * (0.5 if dtype == torch.float32 else 1.0)
    return max(op.bytes / (m.copy_tb_per_s * 1e12), op.flops / peak)


def roofline_by_implementation(r: PathResult, m: Measurement, dtype: torch.dtype) -> dict[tuple, dict]:
    """{(family, implementation): {'work_s', 'launches'}}: what the roofline gives each part of a path."""
    out: dict[tuple, dict] = {}
    for n, op in _launch_ops(r):
        part = out.setdefault((op.family, implementation(op)), dict(work_s=0.0, launches=0.0))
        part["work_s"] += n * roofline_work_s(op, m, dtype)
        part["launches"] += n
    return out


@dataclasses.dataclass(frozen=True)
class Efficiency:
    family: str
    implementation: str
    fraction: float  # of the roofline, as measured
    source: str  # which measured (model, path, family) fixed it


def _profiled(m: Measurement, counts: dict[str, dict[str, PathResult]]):
    """(preset, path, its profile, its counted step) for every profiled path the counts reach."""
    for preset, paths in m.profile.items():
        for path, prof in paths.items():
            r = counts.get(preset, {}).get(path)
            if r is not None:
                yield preset, path, prof, r


def fit(m: Measurement, counts: dict[str, dict[str, PathResult]], dtype: torch.dtype) -> dict[tuple, Efficiency]:
    """The efficiency of every (family, implementation) the profile reaches. A measured family total whose parts
    are all known but one fixes that one: measured = sum(work / efficiency + launches x overhead)."""
    entries = []
    for preset, path, prof, r in _profiled(m, counts):
        parts = roofline_by_implementation(r, m, dtype)
        for family, ms in prof["families"].items():
            own = {impl: p for (fam, impl), p in parts.items() if fam == family and p["work_s"] > 0}
            if own:
                entries.append((preset, path, family, ms / 1e3, own))
    fitted: dict[tuple, Efficiency] = {}
    progress = True
    while progress:
        progress = False
        for preset, path, family, measured_s, own in entries:
            unknown = [impl for impl in own if (family, impl) not in fitted]
            if len(unknown) != 1:
                continue
            known_s = sum(p["work_s"] / fitted[(family, impl)].fraction + p["launches"] * LAUNCH_OVERHEAD_S
                          for impl, p in own.items() if impl != unknown[0])
            part = own[unknown[0]]
            left = measured_s - known_s - part["launches"] * LAUNCH_OVERHEAD_S
            if left <= 0:
                continue  # the other parts already account for the time: nothing to fit from
            fitted[(family, unknown[0])] = Efficiency(family, unknown[0], part["work_s"] / left,
                                                      f"{preset} {path} {family}")
            progress = True
    return fitted


def calibrated_by_family(r: PathResult, m: Measurement, dtype: torch.dtype,
                         efficiencies: dict[tuple, Efficiency]) -> tuple[dict[str, float], set]:
    """Calibrated seconds per family and the (family, implementation) parts no measurement reached (those keep
    the uncalibrated model on the measured GPU's kind)."""
    out: dict[str, float] = {}
    uncalibrated = set()
    for n, op in _launch_ops(r):
        e = efficiencies.get((op.family, implementation(op)))
        if e is None:
            uncalibrated.add((op.family, implementation(op)))
            seconds = n * predicted_op_s(op, m.gpu_kind if m.gpu_kind in DENSE_PEAK_TFLOPS else "H100", dtype)
        else:
            seconds = n * (roofline_work_s(op, m, dtype) / e.fraction + LAUNCH_OVERHEAD_S)
        out[op.family] = out.get(op.family, 0.0) + seconds
    return {fam: out[fam] for fam in FAMILIES if fam in out}, uncalibrated


def optimizer_s(preset: str, m: Measurement) -> float:
    """Fused AdamW over the model's fp32 parameters at the measured copy bandwidth."""
    from vit_fast.model import count_params, create_model

    with torch.device("meta"):
        params = count_params(create_model(preset))
    return params * ADAMW_BYTES_PER_PARAM / (m.copy_tb_per_s * 1e12)


@dataclasses.dataclass(frozen=True)
class Comparison:
    preset: str
    path: str
    what: str  # a family, "kernels" (their sum, against the profiled step), or "step" (with AdamW)
    predicted_s: float
    measured_s: float
    held_out: bool  # the fit did not use this measurement
    how: str = ""

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s


def compare(m: Measurement, counts: dict[str, dict[str, PathResult]], dtype: torch.dtype,
            efficiencies: dict[tuple, Efficiency] | None = None) -> list[Comparison]:
    """Calibrated prediction beside every measurement of `m` the counts reach: per family and the profiled step
    (kernels, no optimizer) of the profiled paths, and every measured training step (AdamW added)."""
    eff = fit(m, counts, dtype) if efficiencies is None else efficiencies
    used = {e.source for e in eff.values()}
    rows = []
    for preset, path, prof, r in _profiled(m, counts):
        fams, _ = calibrated_by_family(r, m, dtype, eff)
        for family, ms in prof["families"].items():
            if family in fams:
                rows.append(Comparison(preset, path, family, fams[family], ms / 1e3,
                                       f"{preset} {path} {family}" not in used))
        rows.append(Comparison(preset, path, "kernels", sum(fams.values()), prof["step_ms"] / 1e3, True,
                               "profiled step (CUDA events, kernels + gaps, no optimizer)"))
    for preset, paths in m.steps.items():
        for path, step in paths.items():
            r = counts.get(preset, {}).get(path)
            if r is None:
                continue
            fams, _ = calibrated_by_family(r, m, dtype, eff)
            rows.append(Comparison(preset, path, "step", sum(fams.values()) + optimizer_s(preset, m),
                                   step["ms"] / 1e3, True, step["how"]))
    return rows


def at_library_efficiency(r: PathResult, m: Measurement, dtype: torch.dtype,
                          eff: dict[tuple, Efficiency]) -> dict[str, float]:
    """Calibrated seconds per family of a path if every vit_fast kernel ran at least at the measured efficiency of
    the library ops of its family (cuBLAS, SDPA, ...) on its own counted bytes and FLOPs: what issue 29's
    library-speed candidates (Hopper GEMMs, a faster attention backward) are worth, PREDICTED."""
    raised = {k: dataclasses.replace(e, fraction=max(e.fraction, eff[(k[0], "library")].fraction))
              if k[1] == "vit_fast" and (k[0], "library") in eff else e for k, e in eff.items()}
    return calibrated_by_family(r, m, dtype, raised)[0]


def format_headroom(preset: str, r: PathResult, m: Measurement, dtype: torch.dtype,
                    eff: dict[tuple, Efficiency]) -> str:
    from vit_fast.tools.predict import model_label

    now, _ = calibrated_by_family(r, m, dtype, eff)
    raised = at_library_efficiency(r, m, dtype, eff)
    adamw = optimizer_s(preset, m)
    gains = ", ".join(f"{fam} {1e3 * (raised[fam] - now[fam]):+.1f} ms" for fam in now
                      if abs(raised[fam] - now[fam]) > 5e-5)
    return (f"{model_label(preset)} {PATH_LABELS.get(r.path, r.path)} on {m.gpu_kind}, PREDICTED (calibrated): step "
            f"{1e3 * (sum(now.values()) + adamw):.1f} ms; with every vit_fast kernel at least at its family's library "
            f"efficiency: {1e3 * (sum(raised.values()) + adamw):.1f} ms ({gains})")


def format_efficiencies(m: Measurement, eff: dict[tuple, Efficiency]) -> str:
    lines = [f"calibration on {m.gpu} ({m.source}): measured fraction of the roofline "
             f"({m.dense_peak_tflops:.0f} TFLOP/s dense, {m.copy_tb_per_s} TB/s copy) per family and implementation"]
    for (family, impl), e in sorted(eff.items(), key=lambda kv: (FAMILIES.index(kv[0][0]), kv[0][1])):
        lines.append(f"  {family:11s} {impl:9s} {e.fraction:6.2f}   from {e.source}")
    return "\n".join(lines)


def format_comparison(rows: list[Comparison], m: Measurement, uncalibrated: set | None = None) -> str:
    from vit_fast.tools.predict import model_label

    head = ("model", "path", "what", "PREDICTED ms", "measured ms", "pred/meas", "held out")
    widths = (9, 28, 11, 12, 11, 9, 8)
    lines = [f"calibrated prediction beside measurement, {m.gpu}, batch {m.batch}, {m.dtype}:", _row(head, widths)]
    for c in rows:
        lines.append(_row((model_label(c.preset), PATH_LABELS.get(c.path, c.path), c.what,
                           f"{c.predicted_s * 1e3:.2f}", f"{c.measured_s * 1e3:.2f}", f"{c.ratio:.2f}",
                           "yes" if c.held_out else "fitted"), widths))
    steps = {c.how for c in rows if c.what in ("step", "kernels") and c.how}
    lines += [f"  {how}" for how in sorted(steps)]
    if uncalibrated:
        parts = ", ".join(f"{f} {i}" for f, i in sorted(uncalibrated))
        lines.append(f"  not reached by any measurement (uncalibrated model): {parts}")
    return "\n".join(lines)


def report(dtype: torch.dtype = torch.bfloat16, counted: dict[str, list[PathResult]] | None = None,
           only=None) -> str:
    """Every shipped measurement of the models in `only` (default: all) against the calibrated prediction. The
    fit takes the stored counts (vit_fast/data/counts); `counted` replaces a model's stored paths by fresh counts
    where they are at the measurement's batch and dtype. '' where no measurement covers `only`."""
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    out = []
    for m in measurements():
        if m.dtype != dtype_name or (only is not None and not set(only) & (set(m.profile) | set(m.steps))):
            continue
        counts = {p: stored_counts(p) for p in stored_presets()}
        for preset, results in (counted or {}).items():
            counts.setdefault(preset, {}).update({r.path: r for r in results if r.batch == m.batch})
        eff = fit(m, counts, dtype)
        rows = [c for c in compare(m, counts, dtype, eff) if only is None or c.preset in only]
        uncalibrated = set()
        for preset, paths in counts.items():
            for r in paths.values():
                if only is None or preset in only:
                    uncalibrated |= calibrated_by_family(r, m, dtype, eff)[1]
        out += [format_efficiencies(m, eff), format_comparison(rows, m, uncalibrated)]
        out += [format_headroom(preset, paths["vit_fast"], m, dtype, eff) for preset, paths in counts.items()
                if "vit_fast" in paths and (only is None or preset in only)]
    return "\n\n".join(out)
