"""`vit-fast report`: what every Triton kernel costs on an A100 (sm_80) and an H100 (sm_90), measured
without a GPU (CONTRIBUTING.md describes how kernels are checked without a GPU).

For each preset x dtype x arch, every kernel module in ``vit_fast.kernels`` that exposes
``aot_specs(...)`` lists the (kernel, constexprs, num_warps, num_stages) entries its config table
would launch. Each distinct entry is compiled ahead of time with ``triton.compile(ASTSource(...),
target=GPUTarget('cuda', cc, 32))``; the cubin's resource usage is read with the ``cuobjdump``
shipped in the Triton wheel. Per entry the report gives registers per thread, spill bytes
(STACK + LOCAL), shared memory (Triton's dynamic allocation + static), threads, theoretical
occupancy and whether the PTX uses tensor-core instructions (mma.sync on sm_80; wgmma or mma.sync
on sm_90) where the kernel has a dot.

Compilation runs in worker processes with TRITON_INTERPRET=0 (under the interpreter ``@triton.jit``
gives interpreted functions, which cannot be compiled). Results are cached on disk under
``~/.cache/vit_fast/aot`` (override with VIT_FAST_AOT_CACHE), keyed by the source of the kernel and
of every @triton.jit function it calls (followed through module globals, in any file), the values of
the constexpr globals they read, the Triton version and the spec: editing a kernel or a helper it
inlines recompiles what uses it, and nothing else.

The full report covers the six ViT presets and the fine-tuning family presets (``REPORT_PRESETS``), every
dtype, autocast and pure 16-bit: about 5,300 compiles. ``--quick`` covers one preset (vit_base_patch16_224)
in bf16 under autocast (the default training recipe; no pure 16-bit model) on both architectures: 346 of them.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import pickle
import pkgutil
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field

import torch

from vit_fast.family_presets import FAMILY_PRESETS
from vit_fast.tools import preset_name

ARCHS = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Per-SM / per-block limits (CUDA occupancy calculator for cc 8.0 and 9.0).
ARCH_LIMITS = {
    80: dict(name="A100", smem_per_block=163 * 1024, smem_per_sm=164 * 1024, regs_per_sm=65536, max_warps=64,
             max_blocks=32),
    90: dict(name="H100", smem_per_block=227 * 1024, smem_per_sm=228 * 1024, regs_per_sm=65536, max_warps=64,
             max_blocks=32),
}
# The presets the report covers (issue 7): ViT-Ti/S/B/L at 224, ViT-B at 384, ViT-H/14, and the fine-tuning
# families (vit_fast/family_presets.py: CLIP, SigLIP B and So400m, DINOv2 S/B/L/g, DeiT distilled). Most families
# share ViT-B/L's shapes; So400m (head_dim 72, MLP 4304, patch 14) and DINOv2 (1370 tokens, g's SwiGLU at
# width 1536) bring new ones: about 5,300 compiles in all, 18% more than the six ViT presets alone.
VIT_PRESETS = ("vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
               "vit_base_patch16_384", "vit_huge_patch14_224")
REPORT_PRESETS = VIT_PRESETS + tuple(FAMILY_PRESETS)
QUICK_PRESETS, QUICK_DTYPES = ("vit_base_patch16_224",), ("bf16",)  # --quick: one preset, one dtype, both archs
SMEM_RESERVED_PER_BLOCK = 1024  # the driver reserves 1 KB of shared memory per resident block
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256


@dataclass
class Row:
    kernel: str
    config: str
    arch: int
    dtype: str
    uses: list[str] = field(default_factory=list)  # "preset/dtype" entries that launch this config
    regs: int = 0
    spill_bytes: int = 0  # STACK + LOCAL per thread
    shared_bytes: int = 0
    threads: int = 0
    warps_per_sm: int = 0
    occupancy: float = 0.0
    tensor_cores: str = "-"  # "mma" / "wgmma" / "NO" / "-" (no dot)
    error: str = ""
    note: str = ""
    cached: bool = False
    sass: dict | None = None  # instruction cost of the tensor-core loops (vit_fast.tools.sass.SassCost.to_dict())
    not_modelled: str = ""  # why the instruction-cost model does not read this kernel (AotSpec.not_modelled)

    @property
    def ceiling(self) -> float | None:
        """Fraction of tensor peak the worst MMA loop can reach (issue-, MUFU- or MMA-bound); None without one or
        where the model does not read the kernel."""
        return _sass_cost(self).ceiling if self.sass and not self.not_modelled else None

    def problems(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"compile error: {self.error}")
        if self.spill_bytes > 0:
            out.append(f"spills {self.spill_bytes} B/thread")
        limit = ARCH_LIMITS[self.arch]["smem_per_block"]
        if self.shared_bytes > limit:
            out.append(f"shared {self.shared_bytes} B > {limit} B per block")
        if self.tensor_cores == "NO":
            out.append("dot without tensor-core instructions")
        return out


# ----------------------------------------------------------------------------------------------
# Collecting the specs


def preset_shape(name: str) -> dict:
    """The keyword arguments every kernel module's aot_specs takes, for one preset."""
    from vit_fast.presets import get_config

    return config_shape(get_config(name))


