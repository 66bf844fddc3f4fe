"""`vit-fast bench --campaign --out DIR`: one command that turns a CUDA GPU into the project's figures in <= 9 min.

Stages, in order of value, each with a time budget (seconds, scaled by ``--budget``; a stage stops starting new
work when its budget is spent and says what it skipped), a progress line each:

  env         GPU, driver, torch, triton, CUDA, git revision; measured peaks: a bf16 GEMM (8192^3) and a device copy
  headline    training steps of ViT-B/16 and ViT-S/16 at batch 256 in bf16: timm eager, timm torch.compile, vit_fast,
              vit_fast with attention on the SDPA route, vit_fast torch.compile, vit_fast with a CUDA-graph step
              (images/s, median step time and 10-90% spread, MFU, peak memory); uncompiled paths first, then
              compiled ones while the budget lasts
  profile     where the step's kernel time goes: torch.profiler per op family (GEMM, attention, norm, elementwise,
              embed, other) and each path's slowest kernels by name, for ViT-B/16 b256: timm eager, vit_fast,
              vit_fast on the SDPA route and on the short-sequence attention, timm compile
  micro       every fused op against the eager ops it replaces and torch.compile of those, forward and
              forward+backward, ViT-B/16 and ViT-L/16 shapes (batch 256), plain calls (host included) and CUDA-graph
              replays (kernel time), GB/s or TFLOP/s next to the measured peaks
  tune        `vit-fast tune`'s table: every implementation of each part (vit_fast/route.py), each kernel's config
  check       ``vit-fast check --dtype bf16`` at full ViT-B/16 size (every kernel and the model vs float64)
  tests       the test suite on the compiled kernels (TRITON_INTERPRET unset), the kernel/model subset that fits
  throughput  the remaining throughput cases (ViT-L/16; batch 64)
  report      DIR/campaign.json (everything), DIR/<stage>.csv, DIR/throughput.png, DIR/micro.png, DIR/summary.md,
              rewritten after every row (a killed campaign keeps what it measured); a real campaign from a
              checkout also writes docs/measured/<gpu>-<date>.md and its CSVs, ready to commit

Nothing measured is lost to a hang: the throughput rows and the profiled paths run one after another in a child
process (``run_items``), each under its own timeout (ROW_TIMEOUT_S; an item that hangs is killed with its process
and the next goes on in a new one, an item that fails after others in the same process is run again in a fresh
one), the micro cases in a process per model shape with a timeout per case (MICRO_CASE_TIMEOUT_S, the shape going
on from the next case in a new process); each child arms faulthandler, so a hang leaves its Python stack in
DIR/hangs.log, and the rows stream back as measured.

``--quick`` runs env, headline and profile: the headline in <= 5 minutes (on the H200 of 2026-11-27, each row then
in a process of its own, the headline's first eight rows took 192 s, of which about 9 s a row went to the process's
start, imports and CUDA context (estimated from the rows' step counts); S/16's two compiled rows did not fit. The
rows now share a process: PREDICTED to leave them room).
``--stages NAME ...`` runs env and the named stages alone, in the campaign's order, each on its full budget (e.g.
``micro`` after a quick campaign, or a stage a killed run did not reach).

Every CSV row and the JSON carry the tags (gpu, driver, torch, triton, cuda, git). The micro-benchmarks reuse the
cases of bench/bench_norm_gelu.py, bench_attention.py, bench_patch_embed.py and bench_linear_act.py; the
throughput rows are vit_fast.tools.bench.measure, the same code as ``vit-fast bench``.

``--dry-run`` runs every stage on CPU with tiny shapes (kernels in the Triton interpreter, torch.compile with the
eager backend) in seconds: the figures mean nothing, but the command, its files and its summary are exercised
end to end (tests/test_campaign.py). Without CUDA and without --dry-run it prints one line and exits 0.

Adding a stage (e.g. ``vit-fast tune``'s autotuning table): write ``def stage(c: Campaign) -> dict`` that puts its
rows in ``c.results[name]`` (a list of dicts becomes DIR/<name>.csv) and returns a short status dict, then
``register_stage(Stage(name, stage, budget_s=60), after="env")``; the campaign times it, budgets it, reports it.
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

NO_CUDA = ("vit-fast bench --campaign: needs a CUDA GPU (none here); `--dry-run` exercises the whole command on CPU.")
TOTAL_BUDGET_S = 540.0  # 9 minutes
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The compiled-kernel subset of tests/, most likely to break on compiled kernels first: the kernels, then the
# model, torch.compile and the CUDA-graph step; what the budget does not reach is listed in the stage's status.
GPU_TESTS = ["tests/test_attention.py", "tests/test_attention_short.py", "tests/test_layer_norm.py",
             "tests/test_bias_gelu.py", "tests/test_linear_act.py", "tests/test_patch_embed.py", "tests/test_swiglu.py",
             "tests/test_fused_model.py", "tests/test_compile.py", "tests/test_graphs.py", "tests/test_model.py",
             "tests/test_backend.py"]
DRY_TESTS = ["tests/test_backend.py::test_resolve_rules"]

# (name, preset, batch, the ops measured there or None for every case)
MICRO_SHAPES = [("B/16", "vit_base_patch16_224", 256, None), ("L/16", "vit_large_patch16_224", 256, None),
                # attention where the short-sequence kernels stop (257 tokens: flash) and at 577
                ("L/14", "vit_large_patch14_clip_224", 128, ("attention", "attention_short")),
                ("B/16@384", "vit_base_patch16_384", 64, ("attention", "attention_short"))]
THROUGHPUT_MODELS = ["vit_base_patch16_224", "vit_small_patch16_224", "vit_large_patch16_224"]
THROUGHPUT_BATCHES = [64, 256]  # issue 30's batches: 64 is where host work shows, 256 the headline's
# the headline paths first; the route candidates (vit_fast/route.py) last, where a short budget cuts first
THROUGHPUT_PATHS = ("timm_eager", "timm_compile", "vit_fast", "vit_fast_compile", "vit_fast_graph", "vit_fast_sdpa",
                    "vit_fast_short")
# the headline: the paths a user picks between (issue 31); the route candidates are the full campaign's
HEADLINE_PATHS = ("timm_eager", "timm_compile", "vit_fast", "vit_fast_compile", "vit_fast_graph")
QUICK_MODELS = ["vit_base_patch16_224", "vit_small_patch16_224"]
QUICK_BATCHES = [256]
# Each throughput row runs under this timeout (seconds, before --budget scaling): a path that hangs (torch.compile
# of the fused model did on the first GPU run) loses its own row only, and leaves its stack (faulthandler, dumped
# at two thirds of the timeout) in DIR/hangs.log.
ROW_TIMEOUT_S = {"eager": 60.0, "graph": 60.0, "compile": 150.0}
# The first row of vit_fast's kernels in a campaign compiles them and times the tuning candidates (measured on the
# H200: ~50 s in one process, most of it the attention backward's); later rows read Triton's and the tuning cache.
FIRST_KERNELS_ALLOWANCE_S = 75.0
# The throughput rows and profiled paths share a process while they succeed (run_items): a process's start and
# imports, and the gap between two items (freeing the last one's memory), must come within this many seconds
ROW_GAP_TIMEOUT_S = 60.0
MICRO_CASE_TIMEOUT_S = 60.0  # each micro case (fused op, eager, torch.compile of eager), before --budget scaling
# compiled last: the longest
PROFILE_PATHS = ("timm_eager", "vit_fast", "vit_fast_sdpa", "vit_fast_short", "timm_compile")
# Each profiled path's slowest kernels by name (DIR/profile_kernels.csv; the summary lists the first
# PROFILE_KERNELS_SHOWN): a family total does not say which kernel or pass of it is slow.
PROFILE_TOP_KERNELS = 25
PROFILE_KERNELS_SHOWN = 10
SIMULATE_HANG = "VIT_FAST_CAMPAIGN_SIMULATE_HANG"  # a path name: that row sleeps past its timeout (tests)
# a path name: that row fails where it is not its process's first item (tests: it is measured again in a new one);
# 'start': every child fails before its first item
SIMULATE_FAILURE = "VIT_FAST_CAMPAIGN_SIMULATE_FAILURE"
DRY_RUN_NOTE = "DRY RUN: CPU, tiny shapes, figures meaningless"
DRY_OVERRIDES = dict(img_size=32, depth=1, embed_dim=64, num_heads=2, num_classes=10)


@dataclass
class Stage:
    name: str
    run: Callable[["Campaign"], dict]
    budget_s: float  # of TOTAL_BUDGET_S; scaled with --budget


@dataclass
class Campaign:
    out: str
    dry_run: bool
    scale: float = 1.0
    quick: bool = False
    device: str = "cuda"
    meta: dict = field(default_factory=dict)
    peaks: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)  # stage name -> list of row dicts (-> DIR/<name>.csv)
    stages: dict = field(default_factory=dict)  # stage name -> status dict
    start: float = field(default_factory=time.perf_counter)
    stage_deadline: float = math.inf
    # the throughput stage's cases where `--models`, `--batches`, `--paths` name them (None: its defaults)
    models: Optional[list] = None
    batches: Optional[list] = None
    paths: Optional[list] = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left in the current stage's budget."""
        return self.stage_deadline - time.perf_counter()

    def progress(self, message: str) -> None:
        print(f"[campaign {self.elapsed():5.0f} s] {message}", flush=True)

    def tagged(self, row: dict) -> dict:
        return {**self.meta, **row}


