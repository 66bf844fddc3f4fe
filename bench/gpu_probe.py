"""One GPU measurement per call, each appended as a JSON row to $PROBE_ROWS as soon as it is measured.

Run by bench/gpu_probe.sh, one subprocess per item under its own timeout, with
``faulthandler.dump_traceback_later`` so a hang leaves its stack. Items:

  env                       GPU, versions, measured bf16 GEMM and copy peaks
  hang  --preset --batch    torch.compile of the fused model: seconds to the first forward and backward
  step  --preset --path     one training-step path at batch 256 (vit_fast.tools.bench.measure: timm_eager,
                            vit_fast, *_graph: the whole step captured in a CUDA graph, *_compile: torch.compile)
  attn                      SDPA per backend (cuDNN, flash, efficient) on strided views of packed qkv, and
                            vit_fast's kernel, at ViT lengths; fwd and fwd+bwd, CUDA-graph timed; bitwise repeat
  micro                     every fused op vs its eager ops at ViT-B/16 b256: plain do_bench (host included)
                            and CUDA-graph replay (kernel time), plus a profiler table per fused op
  gemm                      cuBLAS fc1 (+ bias_gelu kernel, + cuBLASLt GELU epilogue) against linear_act; its two
                            Triton GEMMs alone, pointer and persistent TMA kernels, and whether they agree
  gelubwd                   the bias_gelu backward kernel at ViT-B/16's fc1 (50432 x 3072 bf16) over row tiles,
                            warps and partial-row counts (programs per SM), CUDA-graph timed
  trace --preset --path     every kernel of one path's training step (torch.profiler): name, family,
                            launches and ms per step, the longest first
  launch                    host microseconds per launch of a few vit_fast kernels on one-tile shapes (GPU work
                            smaller than the host's): the op as the model calls it, Triton's JIT launch
                            (``kernel[grid](...)``), and the compiled kernel called directly with the same arguments
  hostprof --preset --path  where the host's time goes in `--path`'s eager training step (vit_fast or
            --batch         timm_eager; forward under bf16 autocast, cross-entropy, backward, fused AdamW): host ms
                            per step, then cProfile's functions by own and by inclusive time per step, written to
                            $PROBE_DIR/hostprof_<path>.txt (at batch 1 the step is the host's time;
                            with VIT_FAST_DIRECT_LAUNCH=0 every launch goes through Triton's JIT)

``--tiny`` shrinks every shape so the script can be smoke-tested on CPU (figures meaningless).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROWS = os.environ.get("PROBE_ROWS", "probe_rows.jsonl")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def emit(item: str, **row) -> None:
    row = dict(item=item, **row)
    line = json.dumps(row, default=str)
    print("ROW", line, flush=True)
    with open(ROWS, "a") as f:
        f.write(line + "\n")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, graph: bool) -> float:
    """Median ms: plain do_bench (host time included) or CUDA-graph replay (kernel time): the campaign's timer."""
    from vit_fast.tools.campaign import time_ms

    return time_ms(fn, DEVICE, graph=graph)