def config_shape(cfg) -> dict:
    """The keyword arguments every kernel module's aot_specs takes, for one ViTConfig."""
    return dict(tokens=cfg.num_tokens, width=cfg.embed_dim, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                mlp_hidden=cfg.mlp_hidden, patch_size=cfg.patch_size[0], in_chans=cfg.in_chans,
                img_size=cfg.img_size[0], num_patches=cfg.grid_size[0] * cfg.grid_size[1])


def kernel_modules() -> list:
    """Every vit_fast.kernels module with an aot_specs function (grows as kernels land)."""
    import vit_fast.kernels as pkg

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"vit_fast.kernels.{info.name}")
        if callable(getattr(mod, "aot_specs", None)):
            mods.append(mod)
    return mods


def _python_fn(fn):
    """The plain Python function behind a JITFunction or an interpreter's InterpretedFunction."""
    return getattr(fn, "fn", fn)


def collect_specs(presets, dtypes, archs, pure: bool = True):
    """{key: (spec, arch, dtype name, [uses])} over every preset x dtype x arch, duplicates merged. A 16-bit
    dtype is listed as under autocast (fp32 parameters and images) and, with ``pure``, as a pure 16-bit model."""
    entries: dict[str, list] = {}
    for preset in presets:
        shape = preset_shape(preset)
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            kinds = {"": {}}
            if pure and dtype != torch.float32:
                kinds[" pure"] = dict(param_dtype=dtype, images_dtype=dtype)
            for arch in archs:
                for mod in kernel_modules():
                    for label, kind in kinds.items():
                        for spec in mod.aot_specs(**shape, dtype=dtype, arch=arch, **kind):
                            key = spec_key(spec, arch)
                            if key not in entries:
                                entries[key] = [spec, arch, dtype_name, []]
                            entries[key][3].append(f"{preset}/{dtype_name}{label}")
    return entries