# ------------------------------------------------------------------------------------------------ env
def stage_env(c: Campaign) -> dict:
    import triton

    from vit_fast._compat import driver_version
    from vit_fast.tools.bench import git_revision

    cuda = c.device == "cuda"
    c.meta = dict(gpu=torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
                  driver=driver_version() if cuda else "none", torch=torch.__version__, triton=triton.__version__,
                  cuda=torch.version.cuda or "none", git=git_revision(), python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), dry_run=c.dry_run)
    n = 8192 if cuda else 256
    a, b = (torch.randn(n, n, device=c.device, dtype=torch.bfloat16) for _ in range(2))
    gemm_ms = time_ms(lambda: a @ b, c.device)
    x = torch.empty(2**28 if cuda else 2**20, device=c.device, dtype=torch.float32)
    y = torch.empty_like(x)
    copy_ms = time_ms(lambda: y.copy_(x), c.device)
    c.peaks = dict(gemm_bf16_tflops=2 * n**3 / gemm_ms / 1e9, copy_gbps=2 * x.nbytes / copy_ms / 1e6)
    c.results["env"] = [dict(c.meta, **c.peaks)]
    return dict(status="ok", **{k: round(v, 1) for k, v in c.peaks.items()})


def time_ms(fn: Callable[[], object], device: str, grad_to_none=None, reps: int = 3, graph: bool = False) -> float:
    """Median milliseconds: triton.testing.do_bench (flushes L2 between runs; back-to-back calls, so an op whose
    host work outlasts its kernels reads its host time) on CUDA, or with ``graph`` the replays of a CUDA graph
    of the calls (do_bench_cudagraph: kernel time alone); the host clock elsewhere (one warm-up call, then
    ``reps`` timed ones)."""
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            fn()  # compile and tune outside the capture
            return do_bench_cudagraph(fn, grad_to_none=grad_to_none, return_mode="median")
        return do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ tests, check
def _subprocess_env(c: Campaign) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if c.device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # compiled kernels, never the interpreter
    return env


def _run(c: Campaign, cmd: list[str], budget: float) -> tuple[str, int | None]:
    """(output, exit code or None when the budget ran out first)."""
    try:
        p = subprocess.run(cmd, cwd=REPO, env=_subprocess_env(c), capture_output=True, text=True,
                           timeout=max(budget, 1.0))
        return p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:  # stdout and stderr so far (a faulthandler stack is on stderr)
        text = [(o.decode(errors="replace") if isinstance(o, bytes) else o) for o in (e.stdout, e.stderr) if o]
        return "".join(text), None


def stage_tests(c: Campaign) -> dict:
    import importlib.util

    if importlib.util.find_spec("pytest") is None or not os.path.isdir(os.path.join(REPO, "tests")):
        return dict(status="skipped", reason="pytest or tests/ not available")
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=line", "-o",
           "console_output_style=classic"]
    selection = DRY_TESTS if c.dry_run else GPU_TESTS
    collected, _ = _run(c, [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *selection], min(60.0, c.left()))
    wanted = [line.strip() for line in collected.splitlines() if line.startswith("tests/") and "::" in line]
    if c.device == "cuda" and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2))), "--dist", "loadfile"]
    out, rc = _run(c, cmd + selection, c.left())
    with open(os.path.join(c.out, "tests.log"), "w") as f:
        f.write(out)
    outcome = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
    rows = [dict(test=m.group(1), outcome=m.group(2).lower())  # pytest -v: "tests/x.py::t PASSED"
            for m in re.finditer(r"^(tests/\S+::\S+) " + outcome, out, re.MULTILINE)]
    rows += [dict(test=m.group(2), outcome=m.group(1).lower())  # pytest-xdist -v: "[gw0] [ 1%] PASSED tests/x.py::t"
             for m in re.finditer(r"^\[gw\d+\].*?" + outcome + r" (tests/\S+::\S+)", out, re.MULTILINE)]
    reached = {r["test"] for r in rows}
    rows += [dict(test=t, outcome="not reached") for t in wanted if t not in reached]
    c.results["tests"] = [c.tagged(r) for r in rows]
    counts = {k.replace(" ", "_"): sum(r["outcome"] == k for r in rows)
              for k in ("passed", "failed", "error", "skipped", "not reached")}
    if counts["not_reached"]:
        c.progress(f"  tests: {counts['not_reached']} not reached in the budget (tests.csv lists them)")
    status = "timed out" if rc is None else ("ok" if rc == 0 else "failed")
    return dict(status=status, exit_code=rc, selection=" ".join(selection), **counts)


def stage_check(c: Campaign) -> dict:
    args = ["--model", "vit_tiny_patch16_224", "--batch", "1", "--depth", "1", "--ops", "layer_norm"] if c.dry_run \
        else ["--model", "vit_base_patch16_224", "--dtype", "bf16"]
    if c.dry_run:  # in-process: the interpreter is on already, and a second interpreter start costs most of it
        import contextlib
        import io

        from vit_fast.tools import check

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = check.main(args)
        out = buf.getvalue()
    else:
        out, rc = _run(c, [sys.executable, "-m", "vit_fast.tools.cli", "check", *args], c.left())
    with open(os.path.join(c.out, "check.txt"), "w") as f:
        f.write(out)
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 7 and parts[-1] in ("PASS", "FAIL"):
            rows.append(dict(op=" ".join(parts[:-6]), shape=parts[-6], dtype=parts[-5], max_abs_err=parts[-4],
                             rel_err=parts[-3], bound=parts[-2], result=parts[-1]))
    c.results["check"] = [c.tagged(r) for r in rows]
    passed = sum(r["result"] == "PASS" for r in rows)
    status = "timed out" if rc is None else ("ok" if rc == 0 and rows else "failed")
    return dict(status=status, exit_code=rc, passed=passed, rows=len(rows), args=" ".join(args))