def safe(item: str, fn, **tags):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failing case is a row, not a lost run
        emit(item, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", **tags)
        return None


# ------------------------------------------------------------------------------------------------ env
def item_env(args) -> None:
    import subprocess

    import timm
    import triton

    row = dict(torch=torch.__version__, triton=triton.__version__, timm=timm.__version__, cuda=torch.version.cuda,
               git=os.environ.get("PROBE_GIT", "unknown"), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if DEVICE == "cuda":
        row["gpu"] = torch.cuda.get_device_name()
        row["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        try:
            row["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        except OSError:
            row["driver"] = "unknown"
        n = 8192
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        row["gemm_bf16_tflops"] = 2 * n**3 / bench_ms(lambda: a @ b, False) / 1e9
        x = torch.randn(2**28, device="cuda")
        y = torch.empty_like(x)
        row["copy_gbps"] = 2 * x.nbytes / bench_ms(lambda: y.copy_(x), False) / 1e6
    emit("env", **row)


# ------------------------------------------------------------------------------------------------ models
def build(path: str, preset: str, tiny: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = dict(img_size=32, depth=2) if tiny else {}
    if path.startswith("timm"):
        import timm

        model = timm.create_model(preset, pretrained=False, **overrides)
    else:
        import vit_fast

        model = vit_fast.create_model(preset, backend="triton", **overrides)
    return model.to(DEVICE).train()


def item_hang(args) -> None:
    """Where the first compiled forward and backward of the fused model spend their time."""
    model = build("vit_fast", args.preset, args.tiny)
    compiled = torch.compile(model, backend=args.backend)
    img = 32 if args.tiny else 224
    x = torch.randn(args.batch, 3, img, img, device=DEVICE)
    y = torch.randint(0, 1000, (args.batch,), device=DEVICE)
    tags = dict(preset=args.preset, batch=args.batch, autotune=os.environ.get("VIT_FAST_AUTOTUNE", "1"),
                backend=args.backend)
    start = time.perf_counter()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = compiled(x)
    loss = F.cross_entropy(out.float(), y)
    sync()
    fwd_s = time.perf_counter() - start
    emit("hang", phase="first forward", seconds=fwd_s, **tags)
    loss.backward()
    sync()
    emit("hang", phase="first backward", seconds=time.perf_counter() - start - fwd_s, **tags)
    start = time.perf_counter()
    for _ in range(3):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = compiled(x)
        F.cross_entropy(out.float(), y).backward()
    sync()
    emit("hang", phase="next 3 steps", seconds=time.perf_counter() - start, **tags)


def item_step(args) -> None:
    """One path's training step: vit_fast.tools.bench.measure (forward under bf16 autocast + cross-entropy + backward
    + fused AdamW; *_graph paths through vit_fast.training.graphs.CudaGraphStep)."""
    from vit_fast.tools.bench import measure

    overrides = dict(img_size=32, depth=2) if args.tiny else {}
    row = measure({}, args.preset, "bf16", args.batch, args.path, 3 if args.tiny else 25, 3, None, device=DEVICE,
                  **overrides)
    emit("step", autotune=os.environ.get("VIT_FAST_AUTOTUNE", "1"), **row)


# ------------------------------------------------------------------------------------------------ attention
ATTN_SHAPES = [  # (batch, tokens, heads, head_dim): ViT-B/16 224, B/14 224, B/16 384, H/14 224, So400m/14 224
    (256, 197, 12, 64), (256, 257, 12, 64), (64, 577, 12, 64), (128, 257, 16, 80), (128, 256, 16, 72)]


def item_attn(args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vit_fast.kernels.attention import attention, short_supported
    from vit_fast.kernels.attention.interface import AttentionFunction, one_launch_only, stored_ds_only

    shapes = [(2, 17, 2, 64)] if args.tiny else ATTN_SHAPES
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}
    if args.tiny:
        backends = {"math": SDPBackend.MATH}
    for B, N, H, D in shapes:
        qkv = torch.randn(B, N, 3 * H * D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        bias = torch.zeros(3 * H * D, device=DEVICE, requires_grad=True)
        grad = torch.randn(B, N, H * D, device=DEVICE, dtype=torch.bfloat16)
        tags = dict(batch=B, tokens=N, heads=H, head_dim=D)

        def sdpa(backend):
            q, k, v = qkv.view(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # strided views, no copies
            if backend is None:
                o = F.scaled_dot_product_attention(q, k, v)
            else:
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(q, k, v)
            return o.transpose(1, 2).reshape(B, N, H * D)

        providers = {f"sdpa_{name}": (lambda b=b: sdpa(b)) for name, b in backends.items()}
        providers["vit_fast"] = lambda: attention(qkv, H)  # what users get: autotuned over every candidate
        providers["vit_fast_one_launch"] = providers["vit_fast"]  # autotuned over the one-launch tiles alone
        # with the qkv bias's gradient (the model's case: a column sum of d(qkv)), the bias an fp32 leaf
        providers["vit_fast_bias_grad"] = lambda: AttentionFunction.apply(qkv, bias, H, D ** -0.5, 0.0, None, N,
                                                                          "flash")[0]
        if short_supported(N, D, qkv.dtype):  # the short-sequence family where it runs
            providers["vit_fast_short"] = lambda: attention(qkv, H, kernel="short")
        # the flash backward with dS stored (dQ from it in a second launch) forced, on the static tiles
        providers["vit_fast_stored_ds"] = providers["vit_fast"]
        for name, fwd in providers.items():
            def measure(name=name, fwd=fwd):
                wrt = (qkv, bias) if name.endswith("bias_grad") else (qkv,)

                def fwd_bwd():
                    return torch.autograd.grad(fwd(), wrt, grad)[0]

                forcing = {"vit_fast_stored_ds": stored_ds_only, "vit_fast_one_launch": one_launch_only}.get(name)
                with forcing() if forcing else contextlib.nullcontext():
                    g1 = fwd_bwd()
                    g2 = fwd_bwd()
                    row = dict(provider=name, fwd_graph_ms=bench_ms(fwd, True),
                               fwd_bwd_graph_ms=bench_ms(fwd_bwd, True), fwd_bwd_plain_ms=bench_ms(fwd_bwd, False),
                               bitwise_repeatable=bool(torch.equal(g1, g2)), **tags)
                emit("attn", **row)

            safe("attn", measure, provider=name, **tags)


# ------------------------------------------------------------------------------------------------ micro
def item_micro(args) -> None:
    """The campaign's micro cases, each timed plain and as CUDA-graph replays, plus a profiler table per fused op."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from vit_fast.tools.campaign import micro_cases, time_case

    report = []
    for case in micro_cases("B/16", "vit_base_patch16_224", 256, DEVICE, args.tiny):
        for provider, fn in {"vit_fast": case.fused, **case.baselines}.items():
            def measure(case=case, provider=provider, fn=fn):
                row = dict(op=case.op, shape=case.shape, provider=provider)
                for label, backward in (("fwd", False), ("fwd_bwd", True)):
                    row[f"{label}_plain_ms"] = time_case(case, fn, backward, DEVICE)
                    row[f"{label}_graph_ms"] = time_case(case, fn, backward, DEVICE, graph=True)
                if provider == "vit_fast" and DEVICE == "cuda":
                    row.update(profile_fwd_bwd(case, fn, report))
                emit("micro", **row)

            safe("micro", measure, op=case.op, provider=provider)
    if report:
        with open(os.path.join(os.environ.get("PROBE_DIR", "."), "profile.txt"), "w") as f:
            f.write("\n".join(report))


def profile_fwd_bwd(case, fn, report: list) -> dict:
    """torch.profiler over five forward + backward calls: kernel ms and launches per call; the table to ``report``."""
    inputs = case.make()
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]

    def call():
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=case.autocast):
            out = fn(**inputs)
        return [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]

    grads = [torch.randn_like(o) for o in call()]
    torch.autograd.grad(call(), leaves, grads, allow_unused=True)
    sync()
    ms, launches, table = profiled_kernels(lambda: torch.autograd.grad(call(), leaves, grads, allow_unused=True),
                                           calls=5, rows=14)
    report.append(f"==== {case.op} {case.shape} fwd+bwd x5\n{table}\n")
    return dict(profiled_kernel_ms_per_iter=ms, profiled_launches_per_iter=launches)


def profiled_kernels(run, calls: int, rows: int) -> tuple[float, float, str]:
    """torch.profiler over ``calls`` calls of ``run``: GPU kernel ms and kernels per call, and the table of the
    ``rows`` kernels that took longest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return (sum(e.device_time for e in kernels) / calls / 1e3, len(kernels) / calls,
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))


# ------------------------------------------------------------------------------------------------ gemm
def item_gemm(args) -> None:
    from vit_fast.kernels import linear_act as la
    from vit_fast.kernels.bias_gelu import bias_gelu
    from vit_fast.kernels.linear_act import linear_act
    from vit_fast.kernels.linear_act_tma import TmaTile

    rows, C, K = (64, 32, 128) if args.tiny else (256 * 197, 768, 3072)
    bf16 = torch.bfloat16
    x = torch.randn(rows, C, device=DEVICE, dtype=bf16)
    w1 = torch.randn(K, C, device=DEVICE, dtype=bf16) * 0.02
    b1 = torch.randn(K, device=DEVICE, dtype=bf16) * 0.02
    w2 = torch.randn(C, K, device=DEVICE, dtype=bf16) * 0.02
    dh = torch.randn(rows, K, device=DEVICE, dtype=bf16)
    h = F.linear(x, w1)
    cases = {
        "cublas_fc1": lambda: F.linear(x, w1),
        "cublas_fc1_bias": lambda: F.linear(x, w1, b1),
        "cublas_fc1_bias+gelu_erf_eager": lambda: F.gelu(F.linear(x, w1, b1)),
        "cublas_fc1+bias_gelu_kernel": lambda: bias_gelu(F.linear(x, w1), b1),
        "bias_gelu_kernel_alone": lambda: bias_gelu(h, b1),
        "cublaslt_fc1_gelu_tanh_epilogue": lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True),
        "cublas_fc1_dgrad": lambda: dh @ w1,
        "cublas_fc1_wgrad": lambda: dh.t() @ x,
        "cublas_mlp_fwd": lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2),
        "linear_act_mlp_fwd": lambda: linear_act(x, w1, b1, w2),
    }
    # linear_act's two Triton GEMMs alone: the static tiles and the co-resident ones (two programs per SM; the
    # pointer kernels' only for the forward), on the pointer kernels and on the persistent TMA kernels
    fwd_tile = la.linear_act_config(bf16, 90).fwd
    bwd_tile = la.linear_act_config(bf16, 90).bwd
    h_out, dact_out, du_out = (torch.empty(rows, K, device=DEVICE, dtype=bf16) for _ in range(3))
    dy = torch.randn(rows, C, device=DEVICE, dtype=bf16)
    tiles = {"pointer": (fwd_tile, bwd_tile), "pointer_co_resident": (la.CO_RESIDENT[90], bwd_tile),
             "tma": (TmaTile.of(fwd_tile), TmaTile.of(bwd_tile)),
             "tma_co_resident": (la.CO_RESIDENT_TMA, la.CO_RESIDENT_TMA)}
    for suffix, (ft, bt) in tiles.items():
        cases[f"linear_act_fwd_kernel_{suffix}"] = lambda ft=ft: la.launch_fwd(
            h_out, dact_out, x, w1, b1, "gelu", True, ft)
        if suffix != "pointer_co_resident":  # the same dgrad tile as "pointer"
            cases[f"linear_act_dgrad_kernel_{suffix}"] = lambda bt=bt: la.launch_bwd(
                du_out, dy, w2, dact_out, True, bt)

    def agreement():
        outs = {}
        for suffix, (ft, bt) in tiles.items():
            h, d, du = (torch.full((rows, K), float("nan"), device=DEVICE, dtype=bf16) for _ in range(3))
            la.launch_fwd(h, d, x, w1, b1, "gelu", True, ft)
            outs[suffix] = (h, d, du, la.launch_bwd(du, dy, w2, d, True, bt))
        for suffix, out in outs.items():
            if suffix == "pointer":
                continue
            emit("gemm", case=f"linear_act_{suffix}_vs_pointer", **{
                f"{name}_bitwise_equal": torch.equal(a, b) for name, a, b in zip(("h", "dact", "du", "db"),
                                                                                outs["pointer"], out)},
                 **{f"{name}_max_abs_diff": (a.float() - b.float()).abs().max().item()
                    for name, a, b in zip(("h", "dact", "du", "db"), outs["pointer"], out)},
                 nan_left=any(t.isnan().any().item() for t in out))

    safe("gemm", agreement, case="linear_act_kernels_vs_pointer")
    flops = 2.0 * rows * C * K
    for name, fn in cases.items():
        def measure(name=name, fn=fn):
            ms = bench_ms(fn, True)
            gemms = 0 if name == "bias_gelu_kernel_alone" else (2 if "mlp" in name else 1)
            emit("gemm", case=name, graph_ms=ms, tflops=gemms * flops / ms / 1e9 if gemms else None,
                 rows=rows, width=C, hidden=K)

        safe("gemm", measure, case=name)


# ------------------------------------------------------------------------------------------------ gelubwd
def item_gelubwd(args) -> None:
    from vit_fast.kernels._rows import sum_partials
    from vit_fast.kernels._utils import cdiv
    from vit_fast.kernels.bias_gelu import _bias_gelu_bwd_kernel

    m, n = (64, 512) if args.tiny else (50432, 3072)
    dy = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dx = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4
    configs = [(bm, bn, w, per_sm) for bm, bn, w in ((8, 256, 8), (4, 256, 4), (16, 256, 8), (16, 256, 16),
                                                     (32, 256, 16), (8, 512, 8), (16, 512, 16), (32, 128, 8),
                                                     (64, 128, 16))
               for per_sm in (2, 4, 8, 16)]
    if args.tiny:
        configs = configs[:2]
    for bm, bn, w, per_sm in configs:
        def measure(bm=bm, bn=bn, w=w, per_sm=per_sm):
            col_tiles = cdiv(n, bn)
            g = max(1, min(cdiv(m, bm), cdiv(sms * per_sm, col_tiles)))
            partial = torch.empty((1, g, n), device=DEVICE, dtype=torch.float32)

            def kernel_only():
                _bias_gelu_bwd_kernel[(g, col_tiles)](dx, partial, dy, x, bias, n, n, n, m, n, g, BLOCK_M=bm,
                                                      BLOCK_N=bn, HAS_BIAS=True, APPROX_TANH=False, num_warps=w)

            def with_sum():
                kernel_only()
                return sum_partials(partial, bias.dtype)

            kernel_only()
            emit("gelubwd", block_m=bm, block_n=bn, warps=w, per_sm=per_sm, partials=g,
                 kernel_ms=bench_ms(kernel_only, True), with_sum_ms=bench_ms(with_sum, True),
                 floor_ms=3 * m * n * 2 / 4.2e12 * 1e3)

        safe("gelubwd", measure, block_m=bm, block_n=bn, warps=w, per_sm=per_sm)


# ------------------------------------------------------------------------------------------------ trace
def item_trace(args) -> None:
    """Each distinct kernel of `--path`'s ViT training step (forward, loss, backward; no optimizer, as counted):
    launches and ms per step, its family; says which kernels a family's launch count is made of."""
    from vit_fast.tools.predict import classify_kernel, profile_families

    overrides = dict(img_size=32, depth=1, embed_dim=64, num_heads=2, num_classes=10) if args.tiny else {}
    batch = 2 if args.tiny else args.batch
    profiled = profile_families(args.path, args.preset, batch, torch.bfloat16, steps=3, device=DEVICE,
                                compile_backend=args.backend, by_kernel=True, **overrides)
    for name, k in profiled["kernels"].items():
        emit("trace", preset=args.preset, path=args.path, batch=batch, kernel=name[:200], family=classify_kernel(name),
             launches_per_step=k["launches"], ms_per_step=k["seconds"] * 1e3)


# ------------------------------------------------------------------------------------------------ launch
def _host_us(fn, calls: int) -> float:
    """Median host microseconds per call over five rounds of ``calls`` back-to-back calls (the GPU work per call is
    a few microseconds, so the host sets the pace; the queue is drained between rounds)."""
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return sorted(rounds)[2]


def _captured_launch(launch):
    """(compiled kernel, grid, the arguments Triton's JIT passed to it) of the one Triton launch ``launch`` makes."""
    from triton.runtime.jit import JITFunction

    seen = []
    real = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real(self, *args, grid=grid, warmup=warmup, **kwargs)
        seen.append((self, kernel, grid, args, kwargs))
        return kernel
    JITFunction.run = run
    try:
        launch()
    finally:
        JITFunction.run = real
    return seen


def item_launch(args) -> None:
    from triton.runtime import driver

    from vit_fast.kernels import layer_norm as ln
    from vit_fast.kernels.attention import interface as ai

    calls = 50 if args.tiny else 2000
    dt = torch.bfloat16
    x = torch.randn(8, 768, device=DEVICE, dtype=dt)
    w, b = torch.ones(768, device=DEVICE), torch.zeros(768, device=DEVICE)
    qkv = torch.randn(1, 197, 3 * 768, device=DEVICE, dtype=dt)
    cases = {
        "layer_norm_fwd": lambda: ln.add_layer_norm_fwd.function(x, x, w, b, None, None, None, 1e-6, 0.0, None, None),
        "attention_fwd": lambda: ai.attention_fwd.function(qkv, 12, 0.125, 0.0, None, 197),
    }
    for name, op in cases.items():
        def measure(name=name, op=op):
            op()  # compiled (and tuned) first
            row = dict(case=name, op_us=_host_us(op, calls))
            launches = _captured_launch(op)
            row["triton_launches_per_op"] = len(launches)
            jit_fn, kernel, grid, a, kw = launches[0]
            row["kernel"] = jit_fn.__name__
            row["jit_launch_us"] = _host_us(lambda: jit_fn[grid](*a, **kw), calls)
            # every argument, constexprs included, in the kernel's order: what JITFunction.run hands the compiled
            # kernel (its binder is the last entry of the device's cache tuple in triton 3.6 and 3.8)
            binder = jit_fn.device_caches[driver.active.get_current_device()][-1]
            bound = binder(*a, **kw)[0]
            grid = tuple(grid(bound) if callable(grid) else grid)
            direct = kernel[grid + (1,) * (3 - len(grid))]  # the compiled kernel's runner takes all three
            values = tuple(bound.values())
            row["direct_launch_us"] = _host_us(lambda: direct(*values), calls)
            emit("launch", **row)
        safe("launch", measure, case=name)


# ------------------------------------------------------------------------------------------------ host profile
def item_hostprof(args) -> None:
    import cProfile
    import io
    import pstats

    from vit_fast.kernels._tuning import ENV_DIRECT_LAUNCH
    from vit_fast.kernels._utils import env_switch

    model = build(args.path, args.preset, args.tiny)
    img = 32 if args.tiny else 224
    x = torch.randn(args.batch, 3, img, img, device=DEVICE)
    y = torch.randint(0, 1000, (args.batch,), device=DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")

    def step():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    steps = 3 if args.tiny else 20
    for _ in range(3 if args.tiny else 10):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    sync()
    profiler.disable()
    report = io.StringIO()
    stats = pstats.Stats(profiler, stream=report)
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(60)
    # the GPU's own share: kernel time per step (torch.profiler's CUDA events), so a step near the kernels' sum is
    # GPU-bound (small kernels at batch 1) and one well above it is the host's; measured after the host figures
    gpu = safe("hostprof_gpu", lambda: _kernel_ms_per_step(step), preset=args.preset, path=args.path) or {}
    direct = env_switch(ENV_DIRECT_LAUNCH)
    name = f"hostprof_{args.path}{'' if direct or args.path.startswith('timm') else '_jit_launches'}.txt"
    with open(os.path.join(os.environ.get("PROBE_DIR", "."), name), "w") as f:
        f.write(f"{args.path} {args.preset} batch {args.batch}: {step_ms:.2f} ms per step unprofiled; "
                f"{steps} steps profiled; GPU kernels {gpu.get('kernel_ms_per_step', float('nan')):.2f} ms per step "
                f"in {gpu.get('kernels_per_step', 0):.0f} kernels\n{gpu.get('table', '')}\n{report.getvalue()}")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:20]  # (file, line, name) -> (cc, nc, tt, ct, _)
    emit("hostprof", preset=args.preset, path=args.path, batch=args.batch, direct_launch=direct, step_ms=step_ms,
         kernel_ms_per_step=gpu.get("kernel_ms_per_step"), kernels_per_step=gpu.get("kernels_per_step"),
         top_own_us_per_step=[(f"{os.path.basename(k[0])}:{k[1]}({k[2]})", round(v[2] / steps * 1e6, 1),
                               round(v[1] / steps, 1)) for k, v in rows])


def _kernel_ms_per_step(step, steps: int = 5) -> dict:
    """``profiled_kernels`` over ``steps`` training steps (CUDA only)."""
    if DEVICE != "cuda":
        return {}
    ms, kernels, table = profiled_kernels(step, calls=steps, rows=25)
    return dict(kernel_ms_per_step=ms, kernels_per_step=kernels, table=table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("item", choices=["env", "hang", "step", "attn", "micro", "gemm", "gelubwd", "trace", "launch",
                                           "hostprof"])
    parser.add_argument("--preset", default="vit_base_patch16_224")
    parser.add_argument("--path", default="vit_fast")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--dump-after", type=float, default=0, help="seconds before each stack dump (0: none)")
    args = parser.parse_args(argv)
    if args.dump_after:
        faulthandler.dump_traceback_later(args.dump_after, repeat=True)
    globals()[f"item_{args.item}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