def _is_jit(obj) -> bool:
    """A @triton.jit function, compiled (JITFunction) or under the interpreter (InterpretedFunction)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(obj, (JITFunction, InterpretedFunction))


def _code_names(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's code reads, nested code objects included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def inlined_sources(fn) -> list[tuple[str, str]]:
    if fn not in _INLINED:
        _INLINED[fn] = _inlined_sources(fn)
    return _INLINED[fn]


_INLINED: dict = {}  # per jit function object: a re-imported (edited) module brings new objects


def _inlined_sources(fn) -> list[tuple[str, str]]:
    """What the compiled kernel ``fn`` depends on besides its spec: ("module.name", source) of fn and
    of every @triton.jit function reachable from it through its module globals (``helper(...)``) or
    through a module it imports (``_math.helper(...)``), and ("module.NAME", repr) of the constexpr
    and plain-number globals they read. Triton's own functions (tl.sum, ...) are covered by the Triton
    version in the key. Sorted, so it hashes stably."""
    import triton.language as tl

    out: dict[str, str] = {}
    stack, seen = [fn], set()
    while stack:
        py = _python_fn(stack.pop())
        if id(py) in seen or py.__module__.startswith("triton."):  # Triton's own: keyed by its version
            continue
        seen.add(id(py))
        out[f"{py.__module__}.{py.__qualname__}"] = inspect.getsource(py)
        names = _code_names(py.__code__)
        scopes = [(py.__module__, py.__globals__)]
        scopes += [(v.__name__, vars(v)) for v in (py.__globals__.get(n) for n in names)
                   if isinstance(v, types.ModuleType) and not v.__name__.startswith(("triton", "torch", "numpy"))]
        for module, scope in scopes:
            for name in names & scope.keys():
                value = scope[name]
                if _is_jit(value):
                    stack.append(value)
                elif isinstance(value, tl.constexpr):
                    out[f"{module}.{name}"] = repr(value.value)
                elif isinstance(value, (bool, int, float)):
                    out[f"{module}.{name}"] = repr(value)
    return sorted(out.items())


def spec_key(spec, arch: int) -> str:
    import triton

    fn = _python_fn(spec.fn)
    payload = json.dumps(
        dict(
            module=fn.__module__, fn=fn.__name__, sources=inlined_sources(spec.fn), triton=triton.__version__,
            arch=arch, signature=sorted(spec.signature.items()),
            constexprs=sorted((k, repr(v)) for k, v in spec.constexprs.items()),
            num_warps=spec.num_warps, num_stages=spec.num_stages, divisible_by_16=sorted(spec.divisible_by_16),
        ),
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def config_string(spec) -> str:
    cx = " ".join(f"{k}={v}" for k, v in spec.constexprs.items())
    return f"{cx} w{spec.num_warps} s{spec.num_stages}".strip()


# ----------------------------------------------------------------------------------------------
# Compiling (in worker processes) and reading the cubin


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def parse_resource_usage(text: str) -> dict:
    """REG/STACK/SHARED/LOCAL of the (single) function in `cuobjdump --dump-resource-usage` output."""
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", text)
        if m is None:
            raise ValueError(f"cuobjdump output without {key}: {text[:300]!r}")
        out[key] = int(m.group(1))
    return out


def tensor_core_use(ptx: str, arch: int) -> str:
    if arch >= 90 and re.search(r"\bwgmma\.mma_async", ptx):
        return "wgmma"
    if re.search(r"\bmma\.sync", ptx):
        return "mma"
    return "NO"


def compile_one(module: str, fn_name: str, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                arch: int, divisible_by_16: tuple = ()) -> dict:
    """Compile one kernel for one arch; returns the measured resources (runs in a worker).

    ``divisible_by_16`` (AotSpec field) names the arguments a real launch specialises as multiples
    of 16; without that attribute Triton cannot vectorise the loads and the build is not the one a GPU runs."""
    from vit_fast._compat import aot_compile

    try:
        fn = getattr(importlib.import_module(module), fn_name)
        names = list(fn.arg_names)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible_by_16}
        k = aot_compile(fn, signature, constexprs, attrs, arch, num_warps, num_stages)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            res = subprocess.run([_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                                 check=True)
        usage = parse_resource_usage(res.stdout)
        return dict(regs=usage["REG"], spill_bytes=usage["STACK"] + usage["LOCAL"],
                    shared_bytes=int(k.metadata.shared) + usage["SHARED"],
                    tensor_cores=tensor_core_use(k.asm["ptx"], arch), error="",
                    sass=instruction_cost(k.asm["cubin"], arch, num_warps))
    except Exception as e:  # a compile error is a finding of the report, not a crash of it
        return dict(error=compile_error_message(e))


def compile_error_message(e: BaseException) -> str:
    """'<location>: <innermost cause>' of a Triton CompilationError chain (its text repeats the source)."""
    chain = [e]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    where = str(e).splitlines()[0].strip() if str(e) else ""
    inner = chain[-1]
    msg = " ".join(str(inner).split()) or type(inner).__name__
    if where.startswith("at "):
        return f"{type(inner).__name__} ({where}) {msg}"[:300]
    return f"{type(inner).__name__}: {msg}"[:300]


def instruction_cost(cubin: bytes, arch: int, num_warps: int) -> dict | None:
    """The SASS loop analysis of a compiled kernel (vit_fast.tools.sass), or None where it cannot be read."""
    from vit_fast.tools import sass

    try:
        return sass.analyze_cubin(cubin, arch, num_warps).to_dict()
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        return dict(error=f"{type(e).__name__}: {e}"[:200])


def _sass_cost(row: Row):
    from vit_fast.tools import sass

    return sass.SassCost.from_dict(row.sass) if row.sass and "error" not in row.sass else sass.SassCost(row.arch, 0)


def _load_cached(path: str) -> dict | None:
    """A cached compile result, or None when absent or written before the SASS analysis existed."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        result = json.load(f)
    return result if "sass" in result or result.get("error") else None


