"""`vit-fast host`: the host work of one training step (forward + cross-entropy + backward), measured on CPU with
the kernel launches stubbed, for vit_fast's fused model and timm eager at the same shapes.

What it measures: wall-clock microseconds per step of everything the host does around the kernels (Python,
autograd, the torch dispatcher, custom-op dispatch, vit_fast's configs and grids, timm's aten calls), on CPU
tensors of a model with the preset's depth and head dim but a few tokens and a narrow width, so the CPU's own
arithmetic stays small next to the host work. vit_fast's Triton kernels are defined under the interpreter and
their launch entry is replaced by a counter (nothing executes: outputs are uninitialised memory, which the host
work does not read). Not included: Triton's own launcher on a GPU (argument binding and the driver call,
counted here as launches) and the CUDA launch of each aten op (counted as aten calls). A check of where the
time goes, not a GPU speed figure.

Per op: torch.profiler's CPU time per vit_fast custom op (inclusive) and per top-level aten op, with call counts.
The aten GEMMs still do their arithmetic here (a few tens of microseconds each at these shapes, on every path):
the report gives their self time from the least of three profiled steps apart, a rough figure.
``vit_fast_per_part`` runs every block per part instead of as one autograd Function
(vit_fast/layers/fused_block.py): the same numbers, more host work. ``vit_fast_compile`` and ``timm_compile``
(asked for by name: each compiles for 10-20 s here) are the two models under ``torch.compile`` (inductor, default
mode): the host work of the compiled step is dynamo's guards, the compiled graphs' Python wrappers (inductor's CPU
kernels do their arithmetic here, as the GEMMs do) and vit_fast's custom ops, each called through the dispatcher.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from vit_fast.tools import preset_name

# Shapes: the preset's depth, heads and head dim at two heads' width, one 32 px image of 16 px patches (5 tokens):
# the host path is the one the full model takes (same ops, same branches); the aten GEMMs' arithmetic is reported apart.
HOST_OVERRIDES = dict(img_size=32, num_classes=10)
PATHS = ("vit_fast", "vit_fast_per_part", "timm_eager")
COMPILED_PATHS = ("vit_fast_compile", "timm_compile")
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")


@dataclass
class HostCost:
    path: str
    step_us: float
    steps: int
    launches: int = 0  # Triton launches per step (stubbed)
    custom_ops: int = 0  # vit_fast:: custom-op calls per step
    aten_calls: int = 0  # top-level aten calls per step (each a kernel launch or more on a GPU)
    autograd_nodes: int = 0  # backward nodes run per step
    gemm_us: float = 0.0  # self CPU time of the aten GEMMs (mm, addmm, bmm): their arithmetic, one launch each on a GPU
    per_op: list = field(default_factory=list)  # (name, calls per step, us per step), slowest first


def shapes(preset: str) -> dict:
    """Overrides that keep the preset's depth and head dim but use two heads and one 32 px image."""
    from vit_fast.presets import get_config

    cfg = get_config(preset)
    head_dim = cfg.embed_dim // cfg.num_heads
    return dict(HOST_OVERRIDES, embed_dim=2 * head_dim, num_heads=2, patch_size=16)


def _model(path: str, preset: str) -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = shapes(preset)
    if path.startswith("timm"):
        import timm

        return timm.create_model(preset, pretrained=False, **overrides).train()
    import vit_fast

    return vit_fast.create_model(preset, backend="triton", **overrides).train()


class _StubbedLaunches:
    """Replace the Triton interpreter's launch entry (``InterpretedFunction.run``, what ``kernel[grid](...)``
    calls) with a counter for the duration of a ``with``: the interpreter's own argument handling, which a GPU
    launch does not do, is skipped with the kernel."""

    def __enter__(self):
        from triton.runtime import interpreter

        self.function = interpreter.InterpretedFunction
        self.real = self.function.run
        self.count = 0

        def counted(_self, *args, grid, warmup, **kwargs):
            self.count += 0 if warmup else 1

        self.function.run = counted
        return self

    def __exit__(self, *exc):
        self.function.run = self.real


class _quiet_stderr:
    """File descriptor 2 to /dev/null for a ``with``: the profiler's C++ library logs its start, stop and a failed
    GPU query there, which would read as errors."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def measure(paths: Sequence[str], preset: str, steps: int = 20, warmup: int = 3, batch: int = 1) -> list[HostCost]:
    """Median host microseconds per training step of each path ('vit_fast', 'vit_fast_per_part': every block per
    part instead of as one autograd Function, 'timm_eager', and the compiled 'vit_fast_compile', 'timm_compile'),
    with counts. The paths' steps alternate, so a busy or throttled CPU slows them alike and their ratios hold."""
    x = torch.randn(batch, 3, HOST_OVERRIDES["img_size"], HOST_OVERRIDES["img_size"])
    y = torch.randint(0, HOST_OVERRIDES["num_classes"], (batch,))

    def stepper(model, path):
        from .bench import _block_function

        run = torch.compile(model) if path.endswith("compile") else model
        params = list(model.parameters())

        def step():
            with _block_function(path != "vit_fast_per_part"):
                F.cross_entropy(run(x).float(), y).backward()
            for p in params:  # as an optimizer's zero_grad: Module.zero_grad's module walk is not the model's work
                p.grad = None
        return step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread; the CPU's arithmetic threads would only add their noise
    # The stubbed kernels leave their outputs uninitialised; denormals among them made the GEMMs that read them
    # 3-5x slower on CPU (vit_fast's GEMMs 10-23 ms per step against 3-4 ms flushed: a 2x host ratio that is the
    # CPU's arithmetic, not host work). A GPU does not slow down on denormals.
    torch.set_flush_denormal(True)
    try:
        return _measure(paths, preset, steps, warmup, stepper)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default (it has no getter to restore from)


