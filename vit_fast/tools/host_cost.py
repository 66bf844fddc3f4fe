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

``floor`` (``_Floor``): the least host work a fused step can do in vit_fast's design, a timm model's parameters run
by one autograd Function per block holding only the GEMMs, the kernels' output allocations and one call per launch:
vit_fast above it is its own Python (checks, plans, launch arguments); timm eager's step above it is the cost of its
many small ops.

Python calls: the function calls of one step as cProfile counts them (Python functions and the builtins they call),
deterministic for one torch/triton version: where the microseconds are noisy (a shared or throttled CPU), the calls
say whether a change did less. ``--calls N`` lists each path's N functions with the most calls made inside them
(each call counted for every function on the stack above it, once per function): where the host work is.

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
PATHS = ("vit_fast", "vit_fast_per_part", "timm_eager", "floor")
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
    python_calls: int = 0  # function calls per step as cProfile counts them (Python and builtins): not a time, so
    # the same on every run of one torch/triton version, a machine-independent measure of the host work
    calls_under: list = field(default_factory=list)  # (function, calls made inside it per step), most first
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
    if path.startswith("timm") or path == "floor":
        import timm

        model = timm.create_model(preset, pretrained=False, **overrides).train()
        return _Floor(model) if path == "floor" else model
    import vit_fast

    return vit_fast.create_model(preset, backend="triton", **overrides).train()


def _stub_launch(*tensors: torch.Tensor) -> None:
    """The floor's kernel launch: one Python call, counted as the meter's stubbed Triton entry counts one."""
    counter = _StubbedLaunches.current
    if counter is not None:
        counter.count += 1


class _FloorBlock(torch.autograd.Function):
    """The least host work vit_fast's fused design can do for one block (``FusedBlockFunction``): one autograd node,
    the three cuBLAS GEMMs forward and six backward in its layouts, the kernels' outputs allocated and one call per
    launch (attention, the two joins, fc1 with its activation; their backwards and the parameter gradients' row
    sums), no checks, plans or configs. Its outputs are garbage, as the stubbed kernels'."""

    @staticmethod
    def forward(ctx, hidden, residual, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b,
                next_w, next_b):
        b, n, d = hidden.shape
        qkv = F.linear(hidden, qkv_w, qkv_b)
        out, lse = torch.empty_like(hidden), torch.empty((b, 1, n))
        _stub_launch(qkv, out, lse)
        branch = F.linear(out, proj_w)
        normed2, stream2, stats1 = torch.empty_like(branch), torch.empty_like(branch), torch.empty((2, b * n))
        _stub_launch(branch, residual, normed2, stream2, stats1)
        hid = torch.empty((b, n, fc2_w.shape[1]))  # fc1's width, or half of it for a gated (SwiGLU) MLP
        dact = torch.empty((b, n, fc1_w.shape[0]))
        _stub_launch(normed2, fc1_w, fc1_b, hid, dact)
        y = F.linear(hid, fc2_w)
        normed, stream, stats2 = torch.empty_like(y), torch.empty_like(y), torch.empty((2, b * n))
        _stub_launch(y, stream2, normed, stream, stats2)
        ctx.save_for_backward(qkv, lse, hidden, qkv_w, out, proj_w, stream2, branch, norm2_w, stats1, normed2,
                              fc1_w, hid, dact, fc2_w, stream, y, next_w, stats2)
        return normed, stream

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_normed, d_stream):
        (qkv, lse, hidden, qkv_w, out, proj_w, stream2, branch, norm2_w, stats1, normed2,
         fc1_w, hid, dact, fc2_w, stream, y, next_w, stats2) = ctx.saved_tensors
        shape, d = y.shape, y.shape[-1]
        dy, d_stream2, partial = torch.empty_like(y), torch.empty_like(y), torch.empty((3, 1, d))
        _stub_launch(d_normed, d_stream, stream, y, next_w, stats2, dy, d_stream2, partial)
        d_next = torch.empty((3, d))
        _stub_launch(partial, d_next)
        d_next_w, d_next_b, d_fc2_b = d_next.unbind(0)
        dy2 = dy.reshape(-1, d)
        d_fc2_w = dy2.t().mm(hid.reshape(-1, hid.shape[-1]))
        du, d_fc1_b = torch.empty_like(dact), torch.empty(dact.shape[-1])
        _stub_launch(dy2, dact, fc2_w, du, d_fc1_b)
        du2 = du.reshape(-1, du.shape[-1])
        d_normed2 = du2.mm(fc1_w).view(shape)
        d_fc1_w = du2.t().mm(normed2.reshape(-1, d))
        d_branch, d_residual, partial = torch.empty_like(y), torch.empty_like(y), torch.empty((3, 1, d))
        _stub_launch(d_normed2, d_stream2, stream2, branch, norm2_w, stats1, d_branch, d_residual, partial)
        d_norm2 = torch.empty((3, d))
        _stub_launch(partial, d_norm2)
        d_norm2_w, d_norm2_b, d_proj_b = d_norm2.unbind(0)
        d_branch2 = d_branch.reshape(-1, d)
        d_out = d_branch2.mm(proj_w).view(shape)
        d_proj_w = d_branch2.t().mm(out.reshape(-1, d))
        d_qkv, d_qkv_b = torch.empty_like(qkv), torch.empty(qkv.shape[-1])
        _stub_launch(d_out, qkv, out, lse, d_qkv, d_qkv_b)
        d_qkv2 = d_qkv.reshape(-1, qkv.shape[-1])
        d_hidden = d_qkv2.mm(qkv_w).view(shape)
        d_qkv_w = d_qkv2.t().mm(hidden.reshape(-1, d))
        grads = (d_hidden, d_residual, d_qkv_w, d_qkv_b, d_proj_w, d_proj_b, d_norm2_w, d_norm2_b, d_fc1_w, d_fc1_b,
                 d_fc2_w, d_fc2_b, d_next_w, d_next_b)
        return tuple(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad))  # biases may be None