CEILING_BAR = 0.60  # issue 19: every shipped tensor-core config (no dropout) reaches at least this ceiling


def format_ceiling(row: Row) -> str:
    if not row.sass:
        return "-"
    if row.not_modelled:
        return f"n/a ({row.not_modelled.split(':')[0]})"   # the reason in full: summarize_ceilings
    if "error" in row.sass:
        return "?"
    worst = _sass_cost(row).worst
    return "no loop" if worst is None else f"{worst.ceiling:.0%} {worst.bound_by}"


def summarize_ceilings(rows: list[Row], bar: float = CEILING_BAR) -> str:
    """Instruction cost: the worst ceiling per kernel and arch, the configs below `bar`, and the worst of all."""
    measured = [r for r in rows if r.ceiling is not None]
    not_modelled: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.sass and r.not_modelled:
            not_modelled.setdefault((r.kernel, r.arch), []).append(r)
    unread = [f"  {kernel:28s} sm_{arch}: n/a, {len(rs)} configs not modelled ({rs[0].not_modelled})"
              for (kernel, arch), rs in sorted(not_modelled.items())]
    if not measured:
        return "\n".join(["instruction cost: no tensor-core loop analysed", *unread])
    out = ["instruction cost (SASS main loop; "
           "ceiling = MMA / max(MMA, issue, MUFU) cycles per iteration, an upper bound):"]
    groups: dict[tuple, list[Row]] = {}
    for r in measured:
        groups.setdefault((r.kernel, r.arch), []).append(r)
    for (kernel, arch), rs in sorted(groups.items()):
        w = min(rs, key=lambda r: r.ceiling)
        out.append(f"  {kernel:28s} sm_{arch}: worst {w.ceiling:4.0%} [{w.config}] {_sass_cost(w).worst.describe()}")
    out += unread
    low = sorted((r for r in measured if r.ceiling < bar), key=lambda r: r.ceiling)
    out.append(f"{len(measured)} tensor-core configs analysed, {len(low)} below a {bar:.0%} ceiling")
    worst = min(measured, key=lambda r: r.ceiling)
    out.append(f"worst: {worst.kernel} [{worst.config}] sm_{worst.arch} {worst.dtype}: {worst.ceiling:.0%} "
               f"({_sass_cost(worst).worst.bound_by}-bound)")
    return "\n".join(out)


