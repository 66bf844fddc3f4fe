"""`vit-fast bench`: training throughput on a CUDA GPU, timm and vit_fast side by side (CONTRIBUTING.md 6).

For every preset x batch x dtype, nine paths run in one process: timm eager, timm + torch.compile,
vit_fast (backend='triton'), vit_fast with its attention on the SDPA route (``vit_fast_sdpa``, vit_fast/route.py)
or on the short-sequence kernels (``vit_fast_short``),
vit_fast + torch.compile, vit_fast with its whole step captured in a CUDA graph
(``vit_fast_graph``; ``timm_graph`` on request), vit_fast with residual_in_fp32=False, and vit_fast with every block
run per part (``vit_fast_per_part``: the one-Function block off, vit_fast/layers/fused_block.py; the host work's
A/B, same numbers). A step is
forward under torch.autocast (fp32 master weights; no autocast for fp32) + cross-entropy + backward +
optimizer step. After warm-up
(which includes compilation) each step is timed with CUDA events; the report gives the median step
time and its spread (10th-90th percentile), images/s, MFU (3 x analytic forward FLOPs per image
against the GPU's dense peak) and peak memory. Inputs rotate through several batches larger than L2
so no step reads a warm cache. Results go to CSV and JSON tagged with the GPU, torch, triton and git
revision, plus a PNG bar chart. Without CUDA it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from vit_fast.tools import NONNEG_INT, POSITIVE_FLOAT, POSITIVE_INT, preset_name

PATHS = ("timm_eager", "timm_compile", "vit_fast", "vit_fast_sdpa", "vit_fast_short", "vit_fast_compile",
         "vit_fast_graph", "vit_fast_bf16_residual", "vit_fast_per_part")
# vit_fast with one part on another route than the measured default (vit_fast/route.py)
ROUTE_PATHS = {"vit_fast_sdpa": dict(attention="sdpa"), "vit_fast_short": dict(attention="short")}
# Paths whose whole training step is captured in a CUDA graph (vit_fast.training.graphs.CudaGraphStep).
GRAPH_PATHS = ("timm_graph", "vit_fast_graph")
DEFAULT_MODELS, DEFAULT_BATCHES = ("vit_base_patch16_224",), (128,)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dense tensor-core peaks (datasheet, SXM) for MFU; fp32 runs as TF32 at half the rate.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
NO_CUDA = ("vit-fast bench: training throughput needs a CUDA GPU; on this machine use `vit-fast traffic` "
           "(bytes, launches, roofline) and `vit-fast report` (registers, spills, shared memory).")


def peak_tflops(device_name: str, dtype: torch.dtype, override: float | None) -> float | None:
    peak = override or next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)
    if peak is None:
        return None
    return peak / 2 if dtype == torch.float32 else peak


def git_revision() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def environment() -> dict:
    """What every benchmark result is tagged with: GPU, torch, triton and git revision."""
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                git=git_revision())


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def build(path: str, preset: str, device: str = "cuda", compile_backend: str = "inductor",
          **overrides) -> torch.nn.Module:
    """One benchmark path's model, in training mode on ``device``; ``overrides`` change the preset (tiny
    shapes for the campaign's dry run)."""
    torch.manual_seed(0)
    if path.startswith("timm"):
        import timm

        model = timm.create_model(preset, pretrained=False, **overrides)
    else:
        import vit_fast

        model = vit_fast.create_model(preset, backend="triton", residual_in_fp32=path != "vit_fast_bf16_residual",
                                      **overrides)
        if path in ROUTE_PATHS:
            vit_fast.apply_route(model, vit_fast.Route(**ROUTE_PATHS[path], source=f"bench path {path}"))
    model = model.to(device).train()
    return torch.compile(model, backend=compile_backend) if path.endswith("compile") else model