class _FloorEmbed(torch.autograd.Function):
    """The patch-embedding kernel's floor: tokens (class token and position embedding added) and the normed stream
    for block 0 in one launch; its backward one launch and the weight gradient's GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, pos_embed, cls_token, norm_w, norm_b):
        tokens = torch.empty((x.shape[0], pos_embed.shape[1], weight.shape[0]))
        normed = torch.empty_like(tokens)
        _stub_launch(x, weight, bias, pos_embed, cls_token, norm_w, norm_b, tokens, normed)
        ctx.save_for_backward(x, weight)
        return normed, tokens

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_normed, d_tokens):
        x, weight = ctx.saved_tensors
        patches = torch.empty((d_tokens.shape[0] * (d_tokens.shape[1] - 1), weight[0].numel()))
        d_patch = torch.empty((patches.shape[0], weight.shape[0]))
        _stub_launch(d_normed, d_tokens, x, patches, d_patch)
        d_weight = d_patch.t().mm(patches).view(weight.shape)
        d_rest = torch.empty((3, weight.shape[0]))
        _stub_launch(d_patch, d_rest)
        d_bias, d_cls, d_norm_w = d_rest.unbind(0)
        grads = (None, d_weight, d_bias, torch.empty_like(d_tokens[:1]), d_cls.view(1, 1, -1), d_norm_w,
                 torch.empty_like(d_norm_w))
        return tuple(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad))  # no bias, class token


def _final_norm(model: torch.nn.Module, last_block: torch.nn.Module) -> torch.nn.Module:
    """The LayerNorm after the last block (the final norm, else fc_norm), or the last block's norm2 as a stand-in of
    the same width where neither is one."""
    for norm in (getattr(model, "norm", None), getattr(model, "fc_norm", None)):
        if isinstance(norm, torch.nn.LayerNorm):
            return norm
    return last_block.norm2


class _Floor(torch.nn.Module):
    """``floor``: a timm ViT's parameters run by ``_FloorEmbed`` and ``_FloorBlock`` per block, then timm's head on
    the class token: the host work a fused step cannot go below in this design."""

    def __init__(self, timm_model: torch.nn.Module):
        super().__init__()
        self.timm = timm_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.timm
        blocks = list(m.blocks)
        hidden, residual = _FloorEmbed.apply(x, m.patch_embed.proj.weight, m.patch_embed.proj.bias, m.pos_embed,
                                             m.cls_token, blocks[0].norm1.weight, blocks[0].norm1.bias)
        for i, blk in enumerate(blocks):
            # the last join's LayerNorm: the final norm (or fc_norm for average pooling)
            following = blocks[i + 1].norm1 if i + 1 < len(blocks) else _final_norm(m, blk)
            attn, mlp = blk.attn, blk.mlp
            hidden, residual = _FloorBlock.apply(hidden, residual, attn.qkv.weight, attn.qkv.bias, attn.proj.weight,
                                                 attn.proj.bias, blk.norm2.weight, blk.norm2.bias, mlp.fc1.weight,
                                                 mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, following.weight,
                                                 following.bias)
        return m.head(hidden[:, 0])


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
        _StubbedLaunches.current = self
        return self

    def __exit__(self, *exc):
        self.function.run = self.real
        _StubbedLaunches.current = None

    current: "_StubbedLaunches | None" = None  # the one in use (the floor's launches count with it)


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


def measure(paths: Sequence[str], preset: str, steps: int = 20, warmup: int = 3, batch: int = 1,
            calls_top: int = 0) -> list[HostCost]:
    """Median host microseconds per training step of each path ('vit_fast', 'vit_fast_per_part': every block per
    part instead of as one autograd Function, 'timm_eager', and the compiled 'vit_fast_compile', 'timm_compile'),
    with counts. The paths' steps alternate, so a busy or throttled CPU slows them alike and their ratios hold.
    ``calls_top``: also the functions with the most calls inside them (``calls_under``)."""
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
        return _measure(paths, preset, steps, warmup, stepper, calls_top)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default (it has no getter to restore from)


def _measure(paths: Sequence[str], preset: str, steps: int, warmup: int, stepper,
             calls_top: int = 0) -> list[HostCost]:
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
            calls = python_calls(step)
            profiled = []
            for _ in range(PROFILED_STEPS):
                with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
                result = HostCost(path, statistics.median(times[path]), steps,
                                  launches=round(launches[path] / steps), python_calls=calls)
                _count_ops(result, prof.events())
                profiled.append(result)
            results.append(min(profiled, key=lambda r: r.gemm_us))
            if calls_top:
                results[-1].calls_under = calls_under(step)[:calls_top]
    return results


def calls_under(step) -> list[tuple[str, int]]:
    """(function, calls made inside it, itself included) over one ``step``, most first: every call (Python
    functions as 'file.py:name', builtins as 'C:name') counts once for each function on the stack above it."""
    counts: dict[str, int] = {}
    stack: list[str] = []

    def tracer(frame, event, arg):
        if event == "call" or event == "c_call":
            code = frame.f_code
            name = (f"{os.path.basename(code.co_filename)}:{code.co_name}" if event == "call"
                    else f"C:{getattr(arg, '__qualname__', getattr(arg, '__name__', '?'))}")
            stack.append(name)
            for function in set(stack):  # a recursive function counts each call once
                counts[function] = counts.get(function, 0) + 1
        elif stack:  # return, c_return, c_exception
            stack.pop()

    sys.setprofile(tracer)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(counts.items(), key=lambda kv: -kv[1])


def python_calls(step) -> int:
    """Function calls of one ``step`` as cProfile counts them (Python functions and builtins)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        step()
    finally:
        profiler.disable()
    return sum(calls for _, calls, _, _, _ in pstats.Stats(profiler).stats.values())


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
             f"{'aten calls':>10} {'autograd nodes':>14} {'Python calls':>12}"]
    for r in results:
        lines.append(f"{r.path:<17} {r.step_us:>12.0f} {r.gemm_us:>11.0f} {r.launches:>9} {r.custom_ops:>10} "
                     f"{r.aten_calls:>10} {r.autograd_nodes:>14} {r.python_calls:>12}")
    by = {r.path: r for r in results}
    lines.append("(Python calls: one step's function calls as cProfile counts them, Python and builtins; the same "
                 "on every run of these torch and triton versions, where the microseconds vary with the machine)")
    lines.append("(of it GEMMs: the aten GEMMs' self CPU time in the least of 3 profiled steps, mostly their "
                 "arithmetic, which a GPU runs as one launch each; a rough figure)")
    for path, base in (("vit_fast", "timm_eager"), ("vit_fast_per_part", "timm_eager"), ("floor", "timm_eager"),
                       ("vit_fast_compile", "timm_compile")):
        if path in by and base in by:
            lines.append(f"{path} / {base.replace('_', ' ')} host time: {by[path].step_us / by[base].step_us:.2f}x; "
                         f"without the GEMMs' CPU time: {host_ratio(by[path], by[base]):.2f}x")
    if "floor" in by:
        lines.append("(floor: the least host work a fused step can do in vit_fast's design: per block one autograd "
                     "node, its cuBLAS GEMMs, the kernels' outputs allocated and one call per launch, nothing else; "
                     "what vit_fast takes above it is its own Python)")
    lines.append("(without the GEMMs: nearer a GPU's host work, where each GEMM is one launch; on the H200 of "
                 "2026-11-27, ViT-S/16 at batch 1 took vit_fast 35.9 ms per eager step and timm 20.3: 1.77x)")
    lines.append("(Triton's launcher and the CUDA launches, not run here, add to both on a GPU)")
    for r in results:
        lines += ["", f"{r.path}: slowest ops (us per step, inclusive; calls)"]
        for name, calls, us in r.per_op[:top]:
            lines.append(f"  {name:<44} {us:>9.0f} us {calls:>5}x")
    for r in results:
        if r.calls_under:
            lines += ["", f"{r.path}: functions with the most Python calls inside them per step (themselves included)"]
            lines += [f"  {calls:>7}  {name}" for name, calls in r.calls_under]
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
    parser.add_argument("--calls", type=int, default=0, metavar="N",
                        help="also list each path's N functions with the most Python calls inside them (default 0)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter's launch path: on before triton loads
        if "triton" in sys.modules:
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.run([sys.executable, "-m", "vit_fast.tools.host_cost",
                                   *(sys.argv[1:] if argv is None else argv)], env=env).returncode
        os.environ["TRITON_INTERPRET"] = "1"
    results = measure(args.paths, args.model, steps=args.steps, calls_top=args.calls)
    print(format_report(args.model, results, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