def occupancy(regs: int, shared: int, num_warps: int, arch: int) -> tuple[int, float]:
    """Resident warps per SM and their fraction of the maximum, from registers, shared memory and threads."""
    lim = ARCH_LIMITS[arch]
    regs_per_warp = -(-max(regs, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    blocks = min(
        lim["max_blocks"],
        lim["max_warps"] // num_warps,
        (lim["regs_per_sm"] // regs_per_warp) // num_warps,
        lim["smem_per_sm"] // (shared + SMEM_RESERVED_PER_BLOCK),
    )
    warps = blocks * num_warps
    return warps, warps / lim["max_warps"]


def cache_dir() -> str:
    return os.environ.get("VIT_FAST_AOT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "vit_fast", "aot"))


def run_report(presets, dtypes=tuple(DTYPES), archs=ARCHS, workers: int = 2, use_cache: bool = True, progress=None,
               pure: bool = True, tensor_core_only: bool = False) -> list[Row]:
    entries = collect_specs(presets, dtypes, archs, pure)
    if tensor_core_only:  # the configs the instruction-cost analysis covers
        entries = {key: entry for key, entry in entries.items() if entry[0].has_dot}
    return compile_entries(entries, workers, use_cache, progress)


def compile_entries(entries: dict, workers: int = 2, use_cache: bool = True, progress=None) -> list[Row]:
    """Rows of ``collect_specs``-shaped entries ({spec_key: (spec, arch, dtype name, [uses])}), from the cache or
    compiled in worker processes."""
    rows: dict[str, Row] = {}
    todo = []
    os.makedirs(cache_dir(), exist_ok=True)
    for key, (spec, arch, dtype_name, uses) in entries.items():
        row = Row(kernel=spec.name, config=config_string(spec), arch=arch, dtype=dtype_name, uses=uses,
                  threads=spec.num_warps * 32, note=spec.note, not_modelled=getattr(spec, "not_modelled", ""))
        rows[key] = row
        path = os.path.join(cache_dir(), key + ".json")
        cached = _load_cached(path) if use_cache else None
        if cached is not None:
            _fill(row, cached, spec, cached=True)
        else:
            fn = _python_fn(spec.fn)
            todo.append((key, (fn.__module__, fn.__name__, dict(spec.signature), dict(spec.constexprs), spec.num_warps,
                               spec.num_stages, arch, tuple(getattr(spec, "divisible_by_16", ())))))
    if todo:
        for key, result in _compile_all(todo, workers, progress):
            spec = entries[key][0]
            _fill(rows[key], result, spec, cached=False)
            if not result.get("error"):
                with open(os.path.join(cache_dir(), key + ".json"), "w") as f:
                    json.dump(result, f)
    return sorted(rows.values(), key=lambda r: (r.kernel, r.arch, r.dtype, r.config))


def _fill(row: Row, result: dict, spec, cached: bool) -> None:
    row.cached = cached
    row.error = result.get("error", "")
    if row.error:
        return
    row.regs, row.spill_bytes, row.shared_bytes = result["regs"], result["spill_bytes"], result["shared_bytes"]
    row.tensor_cores = result["tensor_cores"] if spec.has_dot else "-"
    row.warps_per_sm, row.occupancy = occupancy(row.regs, row.shared_bytes, spec.num_warps, row.arch)
    row.sass = result.get("sass") if spec.has_dot else None


def _compile_all(todo, workers: int, progress):
    """Compile in `workers` fresh Python processes without the interpreter (TRITON_INTERPRET=0).

    Plain subprocesses rather than multiprocessing: nothing depends on how the caller's main module
    was started, and the workers never inherit the interpreter's patched triton.
    """
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    n = max(1, min(workers, len(todo)))
    chunks = [todo[i::n] for i in range(n)]
    results: queue.Queue = queue.Queue()

    def drive(chunk):
        proc = subprocess.Popen([sys.executable, "-c", "from vit_fast.tools.report import _worker; _worker()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        proc.stdin.write(pickle.dumps([args for _, args in chunk]))
        proc.stdin.close()
        done = 0
        for line in proc.stdout:
            results.put((chunk[done][0], json.loads(line)))
            done += 1
        proc.wait()
        for key, _ in chunk[done:]:  # a crashed worker: report its remaining entries as errors
            results.put((key, dict(error=f"compile worker exited with code {proc.returncode}")))

    threads = [threading.Thread(target=drive, args=(c,), daemon=True) for c in chunks]
    for t in threads:
        t.start()
    for i in range(1, len(todo) + 1):
        item = results.get()
        if progress:
            progress(i, len(todo))
        yield item
    for t in threads:
        t.join()


def _worker() -> None:
    """Entry point of a compile process: pickled jobs on stdin, one JSON result per line on stdout."""
    jobs = pickle.loads(sys.stdin.buffer.read())
    for args in jobs:
        print(json.dumps(compile_one(*args)), flush=True)


# ----------------------------------------------------------------------------------------------
# Output


COLUMNS = ("kernel", "config", "arch", "dtype", "regs", "spill", "shared", "threads", "warps/SM", "occ", "tensor cores",
           "ceiling", "status")


def format_table(rows: list[Row]) -> str:
    lines = [COLUMNS]
    for r in rows:
        status = "; ".join(r.problems()) or "ok"
        lines.append((r.kernel, r.config, f"sm_{r.arch}", r.dtype, str(r.regs), str(r.spill_bytes),
                      f"{r.shared_bytes / 1024:.1f}K", str(r.threads), str(r.warps_per_sm), f"{r.occupancy:.0%}",
                      r.tensor_cores, format_ceiling(r), status))
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def summarize(rows: list[Row]) -> str:
    """Worst registers, spills and shared memory per kernel and arch, plus the failures."""
    out = []
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.arch), []).append(r)
    for (kernel, arch), rs in sorted(groups.items()):
        ok = [r for r in rs if not r.error]
        if not ok:
            out.append(f"{kernel:28s} sm_{arch}: all {len(rs)} configs failed to compile")
            continue
        out.append(f"{kernel:28s} sm_{arch}: {len(rs):3d} configs, max regs {max(r.regs for r in ok):3d}, "
                   f"max spill {max(r.spill_bytes for r in ok)} B, "
                   f"max shared {max(r.shared_bytes for r in ok) / 1024:.1f} KB, "
                   f"min occupancy {min(r.occupancy for r in ok):.0%}")
    bad = [r for r in rows if r.problems()]
    out.append(f"{len(rows)} compiled configs, {len(bad)} with problems" + (":" if bad else ""))
    out += [f"  {r.kernel} [{r.config}] sm_{r.arch} {r.dtype}: {'; '.join(r.problems())}" for r in bad]
    return "\n".join(out)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vit-fast report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"one preset ({QUICK_PRESETS[0]}), one dtype ({QUICK_DTYPES[0]}) under autocast (no pure "
                             "16-bit model), both archs: about 7%% of the full report's compiles; --presets / --dtypes "
                             "still override")
    parser.add_argument("--presets", nargs="+", type=preset_name,
                        help=f"model presets to cover (default: {' '.join(REPORT_PRESETS)})")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="dtypes to cover (default: all)")
    parser.add_argument("--archs", nargs="+", type=int, default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--workers", type=int, default=2, help="compile processes (default 2)")
    parser.add_argument("--no-cache", action="store_true", help="recompile everything, ignoring the on-disk cache")
    parser.add_argument("--full", action="store_true",
                        help="print every compiled kernel's row (default: the summaries and any row with a problem)")
    parser.add_argument("--json", help="write the rows as JSON to this path")
    parser.add_argument("--csv", help="write the rows as CSV to this path")
    return parser


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args(argv)
    args.presets = args.presets or list(QUICK_PRESETS if args.quick else REPORT_PRESETS)
    args.dtypes = args.dtypes or list(QUICK_DTYPES if args.quick else DTYPES)
    if not kernel_modules():
        print("vit-fast report: no kernel module in vit_fast.kernels exposes aot_specs yet; nothing to compile")
        return 0
    t0 = time.perf_counter()
    progress = ((lambda i, n: print(f"\rcompiling {i}/{n}", end="", file=sys.stderr, flush=True))
                if sys.stderr.isatty() else None)
    rows = run_report(args.presets, args.dtypes, args.archs, workers=args.workers, use_cache=not args.no_cache,
                      progress=progress, pure=not args.quick)
    if progress:
        print(file=sys.stderr)
    shown = rows if args.full else [r for r in rows if r.problems()]
    if shown:
        print(format_table(shown))
        print()
    print(summarize(rows))
    print(summarize_ceilings(rows))
    cached = sum(r.cached for r in rows)
    print(f"presets {', '.join(args.presets)}; dtypes {', '.join(args.dtypes)}"
          f"{' (autocast only, --quick)' if args.quick else ''}; "
          f"{len(rows) - cached} compiled, {cached} from cache ({cache_dir()}) in {time.perf_counter() - t0:.1f} s"
          f"{'' if args.full else f'; {len(rows)} kernel rows, --full prints them all'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
            w.writeheader()
            w.writerows(asdict(r) for r in rows)
    return 1 if any(r.problems() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