def _measure(paths: Sequence[str], preset: str, steps: int, warmup: int, stepper) -> list[HostCost]:
    step_of = {path: stepper(_model(path, preset), path) for path in paths}
    times: dict[str, list[float]] = {path: [] for path in paths}
    launches: dict[str, int] = {path: 0 for path in paths}
    results = []
    with _StubbedLaunches() as counter:
        for step in step_of.values():
            for _ in range(warmup):
                step()
        for _ in range(steps):
            for path, step in step_of.items():
                counter.count = 0
                start = time.perf_counter()
                step()
                times[path].append((time.perf_counter() - start) * 1e6)
                launches[path] += counter.count
        from torch.profiler import ProfilerActivity, profile

        for path, step in step_of.items():
            profiled = []
            for _ in range(PROFILED_STEPS):
                with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
                result = HostCost(path, statistics.median(times[path]), steps,
                                  launches=round(launches[path] / steps))
                _count_ops(result, prof.events())
                profiled.append(result)
            results.append(min(profiled, key=lambda r: r.gemm_us))
    return results


# profiled one at a time, the step whose GEMMs took least kept: one step is a single sample, and a busy machine
# (another process on the same cores) can make it several times slower than the median step
PROFILED_STEPS = 3


def _count_ops(result: HostCost, events) -> None:
    per_op: dict[str, list] = {}
    for e in events:
        top_level = e.cpu_parent is None or e.cpu_parent.name.startswith(("autograd::engine", "ProfilerStep"))
        if e.name.startswith("vit_fast::"):
            result.custom_ops += 1
        elif e.name.startswith("aten::") and top_level:
            result.aten_calls += 1
        elif e.name.startswith("autograd::engine::evaluate_function"):
            result.autograd_nodes += 1
        if e.name in GEMMS:
            result.gemm_us += e.self_cpu_time_total
        if e.name.startswith("vit_fast::") or (e.name.startswith("aten::") and top_level):
            entry = per_op.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.cpu_time_total
    result.per_op = sorted(((n, c, us) for n, (c, us) in per_op.items()), key=lambda r: -r[2])


def host_ratio(path: HostCost, timm: HostCost) -> float:
    """``path``'s host time over timm's (eager, or compiled for a compiled path), each without its aten GEMMs' CPU
    time (their arithmetic here)."""
    return (path.step_us - path.gemm_us) / (timm.step_us - timm.gemm_us)


def format_report(preset: str, results: list[HostCost], top: int = 12) -> str:
    o = shapes(preset)
    lines = [f"vit-fast host: {preset} (depth as the preset, {o['num_heads']} heads of {o['embed_dim'] // 2}, one "
             f"{o['img_size']} px image): host work per training step (forward + cross-entropy + backward) on CPU, "
             "kernel launches stubbed; not a GPU timing", "",
             f"{'path':<17} {'host us/step':>12} {'of it GEMMs':>11} {'launches':>9} {'custom ops':>10} "
             f"{'aten calls':>10} {'autograd nodes':>14}"]
    for r in results:
        lines.append(f"{r.path:<17} {r.step_us:>12.0f} {r.gemm_us:>11.0f} {r.launches:>9} {r.custom_ops:>10} "
                     f"{r.aten_calls:>10} {r.autograd_nodes:>14}")
    by = {r.path: r for r in results}
    lines.append("(of it GEMMs: the aten GEMMs' self CPU time in the least of 3 profiled steps, mostly their "
                 "arithmetic, which a GPU runs as one launch each; a rough figure)")
    for path, base in (("vit_fast", "timm_eager"), ("vit_fast_per_part", "timm_eager"),
                       ("vit_fast_compile", "timm_compile")):
        if path in by and base in by:
            lines.append(f"{path} / {base.replace('_', ' ')} host time: {by[path].step_us / by[base].step_us:.2f}x; "
                         f"without the GEMMs' CPU time: {host_ratio(by[path], by[base]):.2f}x")
    lines.append("(without the GEMMs: nearer a GPU's host work, where each GEMM is one launch; on the H200 of "
                 "2026-11-27, ViT-S/16 at batch 1 took vit_fast 35.9 ms per eager step and timm 20.3: 1.77x)")
    lines.append("(Triton's launcher and the CUDA launches, not run here, add to both on a GPU)")
    for r in results:
        lines += ["", f"{r.path}: slowest ops (us per step, inclusive; calls)"]
        for name, calls, us in r.per_op[:top]:
            lines.append(f"  {name:<44} {us:>9.0f} us {calls:>5}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vit-fast host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_base_patch16_224", type=preset_name,
                        help="preset (depth and head dim are kept)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS + COMPILED_PATHS),
                        help=f"default: {' '.join(PATHS)}; the compiled paths ({' '.join(COMPILED_PATHS)}) compile "
                             "for 10-20 s each here")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported; default 20)")
    parser.add_argument("--top", type=int, default=12, help="ops listed per path (default 12)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter's launch path: on before triton loads
        if "triton" in sys.modules:
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.run([sys.executable, "-m", "vit_fast.tools.host_cost",
                                   *(sys.argv[1:] if argv is None else argv)], env=env).returncode
        os.environ["TRITON_INTERPRET"] = "1"
    results = measure(args.paths, args.model, steps=args.steps)
    print(format_report(args.model, results, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