# ------------------------------------------------------------------------------------------------ micro
@dataclass
class MicroCase:
    op: str
    shape: str
    make: Callable[[], dict]  # fresh inputs (tensors needing gradients have requires_grad)
    fused: Callable[..., object]
    baselines: dict  # name -> eager callable with the same signature ("eager", maybe "sdpa")
    work: Callable[[bool], tuple[float, str]]  # backward? -> (amount, "GB" | "TFLOP") moved/done per call
    autocast: bool = False


def micro_cases(shape_name: str, preset: str, batch: int, device: str, dry_run: bool) -> list[MicroCase]:
    """The fused ops at one model's training shapes, built from the bench/ scripts' cases."""
    import torch.nn.functional as F

    import vit_fast
    from bench.bench_attention import flops as attention_flops
    from bench.bench_linear_act import eager_mlp
    from bench.bench_norm_gelu import cases as norm_gelu_cases
    from bench.bench_patch_embed import eager_stack
    from vit_fast.kernels.attention import (
        attention,
        attention_linear,
        attention_linear_ref,
        attention_ref,
        short_supported,
    )
    from vit_fast.kernels.linear_act import linear_act
    from vit_fast.kernels.patch_embed import patch_embed

    cfg = vit_fast.get_config(preset, **(DRY_OVERRIDES if dry_run else {}))
    if dry_run:
        batch = 2
    C, K, H, N = cfg.embed_dim, cfg.mlp_hidden, cfg.num_heads, cfg.num_tokens
    D, P, img = C // H, cfg.patch_size[0], cfg.img_size[0]
    rows = batch * N
    bf16 = torch.bfloat16
    cases = []
    for case in norm_gelu_cases(rows, C, K, dev=device):
        if case.name in ("layer_norm", "add_layer_norm", "bias_gelu", "bias_dropout_add p=0.1+gamma"):
            n = rows * case.width
            cases.append(MicroCase(case.name, f"{rows}x{case.width}", case.make, case.kernel, {"eager": case.eager},
                                   lambda bwd, case=case, n=n: (
                                       (case.fwd_bytes_per_elem + (case.bwd_bytes_per_elem if bwd else 0)) * n / 1e9,
                                       "GB")))

    def act(*shape):
        return torch.randn(*shape, device=device, dtype=bf16, requires_grad=True)

    def par(*shape, scale=0.02):
        return (torch.randn(*shape, device=device) * scale).requires_grad_()

    def sdpa(qkv, num_heads):
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1)

    attn_flops = lambda bwd: (attention_flops(batch, H, N, D, bwd) / 1e12, "TFLOP")
    cases.append(MicroCase("attention", f"{batch}x{N}x{3 * C} h{H}", lambda: dict(qkv=act(batch, N, 3 * C),
                                                                               num_heads=H),
                           attention, {"eager": attention_ref, "sdpa": sdpa}, attn_flops))
    if short_supported(N, D, bf16):  # the short-sequence family
        cases.append(MicroCase("attention_short", f"{batch}x{N}x{3 * C} h{H}",
                               lambda: dict(qkv=act(batch, N, 3 * C), num_heads=H),
                               functools.partial(attention, kernel="short"), {"eager": attention_ref, "sdpa": sdpa},
                               attn_flops))
    qkv_gemm = 2.0 * rows * C * 3 * C
    cases.append(MicroCase(
        "attention_linear", f"{batch}x{N}x{C} h{H}",
        lambda: dict(x=act(batch, N, C), weight=par(3 * C, C), bias=par(3 * C), num_heads=H),
        attention_linear, {"eager": attention_linear_ref},
        lambda bwd: ((attention_flops(batch, H, N, D, bwd) + qkv_gemm * (3 if bwd else 1)) / 1e12, "TFLOP"),
        autocast=True))
    cases.append(MicroCase(
        "linear_act", f"{rows}x{C}->{K}->{C}",
        lambda: dict(x=act(rows, C), w1=par(K, C), b1=par(K), w2=par(C, K)),
        linear_act, {"eager": eager_mlp}, lambda bwd: (4.0 * rows * C * K * (3 if bwd else 1) / 1e12, "TFLOP"),
        autocast=True))
    Np = (img // P) ** 2
    cases.append(MicroCase(
        "patch_embed", f"{batch}x3x{img}x{img} p{P}",
        lambda: dict(images=torch.randn(batch, 3, img, img, device=device), weight=par(C, 3, P, P), bias=par(C),
                     pos_embed=par(1, 1 + Np, C), cls_token=par(1, 1, C)),
        functools.partial(patch_embed, tokens_dtype=torch.float32), {"eager": eager_stack},  # fp32 tokens: the model's
        lambda bwd: (2.0 * batch * Np * 3 * P * P * C * (2 if bwd else 1) / 1e12, "TFLOP"), autocast=True))
    return cases


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def time_case(case: MicroCase, fn: Callable, backward: bool, device: str, reps: int = 3, graph: bool = False) -> float:
    inputs = case.make()
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if case.autocast else None

    def call():
        if ctx is None:
            return _outputs(fn(**inputs))
        with ctx():
            return _outputs(fn(**inputs))

    grads = [torch.randn_like(o) for o in call() if o.is_floating_point()]

    def fwd_bwd():
        outs = [o for o in call() if o.is_floating_point()]
        return torch.autograd.grad(outs, leaves, grads, allow_unused=True)

    return time_ms(fwd_bwd if backward else call, device, reps=reps, graph=graph)


def measure_micro_case(case: MicroCase, peaks: dict, device: str, dry_run: bool, backend: str) -> list[dict]:
    """The forward and forward + backward rows of one micro case: vit_fast, the eager ops and their torch.compile,
    plain calls (host included) and CUDA-graph replays (kernel time) for vit_fast and eager."""
    providers = {"vit_fast": case.fused, **case.baselines,
                 "eager_compiled": torch.compile(case.baselines["eager"], backend=backend, dynamic=False)}
    rows = []
    for backward in (False, True):
        amount, unit = case.work(backward)
        # the peak in the rate's own unit: TFLOP/s, or GB/s of the measured device copy
        peak = peaks.get("gemm_bf16_tflops") if unit == "TFLOP" else peaks.get("copy_gbps")
        row = dict(op=case.op, shape=case.shape, pass_="fwd+bwd" if backward else "fwd", unit=f"{unit}/s",
                   measured_peak=peak)
        for name, fn in providers.items():
            # plain and graph-replayed timings fail apart: a case that cannot be captured keeps its plain figure
            for key, graph in ((f"{name}_ms", False), (f"{name}_kernel_ms", True)):
                if graph and name not in ("vit_fast", "eager"):  # kernel time apart from host time
                    continue
                try:
                    row[key] = time_case(case, fn, backward, device, reps=1 if graph or dry_run else 3, graph=graph)
                except Exception as e:  # a baseline that cannot run this shape is a finding, not a crash
                    row[key] = float("nan")
                    row[f"{key[:-3]}_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        # the rate of the kernels where they could be replayed from a graph, else of the plain calls
        kernel_ms = row.get("vit_fast_kernel_ms", float("nan"))
        row["vit_fast_rate"] = amount / (row["vit_fast_ms"] if math.isnan(kernel_ms) else kernel_ms) * 1e3
        row["vit_fast_of_peak"] = row["vit_fast_rate"] / peak if peak else float("nan")
        row["speedup_vs_eager"] = row["eager_ms"] / row["vit_fast_ms"]
        row["speedup_vs_compiled"] = row["eager_compiled_ms"] / row["vit_fast_ms"]
        row["kernel_speedup_vs_eager"] = row.get("eager_kernel_ms", float("nan")) / kernel_ms
        rows.append(row)
    torch._dynamo.reset()
    return rows


def micro_child(spec: dict) -> None:
    """The child of stage_micro: one model shape's cases from ``spec['start']``, 'CASE i op' before each and
    'ROW {json}' after it; the faulthandler dump is re-armed per case, so a hang shows where that case stuck."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    _interpreter_shims(spec["device"])
    cases = micro_cases(spec["shape"], spec["preset"], spec["batch"], spec["device"], spec["dry_run"])
    cases = [case for case in cases if spec.get("only") is None or case.op in spec["only"]]
    print(f"CASES {len(cases)}", flush=True)
    for i, case in enumerate(cases[spec["start"]:], start=spec["start"]):
        _arm_stack_dump(spec["dump_after_s"])
        print(f"CASE {i} {case.op}", flush=True)
        _simulated_hang(f"micro:{case.op}")
        for row in measure_micro_case(case, spec["peaks"], spec["device"], spec["dry_run"], spec["backend"]):
            print("ROW " + json.dumps(dict(row, model=spec["shape"]), default=str), flush=True)


def stream_child(c: Campaign, kind: str, spec: dict, idle_timeout: float,
                 on_line: Callable[[str], Optional[float]]):
    """Run ``python -m vit_fast.tools.campaign KIND SPEC_JSON``, handing each stdout line to ``on_line`` as it
    comes (rows reach the disk as measured). Killed when ``idle_timeout`` seconds pass without a line ('hung')
    or the stage's budget runs out ('budget'): returns (exit code, or that reason; its stderr, faulthandler
    stacks included). ``on_line`` may return a new idle timeout (a row with a timeout of its own starting)."""
    import queue
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "vit_fast.tools.campaign", kind, json.dumps(spec, default=str)],
                            cwd=REPO, env=_subprocess_env(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    lines: queue.Queue = queue.Queue()
    errors: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    deadline = time.perf_counter() + idle_timeout
    while True:
        try:
            line = lines.get(timeout=max(0.05, min(deadline, c.stage_deadline) - time.perf_counter()))
        except queue.Empty:
            line = ""
        if line is None:  # stdout closed: the child is done
            rc = proc.wait()
            break
        if line:
            idle_timeout = on_line(line.rstrip("\n")) or idle_timeout
            deadline = time.perf_counter() + idle_timeout
        elif time.perf_counter() >= min(deadline, c.stage_deadline):
            proc.kill()
            proc.wait()
            rc = "hung" if time.perf_counter() >= deadline and deadline < c.stage_deadline else "budget"
            break
    time.sleep(0.1)  # the stderr reader's last lines
    return rc, "".join(errors)


def _log_hang(c: Campaign, what: str, seconds: float, stderr: str) -> None:
    with open(os.path.join(c.out, "hangs.log"), "a") as f:
        f.write(f"==== {what}: no result after {seconds:.0f} s\n{stderr}\n")


@dataclass
class ItemsRun:
    """What ``run_items`` did: items finished (``done``: the index after the last), those that hung or ended their
    process (index, message), and whether the stage's budget stopped it."""
    done: int = 0
    hung: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    budget_spent: bool = False


def run_items(c: Campaign, kind: str, spec: dict, timeouts: list[float], describe: Callable[[int], str],
              on_item: Callable[[int, list[str], float, Optional[str]], None]) -> ItemsRun:
    """Items (throughput rows, profiled paths) measured one after another in child processes
    (``python -m vit_fast.tools.campaign KIND SPEC_JSON``: the child runs ``spec['items']`` from ``spec['start']``,
    printing 'START i' before an item and 'DONE i' or 'FAILED i' after it): the interpreter start, imports and CUDA
    context are paid once per process, not per item. Each item has its own timeout (``timeouts[i]``, from its START
    line, renewed by any line it prints); a hung item is killed with its process (its stack in DIR/hangs.log) and
    the next item goes on in a new one, as after a process that dies before its first item. An item FAILED after
    others in the same process is run again in a fresh one (whatever failed may be the process's state); a child
    leaves after a failure. ``on_item(i, lines, seconds, problem)`` receives each finished item's output lines and
    time (on disk at once: a killed campaign keeps them); ``problem`` names a hang or a crash (its lines as far as
    they came), None otherwise. Every item is finished, or left to the stage's budget (``budget_spent``)."""
    run = ItemsRun()
    state = dict(current=None, lines=[], started=0.0, start=0, retried=set())

    def on_line(line: str) -> Optional[float]:
        if line.startswith("START "):
            state.update(current=int(line.split()[1]), lines=[], started=time.perf_counter())
            return timeouts[state["current"]]
        if line.startswith(("DONE ", "FAILED ")):
            i = state["current"]
            if line.startswith("FAILED ") and i > state["start"] and i not in state["retried"]:
                state["retried"].add(i)
                c.progress(f"  {describe(i)}: failed after other items in one process; again in a new one")
            else:
                on_item(i, state["lines"], time.perf_counter() - state["started"], None)
                run.done = i + 1
            state["current"] = None
            return ROW_GAP_TIMEOUT_S
        if state["current"] is not None:
            state["lines"].append(line)
        return None

    while run.done < len(timeouts) and c.left() > 1.0:
        state.update(start=run.done, current=None)
        spawned = time.perf_counter()
        rc, stderr = stream_child(c, kind, dict(spec, start=run.done, spawned_at=time.time()),
                                  ROW_GAP_TIMEOUT_S + timeouts[run.done], on_line)
        where = state["current"]
        if rc == "budget":
            run.budget_spent = True
            break
        if where is None and run.done > state["start"]:  # ended between items: after a failure, or at the end
            continue
        stage = ""
        if where is None:  # no item started (imports, the CUDA context): the item it was for fails, the next
            where, state["lines"], state["started"] = run.done, [], spawned  # goes on in a new process
            stage = "before its first item"
        waited = time.perf_counter() - state["started"]
        if rc == "hung":
            _log_hang(c, describe(where), waited, stderr)
            problem = f"timed out{' ' + stage if stage else ''} after {waited:.0f} s (stack in hangs.log)"
            run.hung.append((where, problem))
        else:
            problem = (f"exit code {rc}{' ' + stage if stage else ''}: "
                       f"{' '.join(stderr.strip().splitlines()[-3:])[-300:]}")
            run.failed.append((where, problem))
        on_item(where, state["lines"], waited, problem)
        run.done = where + 1
    return run


def _child_items(spec: dict, dump_after: Callable[[dict], float]):
    """The items of a run_items child from its start, each announced ('START i') with faulthandler re-armed for
    it (a hang shows where that item stuck): yields (i, item); the caller prints 'DONE i' or 'FAILED i'."""
    if "start" in os.environ.get(SIMULATE_FAILURE, "").split(","):
        sys.exit("RuntimeError: simulated failure before the first item")
    _interpreter_shims(spec["device"])
    for i, item in enumerate(spec["items"][spec["start"]:], start=spec["start"]):
        _arm_stack_dump(dump_after(item))
        print(f"START {i}", flush=True)
        yield i, item


def _interpreter_shims(device: str) -> None:
    """On CPU the kernels run in the interpreter, which needs vit_fast's bf16 shims before the first launch."""
    if device == "cpu":
        from vit_fast.tools.interpreter import install_bf16_shims

        install_bf16_shims()


def _arm_stack_dump(seconds: float) -> None:
    """Every thread's Python stack on stderr each ``seconds`` from now (re-armed per item): what a hung item shows."""
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(seconds, repeat=True)


def _release(device: str) -> None:
    """Between two items of one child: the last one's memory back, no compiled graph kept."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _simulated_hang(name: str) -> None:
    """Tests: a name listed in $VIT_FAST_CAMPAIGN_SIMULATE_HANG sleeps past any timeout."""
    if name in os.environ.get(SIMULATE_HANG, "").split(","):
        time.sleep(3600)


def stage_micro(c: Campaign) -> dict:
    """Every shape's cases in a child process (stream_child): each case has its own timeout; a case that
    hangs is logged with its stack in DIR/hangs.log and the shape goes on from the next case in a new child."""
    if not os.path.isdir(os.path.join(REPO, "bench")):
        return dict(status="skipped", reason="bench/ not found: run from a checkout (pip install -e .)")
    rows = c.results.setdefault("micro", [])
    timeout = MICRO_CASE_TIMEOUT_S * max(c.scale, 0.25)
    hung, failed, not_reached = [], [], 0
    for shape_name, preset, batch, only in MICRO_SHAPES[:1] if c.dry_run else MICRO_SHAPES:
        state = dict(start=0, cases=0, current=None, completed=0, hung=0)

        def on_line(line: str, state=state) -> None:
            if line.startswith("CASES "):
                state["cases"] = int(line.split()[1])
            elif line.startswith("CASE "):
                state["current"] = (int(line.split()[1]), line.split()[2])
            elif line.startswith("ROW "):
                row = c.tagged(json.loads(line[4:]))
                rows.append(row)
                write_outputs(c)  # on disk as measured
                if row["pass_"] == "fwd+bwd":
                    state["completed"] += 1
                    c.progress(f"  micro {row['model']} {row['op']}: fwd+bwd {row['vit_fast_ms']:.3f} ms, "
                               f"{row['speedup_vs_eager']:.2f}x eager, {row['speedup_vs_compiled']:.2f}x compiled")

        while c.left() > 1.0:
            spec = dict(shape=shape_name, preset=preset, batch=batch, only=only, device=c.device, dry_run=c.dry_run,
                        peaks=c.peaks, start=state["start"], backend="eager" if c.dry_run else "inductor",
                        dump_after_s=timeout * 2 / 3)
            state["current"] = None
            rc, stderr = stream_child(c, "micro", spec, timeout, on_line)
            if rc == 0:
                break
            where = state["current"]
            what = f"micro {shape_name} {where[1] if where else 'setup'}"
            if rc == "hung":
                _log_hang(c, what, timeout, stderr)
                hung.append(what)
                state["hung"] += 1
            elif rc != "budget":
                failed.append(f"{what}: exit {rc}: {' '.join(stderr.strip().splitlines()[-2:])[-200:]}")
            if where is None or rc == "budget" or c.left() <= 1.0:
                break
            state["start"] = where[0] + 1
        not_reached += max(state["cases"] - state["completed"] - state["hung"], 0)
    c.stages["micro_hung"] = hung
    status = "ok" if not (hung or failed or not_reached) else ("budget spent" if not_reached else "errors")
    return dict(status=status, rows=len(rows), hung=len(hung), failed=failed, cases_not_reached=not_reached)


# ------------------------------------------------------------------------------------------------ throughput
def _row_timeout(c: Campaign, path: str) -> float:
    kind = "compile" if path.endswith("compile") else "graph" if path.endswith("graph") else "eager"
    return ROW_TIMEOUT_S[kind] * max(c.scale, 0.25)


def throughput_child(spec: dict) -> None:
    """The child of ``_throughput`` (``run_items``): each row 'ROW {json}', then 'DONE i', or 'FAILED i' for a row
    that failed (out of memory, an error in a path), which ends the process."""
    from vit_fast.tools.bench import measure

    ready = time.time()
    for i, item in _child_items(spec, lambda item: item["dump_after_s"]):
        startup_s = time.time() - (spec["spawned_at"] if i == spec["start"] else ready)
        _simulated_hang(item["path"])
        if i > spec["start"] and item["path"] in os.environ.get(SIMULATE_FAILURE, "").split(","):
            row = dict(spec["meta"], model=item["preset"], batch=item["batch"], path=item["path"],
                       error="RuntimeError: simulated failure after other rows")
        else:
            row = measure(spec["meta"], item["preset"], "bf16", item["batch"], item["path"], spec["steps"],
                          spec["warmup"], spec["peak"], device=spec["device"],
                          compile_backend=spec["compile_backend"], **spec["overrides"])
        row["startup_s"] = startup_s  # interpreter start and imports for a process's first row, else cleanup
        print("ROW " + json.dumps(row, default=str), flush=True)
        if "error" in row:
            print(f"FAILED {i}", flush=True)
            return
        print(f"DONE {i}", flush=True)
        _release(spec["device"])
        ready = time.time()


def stage_headline(c: Campaign) -> dict:
    """ViT-B/16 and ViT-S/16 at batch 256 on every path: the figures worth the most, measured first."""
    return _throughput(c, headline=True)


def stage_throughput(c: Campaign) -> dict:
    """The other throughput cases (ViT-L/16, batch 64; or those --models, --batches, --paths name), after every
    other stage."""
    return _throughput(c, headline=False)


def _throughput(c: Campaign, headline: bool) -> dict:
    from vit_fast.tools.bench import format_row, peak_tflops

    peak = peak_tflops(c.meta["gpu"], torch.bfloat16, None) or c.peaks.get("gemm_bf16_tflops")
    steps, warmup = (1, 1) if c.dry_run else (10, 3)
    overrides = DRY_OVERRIDES if c.dry_run else {}
    backend = "eager" if c.dry_run else "inductor"
    if c.dry_run:
        models, batches = THROUGHPUT_MODELS[:1], [2]  # the headline's paths, then the candidates
    elif headline:
        models, batches = QUICK_MODELS, QUICK_BATCHES
    else:
        models, batches = c.models or THROUGHPUT_MODELS, c.batches or THROUGHPUT_BATCHES
    paths = HEADLINE_PATHS if headline else (c.paths or THROUGHPUT_PATHS)
    # a CUDA graph needs a GPU: the dry run measures the other paths
    paths = [p for p in paths if not (c.dry_run and p.endswith("graph"))]
    measured = {(r.get("model"), r.get("batch"), r.get("path")) for r in c.results.get("throughput", [])}
    # the uncompiled paths of every case first (seconds each), then the compiled ones while the budget lasts
    order = [(m, b, p) for p in paths if not p.endswith("compile") for m in models for b in batches]
    order += [(m, b, p) for m in models for b in reversed(batches) for p in paths if p.endswith("compile")]
    order = [key for key in order if key not in measured]
    rows = c.results.setdefault("throughput", [])
    kernels_ready = any(r["path"].startswith("vit_fast") and "error" not in r for r in rows)
    specs, timeouts = [], []
    for model, batch, path in order:
        first = path.startswith("vit_fast") and not kernels_ready
        kernels_ready = kernels_ready or path.startswith("vit_fast")
        timeouts.append(_row_timeout(c, path) + (FIRST_KERNELS_ALLOWANCE_S * min(c.scale, 1.0) if first else 0.0))
        specs.append(dict(preset=model, batch=batch, path=path, dump_after_s=timeouts[-1] * 2 / 3))

    def describe(i: int) -> str:
        return f"{specs[i]['preset']} b{specs[i]['batch']} {specs[i]['path']}"

    def on_item(i: int, lines: list[str], seconds: float, problem: Optional[str]) -> None:
        """A row on disk as measured: the child's, or an error row for a hang or a crash."""
        found = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        row = found[-1] if found else dict(c.meta, model=specs[i]["preset"], dtype="bf16", batch=specs[i]["batch"],
                                           path=specs[i]["path"], error=problem)
        row["seconds"] = seconds
        row["mfu_of_measured_gemm"] = row.get("tflops", float("nan")) / c.peaks.get("gemm_bf16_tflops", float("nan"))
        rows.append(row)
        write_outputs(c)
        c.progress("  " + format_row(row))

    common = dict(meta=c.meta, steps=steps, warmup=warmup, peak=peak, device=c.device, compile_backend=backend,
                  overrides=overrides, items=specs)
    run = run_items(c, "throughput", common, timeouts, describe, on_item)
    skipped = [describe(i) for i in range(run.done, len(specs))]
    c.stages["throughput_skipped"] = c.stages.get("throughput_skipped", []) + skipped
    failed = sum("error" in r for r in rows)
    return dict(status="ok" if not skipped and not failed else ("budget spent" if skipped else "errors"),
                rows=len(rows), errors=failed, skipped=len(skipped))


def profile_child(spec: dict) -> None:
    """The child of stage_profile (``run_items``): per path its kernel time per op family ('ROW {json}' per
    family), then its slowest kernels by name ('KERNEL {json}', PROFILE_TOP_KERNELS of them), then 'DONE i'; a
    path that raises prints 'ERROR message' and 'FAILED i' and ends the process."""
    import traceback

    from vit_fast.tools.predict import classify_kernel, profile_families

    for i, item in _child_items(spec, lambda item: spec["dump_after_s"][item]):
        _simulated_hang(f"profile:{item}")
        try:
            result = profile_families(item, spec["preset"], spec["batch"], torch.bfloat16, steps=spec["steps"],
                                      warmup=spec["warmup"], device=spec["device"],
                                      compile_backend=spec["compile_backend"], by_kernel=True, **spec["overrides"])
        except Exception as e:
            traceback.print_exc()
            print(f"ERROR {type(e).__name__}: {' '.join(str(e).split())[:200]}", flush=True)
            print(f"FAILED {i}", flush=True)
            return
        case = dict(model=spec["preset"], batch=spec["batch"], path=item)
        for family, f in result["families"].items():
            print("ROW " + json.dumps(dict(case, family=family, kernel_ms_per_step=f["seconds"] * 1e3,
                                           launches_per_step=f["launches"], step_ms=result["step_s"] * 1e3)),
                  flush=True)
        for rank, (name, k) in enumerate(list(result["kernels"].items())[:PROFILE_TOP_KERNELS], 1):
            print("KERNEL " + json.dumps(dict(case, rank=rank, kernel=name, family=classify_kernel(name),
                                              kernel_ms_per_step=k["seconds"] * 1e3,
                                              launches_per_step=k["launches"])), flush=True)
        print(f"DONE {i}", flush=True)
        result = None
        _release(spec["device"])


def stage_profile(c: Campaign) -> dict:
    """Kernel time per op family per training step (torch.profiler: GEMM, attention, norm, elementwise, embed,
    other) of ViT-B/16 at batch 256 for each of PROFILE_PATHS, one after another in a child process
    (``run_items``)."""
    preset, batch = (THROUGHPUT_MODELS[0], 2) if c.dry_run else (QUICK_MODELS[0], QUICK_BATCHES[0])
    rows = c.results.setdefault("profile", [])
    kernel_rows = c.results.setdefault("profile_kernels", [])
    paths = list(PROFILE_PATHS)
    timeouts = [_row_timeout(c, path) for path in paths]
    failed = []

    def on_item(i: int, lines: list[str], seconds: float, problem: Optional[str]) -> None:
        rows.extend(c.tagged(json.loads(line[4:])) for line in lines if line.startswith("ROW "))
        kernel_rows.extend(c.tagged(json.loads(line[7:])) for line in lines if line.startswith("KERNEL "))
        write_outputs(c)
        error = next((line[6:] for line in lines if line.startswith("ERROR ")), None)
        if error and not problem:
            failed.append(f"{paths[i]}: {error}")
        if not (error or problem):
            step = next((r["step_ms"] for r in rows if r["path"] == paths[i]), float("nan"))
            c.progress(f"  profile {paths[i]}: step {step:.2f} ms ({seconds:.0f} s)")

    spec = dict(items=paths, preset=preset, batch=batch, device=c.device, steps=1 if c.dry_run else 5,
                warmup=1 if c.dry_run else 3, compile_backend="eager" if c.dry_run else "inductor",
                overrides=DRY_OVERRIDES if c.dry_run else {},
                dump_after_s={path: t * 2 / 3 for path, t in zip(paths, timeouts)})
    run = run_items(c, "profile", spec, timeouts, lambda i: f"profile {preset} b{batch} {paths[i]}", on_item)
    hung = [paths[i] for i, _ in run.hung]
    failed += [f"{paths[i]}: {problem}" for i, problem in run.failed]
    skipped = paths[run.done:]
    status = "ok" if not (hung or failed or skipped) else ("budget spent" if skipped else "errors")
    return dict(status=status, rows=len(rows), hung=hung, failed=failed, skipped=skipped)


def stage_tune(c: Campaign) -> dict:
    """`vit-fast tune`'s table: every implementation of each part and each kernel's config choice (tools/tune.py)."""
    from vit_fast.tools.tune import campaign_stage

    return campaign_stage(c)


# In order of value: the headline step times, where their kernel time goes, the fused ops alone; then the
# tuning table, the correctness checks on the compiled kernels, and the remaining throughput cases.
STAGES: list[Stage] = [
    Stage("env", stage_env, 20),
    Stage("headline", stage_headline, 200),
    Stage("profile", stage_profile, 60),
    Stage("micro", stage_micro, 90),
    Stage("tune", stage_tune, 40),
    Stage("check", stage_check, 40),
    Stage("tests", stage_tests, 70),
    Stage("throughput", stage_throughput, 20),
]


# --quick: the headline (ViT-B/16 and S/16, batch 256, every throughput path) and its profile, <= 5 min; the fused
# ops' micro stage is the full campaign's (or `--stages micro`)
QUICK_STAGES = ["env", "headline", "profile"]
QUICK_BUDGET_S = {"env": 10, "headline": 255, "profile": 35}


def register_stage(stage: Stage, after: str | None = None) -> None:
    """Add a stage (e.g. `vit-fast tune`'s autotuning table) after the named one (default: last). Keep the sum
    of the budgets within TOTAL_BUDGET_S, taking it from another stage if need be."""
    names = [s.name for s in STAGES]
    if stage.name in names:
        raise ValueError(f"campaign stage {stage.name!r} exists already")
    STAGES.insert(names.index(after) + 1 if after else len(STAGES), stage)


# ------------------------------------------------------------------------------------------------ report
def write_outputs(c: Campaign) -> list[str]:
    from vit_fast.tools.bench import plot, write_csv

    written = []
    for name, rows in c.results.items():
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            rows = [{k: r.get(k, "") for k in keys} for r in rows]
            write_csv(os.path.join(c.out, f"{name}.csv"), rows)
            written.append(f"{name}.csv")
    with open(os.path.join(c.out, "campaign.json"), "w") as f:
        json.dump(dict(meta=c.meta, peaks=c.peaks, stages=c.stages, results=c.results), f, indent=1, default=str)
    written.append("campaign.json")
    ok_rows = [r for r in c.results.get("throughput", []) if "error" not in r]
    note = DRY_RUN_NOTE if c.dry_run else ""
    try:
        if ok_rows:
            plot(ok_rows, os.path.join(c.out, "throughput.png"), THROUGHPUT_PATHS, note)
            written.append("throughput.png")
        if c.results.get("micro"):
            plot_micro(c.results["micro"], os.path.join(c.out, "micro.png"), note)
            written.append("micro.png")
    except ImportError:
        c.progress("matplotlib is not installed: no PNG charts")
    with open(os.path.join(c.out, "summary.md"), "w") as f:
        f.write(summary(c))
    written.append("summary.md")
    if not c.dry_run and c.meta and os.path.isdir(os.path.join(REPO, "docs", "measured")):  # a checkout
        try:
            written.append(write_record(c))
        except OSError as e:  # a read-only checkout keeps DIR's files
            c.progress(f"docs/measured record not written: {e}")
    return written


def record_name(meta: dict) -> str:
    """docs/measured/<gpu>-<date>-<hhmm>, the campaign's start in UTC: e.g. 'nvidia-h200-2026-11-26-0700' (two
    campaigns of one day are two records)."""
    gpu = re.sub(r"[^a-z0-9]+", "-", str(meta.get("gpu", "gpu")).lower()).strip("-")
    date = str(meta.get("date", ""))
    time = f"-{date[11:13]}{date[14:16]}" if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d", date) else ""
    return f"{gpu}-{date[:10]}{time}"


def write_record(c: Campaign) -> str:
    """The campaign as a record ready to commit: docs/measured/<name>.md (the summary) and its CSVs in
    docs/measured/<name>/, <name> from ``record_name``."""
    import shutil

    folder = os.path.join(REPO, "docs", "measured", record_name(c.meta))
    os.makedirs(folder, exist_ok=True)
    copied = sorted(name for name in os.listdir(c.out)
                    if name.endswith((".csv", ".log", ".txt")) or name == "campaign.json")
    for name in copied:
        shutil.copyfile(os.path.join(c.out, name), os.path.join(folder, name))
    text = summary(c)
    files = text.rindex("Files: ")
    with open(folder + ".md", "w") as f:
        f.write(text[:files] + f"Files (in {os.path.basename(folder)}/): {files_line(copied)}\n")
    if c.results.get("profile"):  # the calibrated speed model's data (vit_fast/tools/calibration.py)
        from vit_fast.tools.calibration import measurement_from_campaign

        doc = json.loads(json.dumps(dict(meta=c.meta, peaks=c.peaks, results=c.results), default=str))
        shipped = os.path.join(REPO, "vit_fast", "data", "measured")
        os.makedirs(shipped, exist_ok=True)
        with open(os.path.join(shipped, record_name(c.meta) + ".json"), "w") as f:
            json.dump(measurement_from_campaign(doc), f, indent=1)
    return os.path.relpath(folder + ".md", REPO)


def plot_micro(rows: list[dict], path: str, note: str = "") -> None:
    from vit_fast.tools.bench import chart

    def draw(ax):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["speedup_vs_eager"] for r in rows], 0.4, label="vs eager")
        ax.bar([i + 0.2 for i in x], [r["speedup_vs_compiled"] for r in rows], 0.4, label="vs torch.compile")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{r['model']} {r['op']}\n{r['pass_']}" for r in rows], rotation=90, fontsize=6)

    chart(rows, path, max(6, 0.45 * len(rows)), draw, "vit_fast speedup (time ratio)", note)


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def summary(c: Campaign) -> str:
    m = c.meta
    lines = [f"# vit_fast GPU campaign{f' ({DRY_RUN_NOTE})' if c.dry_run else ''}",
             "", f"{m.get('gpu')} | driver {m.get('driver')} | torch {m.get('torch')} | triton {m.get('triton')} | "
             f"CUDA {m.get('cuda')} | git {m.get('git')} | {m.get('date')} | {c.elapsed():.0f} s in all", "",
             f"Measured peaks: bf16 GEMM {_f(c.peaks.get('gemm_bf16_tflops'), '{:.0f}')} TFLOP/s, device copy "
             f"{_f(c.peaks.get('copy_gbps'), '{:.0f}')} GB/s (read + write).", "",
             "| stage | status | seconds (budget) | details |", "|---|---|---|---|"]
    for name, st in c.stages.items():
        if isinstance(st, dict):
            details = ", ".join(f"{k} {v}" for k, v in st.items() if k not in ("status", "seconds", "budget_s"))
            lines.append(f"| {name} | {st.get('status')} | {st.get('seconds', 0):.0f} ({st.get('budget_s', 0):.0f}) "
                         f"| {details} |")
    tp = c.results.get("throughput", [])
    if tp:
        lines += ["", "## Training throughput, bf16 autocast, AdamW (images/s; median step ms [p10-p90]; MFU; "
                  "peak GiB)", "", "| model | batch | " + " | ".join(THROUGHPUT_PATHS) +
                  " | vit_fast / timm eager | vit_fast compiled / timm compiled | vit_fast graph / timm eager "
                  "| vit_fast graph / timm compiled |",
                  "|---|---|" + "---|" * (len(THROUGHPUT_PATHS) + 4)]
        by = {(r["model"], r["batch"], r["path"]): r for r in tp}
        for model in dict.fromkeys(r["model"] for r in tp):
            for batch in sorted({r["batch"] for r in tp if r["model"] == model}):
                cells = []
                for p in THROUGHPUT_PATHS:
                    r = by.get((model, batch, p))
                    if r is None:
                        cells.append("skipped (budget)")
                    elif "error" in r:
                        cells.append(f"error: {r['error'][:40]}")
                    else:
                        cells.append(f"{r['images_per_s']:.0f}; {r['step_ms']:.1f} [{r['p10_ms']:.1f}-"
                                     f"{r['p90_ms']:.1f}]; {_f(r['mfu'], '{:.0%}')}; {_f(r['peak_mem_gb'], '{:.1f}')}")

                def ratio(a, b):
                    ra, rb = by.get((model, batch, a)), by.get((model, batch, b))
                    if not ra or not rb or "error" in ra or "error" in rb:
                        return "-"
                    return f"{ra['images_per_s'] / rb['images_per_s']:.2f}x"

                lines.append(f"| {model} | {batch} | " + " | ".join(cells) +
                             f" | {ratio('vit_fast', 'timm_eager')} | {ratio('vit_fast_compile', 'timm_compile')} "
                             f"| {ratio('vit_fast_graph', 'timm_eager')} | {ratio('vit_fast_graph', 'timm_compile')} |")
    skipped = c.stages.get("throughput_skipped") or []
    if skipped:
        lines += ["", f"Skipped by the throughput budget: {', '.join(skipped)}."]
    profile = c.results.get("profile", [])
    if profile:
        paths = list(dict.fromkeys(r["path"] for r in profile))
        by = {(r["family"], r["path"]): r for r in profile}
        lines += ["", f"## Kernel time per op family, {profile[0]['model']} b{profile[0]['batch']} (torch.profiler, "
                  "ms per training step without the optimizer; launches)", "",
                  "| family | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
        for family in dict.fromkeys(r["family"] for r in profile):
            lines.append(f"| {family} | " + " | ".join(
                f"{by[family, p]['kernel_ms_per_step']:.2f} ({by[family, p]['launches_per_step']:.0f})"
                if (family, p) in by else "-" for p in paths) + " |")
        totals = [sum(r["kernel_ms_per_step"] for r in profile if r["path"] == p) for p in paths]
        steps = [next(r["step_ms"] for r in profile if r["path"] == p) for p in paths]
        lines += ["| kernels, total | " + " | ".join(f"{t:.2f}" for t in totals) + " |",
                  "| step (CUDA events) | " + " | ".join(f"{t:.2f}" for t in steps) + " |"]
    kernels = c.results.get("profile_kernels", [])
    if kernels:
        lines += ["", f"## Slowest kernels per path, {kernels[0]['model']} b{kernels[0]['batch']} (torch.profiler, "
                  f"ms per training step; first {PROFILE_KERNELS_SHOWN} of each, all "
                  f"{PROFILE_TOP_KERNELS} in profile_kernels.csv)", "",
                  "| path | kernel | family | ms per step | launches | ms per launch |", "|---|---|---|---|---|---|"]
        for r in kernels:
            if r["rank"] <= PROFILE_KERNELS_SHOWN:
                name = r["kernel"] if len(r["kernel"]) <= 70 else r["kernel"][:67] + "..."
                per_launch = r["kernel_ms_per_step"] / r["launches_per_step"] if r["launches_per_step"] else math.nan
                lines.append(f"| {r['path']} | `{name.replace('|', '/')}` | {r['family']} | "
                             f"{r['kernel_ms_per_step']:.3f} | {r['launches_per_step']:.0f} | "
                             f"{_f(per_launch, '{:.4f}')} |")
    micro = c.results.get("micro", [])
    if micro:
        lines += ["", "## Fused kernels vs the eager ops they replace (median ms; speedup = baseline / vit_fast)", "",
                  "Kernel ms: the calls replayed from a CUDA graph (no host work); the other columns are plain "
                  "back-to-back calls, host work included. Rate: of the kernel time where it was measured.", "",
                  "| model | op | pass | vit_fast ms | vit_fast kernel ms | eager ms | eager kernel ms | compiled ms "
                  "| x eager | x eager, kernels | x compiled | vit_fast rate | of measured peak |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in micro:
            lines.append(f"| {r['model']} | {r['op']} | {r['pass_']} | {_f(r['vit_fast_ms'], '{:.3f}')} | "
                         f"{_f(r.get('vit_fast_kernel_ms'), '{:.3f}')} | "
                         f"{_f(r['eager_ms'], '{:.3f}')} | {_f(r.get('eager_kernel_ms'), '{:.3f}')} | "
                         f"{_f(r['eager_compiled_ms'], '{:.3f}')} | "
                         f"{_f(r['speedup_vs_eager'])} | {_f(r.get('kernel_speedup_vs_eager'))} | "
                         f"{_f(r['speedup_vs_compiled'])} | "
                         f"{_f(r['vit_fast_rate'], '{:.1f}')} {r['unit']} | {_f(r['vit_fast_of_peak'], '{:.0%}')} |")
    present = sorted(os.listdir(c.out)) if os.path.isdir(c.out) else []
    lines += ["", "Files: " + files_line([name for name in present if name != "summary.md"]), ""]
    return "\n".join(lines)


def files_line(names: list[str]) -> str:
    """The files a campaign wrote, as its summary lists them."""
    about = {"campaign.json": "campaign.json (everything)",
             "hangs.log": "hangs.log (the stack of every row or case that ran out of time)"}
    return ", ".join(about.get(name, name) for name in names) or "none yet"


# ------------------------------------------------------------------------------------------------ main
def _stages(quick: bool, names: list[str] | None) -> list[Stage]:
    """The stages to run: ``names`` (each on its full budget, in the campaign's order, env always: it tags every
    row), else the quick ones on the quick budgets, else all."""
    if names:
        unknown = sorted(set(names) - {s.name for s in STAGES})
        if unknown:
            raise ValueError(f"vit-fast bench --campaign --stages: unknown stage(s) {', '.join(unknown)}; expected "
                             f"some of {', '.join(s.name for s in STAGES)}")
        return [s for s in STAGES if s.name in names or s.name == "env"]
    if quick:
        return [Stage(s.name, s.run, QUICK_BUDGET_S[s.name]) for s in STAGES if s.name in QUICK_STAGES]
    return STAGES


def main(args) -> int:
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print(NO_CUDA)
        return 0
    quick = bool(getattr(args, "quick", False))
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        # the dry run's kernels run in the interpreter, which must be on before triton is imported
        if "triton" in sys.modules:
            argv = ["--campaign", "--dry-run", "--out", args.out]
            argv += (["--budget", str(args.budget)] if args.budget else []) + (["--quick"] if quick else [])
            argv += ["--stages", *args.stages] if getattr(args, "stages", None) else []
            for option in ("models", "batches", "paths"):
                argv += [f"--{option}", *map(str, getattr(args, option))] if getattr(args, option, None) else []
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.run([sys.executable, "-m", "vit_fast.tools.cli", "bench", *argv], env=env).returncode
        os.environ["TRITON_INTERPRET"] = "1"
    _interpreter_shims("cuda" if cuda else "cpu")
    os.makedirs(args.out, exist_ok=True)
    try:
        stages = _stages(quick, getattr(args, "stages", None))
    except ValueError as e:
        print(e)
        return 2
    total = sum(s.budget_s for s in stages)
    scale = (args.budget or total) / total
    c = Campaign(out=args.out, dry_run=args.dry_run, scale=scale, device="cuda" if cuda else "cpu", quick=quick,
                 models=getattr(args, "models", None), batches=getattr(args, "batches", None),
                 paths=getattr(args, "paths", None))
    c.progress(f"vit-fast bench --campaign{' --quick' if quick else ''}{' --dry-run' if args.dry_run else ''}: "
               f"{len(stages)} stages, {total * scale:.0f} s budget, writing to {args.out}")
    for stage in stages:
        budget = stage.budget_s * scale
        c.stage_deadline = time.perf_counter() + budget
        c.progress(f"{stage.name}: start (budget {budget:.0f} s)")
        start = time.perf_counter()
        try:
            status = stage.run(c)
        except Exception as e:  # a broken stage is reported, the others still run
            status = dict(status="error", error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        status.update(seconds=time.perf_counter() - start, budget_s=budget)
        c.stages[stage.name] = status
        c.progress(f"{stage.name}: {status['status']} in {status['seconds']:.0f} s " +
                   ", ".join(f"{k} {v}" for k, v in status.items() if k not in ("status", "seconds", "budget_s")))
    written = write_outputs(c)
    bad = [name for name, st in c.stages.items() if isinstance(st, dict) and st["status"] in ("failed", "error")]
    c.progress(f"done in {c.elapsed():.0f} s: {', '.join(written)} in {args.out}" +
               (f"; FAILED stages: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    children = dict(throughput=throughput_child, micro=micro_child, profile=profile_child)
    if sys.argv[1:2] and sys.argv[1] in children:
        children[sys.argv[1]](json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit("usage: python -m vit_fast.tools.campaign throughput|micro|profile SPEC_JSON (run by vit-fast bench "
             "--campaign)")