def time_training(model, batch: int, dtype: torch.dtype, img_size: int, num_classes: int, steps: int, warmup: int,
                  rotate: int = 4, device: str = "cuda", graph: bool = False) -> dict:
    """Median/percentile step time and peak memory of forward + loss + backward + AdamW. On CUDA the steps
    are timed with CUDA events; elsewhere (the campaign's dry run) with the host clock. ``graph``: the step
    captured once in a CUDA graph and replayed (CUDA only); the peak memory then includes the graph's pool."""
    cuda = device.startswith("cuda")
    inputs = [torch.randn(batch, 3, img_size, img_size, device=device) for _ in range(rotate)]
    labels = [torch.randint(0, max(num_classes, 1), (batch,), device=device) for _ in range(rotate)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, capturable=graph)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=cuda and dtype == torch.float16)
    loss_fn = (lambda out, y: F.cross_entropy(out, y)) if num_classes else (lambda out, y: out.square().mean())
    started = time.perf_counter()  # a graph's warmup steps and capture included
    if graph:
        from vit_fast.training.graphs import CudaGraphStep

        if cuda:  # the peak is this path's: its warm-up and capture, not what ran before in the process
            torch.cuda.reset_peak_memory_stats()

        captured = CudaGraphStep(model, opt, loss_fn, inputs[0], labels[0],
                                 amp_dtype=None if dtype == torch.float32 else dtype, warmup_steps=max(warmup, 1))
        warmup = 0

    def step(i):
        if graph:
            captured(inputs[i % rotate], labels[i % rotate])
            return
        x, y = inputs[i % rotate], labels[i % rotate]
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            out = model(x)
        scaler.scale(loss_fn(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    phases = dict(warmup_s=time.perf_counter() - started)  # compilation and autotuning happen here
    if not cuda:
        ms = []
        for i in range(steps):
            start = time.perf_counter()
            step(i)
            ms.append((time.perf_counter() - start) * 1e3)
        ms.sort()
        return dict(step_ms=statistics.median(ms), p10_ms=ms[int(0.1 * (len(ms) - 1))],
                    p90_ms=ms[int(0.9 * (len(ms) - 1))], peak_mem_gb=float("nan"), **phases)
    if not graph:  # a graph's tensors were allocated at capture: keep them in the peak
        torch.cuda.reset_peak_memory_stats()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for i, (start, end) in enumerate(events):
        start.record()
        step(i)
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    return dict(step_ms=statistics.median(ms), p10_ms=ms[int(0.1 * (len(ms) - 1))], p90_ms=ms[int(0.9 * (len(ms) - 1))],
                peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30, **phases)


class _block_function:
    """``with _block_function(on):`` the one-Function block (vit_fast/layers/fused_block.py) on or off."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        from vit_fast.layers import fused_block

        self.was, fused_block.enabled = fused_block.enabled, self.on and fused_block.enabled

    def __exit__(self, *exc):
        from vit_fast.layers import fused_block

        fused_block.enabled = self.was


def measure(meta: dict, preset: str, dtype_name: str, batch: int, path: str, steps: int, warmup: int,
            peak: float | None, device: str = "cuda", compile_backend: str = "inductor", **overrides) -> dict:
    """One row: build the path's model, time its training step, derive images/s, TFLOP/s and MFU.
    A failure (e.g. out of memory) becomes the row's ``error`` so one path does not lose the others."""
    import vit_fast

    cfg = vit_fast.get_config(preset, **overrides)
    train_flops = 3 * vit_fast.forward_flops(cfg)
    row = dict(meta, model=preset, dtype=dtype_name, batch=batch, path=path)
    model = None
    try:
        if path in GRAPH_PATHS and not device.startswith("cuda"):
            raise ValueError(f"{path}: a CUDA-graph step needs a CUDA device, got {device}")
        started = time.perf_counter()
        model = build(path, preset, device, compile_backend, **overrides)
        row["build_s"] = time.perf_counter() - started
        with _block_function(path != "vit_fast_per_part"):
            row.update(time_training(model, batch, DTYPES[dtype_name], cfg.img_size[0], cfg.num_classes, steps,
                                     warmup, device=device, graph=path in GRAPH_PATHS))
        row["images_per_s"] = batch / row["step_ms"] * 1e3
        achieved = train_flops * row["images_per_s"] / 1e12
        row["tflops"] = achieved
        row["mfu"] = achieved / peak if peak else float("nan")
    except Exception as e:  # one failing path (e.g. out of memory) must not lose the others
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    finally:
        model = None
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def run(args) -> list[dict]:
    device = torch.cuda.get_device_name()
    meta = environment()
    rows = []
    for preset in args.models or DEFAULT_MODELS:
        for dtype_name in args.dtypes:
            peak = peak_tflops(device, DTYPES[dtype_name], args.peak_tflops)
            for batch in args.batches or DEFAULT_BATCHES:
                for path in args.paths or PATHS:
                    row = measure(meta, preset, dtype_name, batch, path, args.steps, args.warmup, peak)
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    head = f"{r['model']:24s} {r['dtype']:4s} b{r['batch']:<4d} {r['path']:17s}"
    if "error" in r:
        return f"{head} FAILED {r['error']}"
    return (f"{head} {r['images_per_s']:8.0f} img/s  step {r['step_ms']:7.1f} ms "
            f"[{r['p10_ms']:.1f}-{r['p90_ms']:.1f}]  "
            f"{r['tflops']:6.1f} TFLOP/s  MFU {r['mfu']:5.1%}  peak mem {r['peak_mem_gb']:5.1f} GiB"
            + _phases(r))


def _phases(r: dict) -> str:
    """Where a row's wall time went, where measured: process start and imports (the campaign's rows), model
    build, warmup steps (compilation, autotuning)."""
    phases = [(name, r[key]) for name, key in (("start", "startup_s"), ("build", "build_s"), ("warmup", "warmup_s"))
              if isinstance(r.get(key), (int, float))]
    return ("  (" + ", ".join(f"{name} {s:.1f} s" for name, s in phases) + ")") if phases else ""


def write_outputs(rows: list[dict], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out_dir, f"throughput-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    written = [base + ".json", base + ".csv"]
    try:
        written.append(plot(rows, base + ".png"))
    except ImportError:
        pass
    return written


def chart(rows: list[dict], path: str, width: float, draw, ylabel: str, note: str = "") -> str:
    """One PNG bar chart titled with the run's tags (GPU, torch, triton, git): ``draw(ax)`` adds the bars.
    ``note`` (e.g. a dry run's warning) heads the title and is written across the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4))
    draw(ax)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{note + chr(10) if note else ''}{rows[0]['gpu']}, torch {rows[0]['torch']}, "
                 f"triton {rows[0]['triton']}, {rows[0]['git']}", fontsize=9)
    if note:
        ax.text(0.5, 0.5, note.split(":")[0], transform=ax.transAxes, ha="center", va="center", fontsize=40,
                color="red", alpha=0.25, rotation=20)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(rows: list[dict], path: str, paths: tuple = PATHS, note: str = "") -> str:
    cases = sorted({(r["model"], r["dtype"], r["batch"]) for r in rows})
    width = 0.8 / len(paths)

    def draw(ax):
        for j, p in enumerate(paths):
            vals = [next((r.get("images_per_s", 0) for r in rows
                          if (r["model"], r["dtype"], r["batch"]) == c and r["path"] == p), 0)
                    for c in cases]
            ax.bar([i + j * width for i in range(len(cases))], vals, width, label=p)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"{m.replace('vit_', '').replace('_patch', '/')}\n{d} b{b}" for m, d, b in cases],
                           fontsize=8)

    return chart(rows, path, max(6, 2.2 * len(cases)), draw, "training images/s", note)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vit-fast bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=None, type=preset_name,
                        help=f"presets (default {' '.join(DEFAULT_MODELS)}; with --campaign: the throughput stage's, "
                             "default ViT-B/16, S/16 and L/16)")
    parser.add_argument("--batches", nargs="+", type=POSITIVE_INT, default=None,
                        help=f"(default {' '.join(map(str, DEFAULT_BATCHES))}; with --campaign: the throughput "
                             "stage's, default 64 and 256)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--paths", nargs="+", default=None, choices=list(PATHS) + ["timm_graph"],
                        help="(default all but timm_graph; with --campaign: the throughput stage's, default the "
                             "headline's paths, then the route candidates)")
    parser.add_argument("--steps", type=POSITIVE_INT, default=30, help="timed steps per case")
    parser.add_argument("--warmup", type=NONNEG_INT, default=10, help="untimed steps first (compilation happens here)")
    parser.add_argument("--peak-tflops", type=POSITIVE_FLOAT, default=None,
                        help="dense peak for MFU if the GPU is not known")
    parser.add_argument("--out", default="bench/results", help="folder for the CSV, JSON and PNG")
    campaign = parser.add_argument_group("campaign (`vit-fast bench --campaign --out DIR`, "
                                         "see vit_fast/tools/campaign.py)")
    campaign.add_argument("--campaign", action="store_true",
                          help="the whole GPU campaign in <= 9 minutes: compiled-kernel tests, `vit-fast check` at "
                               "ViT-B/16 bf16, per-kernel micro-benchmarks, training throughput of S/B/L-16, all "
                               "written under --out (CSV, JSON, PNG, summary.md); of the other options only "
                               "--models, --batches and --paths are read (the throughput stage's cases)")
    campaign.add_argument("--quick", action="store_true",
                          help="with --campaign: the headline only, in <= 5 minutes: env, then ViT-B/16 and ViT-S/16 "
                               "at batch 256 on every path (timm eager and compiled, vit_fast eager, compiled and "
                               "with a CUDA-graph step), then where their kernel time goes (profile)")
    campaign.add_argument("--stages", nargs="+", default=None, metavar="STAGE",
                          help="with --campaign: only these stages (env, headline, profile, micro, tune, check, tests, "
                               "throughput), each on its full budget")
    campaign.add_argument("--dry-run", action="store_true",
                          help="with --campaign: every stage on CPU with tiny shapes in about a minute (figures "
                               "meaningless; proves the command works before a GPU sees it)")
    campaign.add_argument("--budget", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
                          help="with --campaign: total time budget, split over the stages in proportion (default 540)")
    return parser


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args(argv)
    if args.campaign:
        from vit_fast.tools.campaign import main as campaign_main

        return campaign_main(args)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    rows = run(args)
    for path in write_outputs(rows, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
