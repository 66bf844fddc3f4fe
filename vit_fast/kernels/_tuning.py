"""Measured kernel configs: time a small candidate list once per (op, shape bucket, dtype, arch), keep the
fastest, remember it on disk.

A launcher calls ``choose(op, key, candidates, launch)`` where ``candidates[0]`` is the static table's
config and ``launch(cfg)`` runs the kernel with that config (idempotent: it writes outputs it allocated
or was given, never accumulates). ``choose`` returns the config to use:

  1. a choice already made in this process (or received from rank 0, see below);
  2. else, where timing is allowed, the cached choice for this key (``TuningCache``: a JSON file per
     environment, keyed by GPU name, compute capability, driver, torch, triton and vit_fast versions;
     each entry also records the kernel's source hash, and a changed source is a miss);
  3. else, where timing is allowed, every candidate timed with ``timer(fn, label) -> milliseconds``
     (the real timer is ``triton.testing.do_bench``, median) and the fastest kept, cached and logged;
  4. else the static first candidate.

Timing is allowed only on a CUDA device (never on CPU or in the Triton interpreter), never while
torch.compile traces (``torch.compiler.is_compiling()``) or a CUDA graph is captured
(``torch.cuda.is_current_stream_capturing()``), and not when the switch is off: ``VIT_FAST_AUTOTUNE=0``
or ``set_autotune(False)`` (``vit_fast.optimize(..., tune=False)``) keeps the static tables, so runs are
bitwise reproducible across machines. A cached choice is still used during tracing and capture when
autotuning is on. Under torch.distributed with more than one process nothing is timed or read lazily
(ranks could disagree and a collective inside a launcher could hang): ``vit_fast.tuning.tune_model``
times on rank 0 and broadcasts its choices to every rank, which then all use them; without it every
rank uses the static tables. Whatever is chosen, a given config is bitwise deterministic run to run.

Nothing here touches a device at import time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import operator
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, TypeVar, Union

import torch

from ._utils import env_switch, interpreter_active

C = TypeVar("C")
Timer = Callable[[Callable[[], Any], str], float]  # (fn, label) -> milliseconds

ENV_SWITCH = "VIT_FAST_AUTOTUNE"
ENV_CACHE_DIR = "VIT_FAST_CACHE_DIR"
CACHE_FORMAT = 1


def do_bench_timer(fn: Callable[[], Any], label: str = "") -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (triton.testing.do_bench: warm-up,
    L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


# ----------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class _State:
    enabled: Optional[bool] = None  # None: follow VIT_FAST_AUTOTUNE
    timer: Timer = do_bench_timer
    device_types: tuple[str, ...] = ("cuda",)  # where timing is allowed (tests add "cpu")
    cache_dir: Optional[str] = None  # None: $VIT_FAST_CACHE_DIR or ~/.cache/vit_fast
    local_in_distributed: bool = False  # True while rank 0 times for everyone (tune_model)
    refresh: bool = False  # measure again, ignoring cached entries (`vit-fast tune`)
    decisions: dict = dataclasses.field(default_factory=dict)  # entry key -> chosen candidate (repr)
    fast: dict = dataclasses.field(default_factory=dict)  # (op, key) -> index of the decided candidate
    log: list = dataclasses.field(default_factory=list)  # TuneRecord per timed choice, this process


@dataclasses.dataclass(frozen=True)
class TuneRecord:
    """One measured choice: candidates (their reprs) with their times, and the winner's index."""

    op: str
    key: str
    candidates: tuple[str, ...]
    times_ms: tuple[float, ...]
    choice: int

    @property
    def speedup(self) -> float:
        """Static (first) candidate's time over the chosen one's."""
        best = self.times_ms[self.choice]
        return self.times_ms[0] / best if best > 0 else float("nan")


_state = _State()
_lock = threading.Lock()
# Bumped whenever decisions this process made may be forgotten or replaced in place (``LaunchPlan.choose``'s
# memo holds a choice for one state object and version); a replaced ``_state`` (``overridden``, ``refreshing``)
# is a new object.
_version = 0


def _bump() -> None:
    global _version
    _version += 1


def autotune_enabled() -> bool:
    """The switch: ``set_autotune`` if called, else ``VIT_FAST_AUTOTUNE`` (on unless '0', 'false', 'off', 'no')."""
    if _state.enabled is not None:
        return _state.enabled
    return env_switch(ENV_SWITCH)


def set_autotune(enabled: Optional[bool]) -> None:
    """Turn measured configs on or off for this process (None: follow VIT_FAST_AUTOTUNE again). Turning
    it off also forgets the choices made so far, so every launch uses the static tables."""
    _state.enabled = enabled
    _bump()
    if enabled is False:
        _state.decisions.clear()
        _state.fast.clear()


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once: reading it means setting it, which other threads would see


def distributed_world() -> int:
    """The job's world size: the process group's, else a launcher's WORLD_SIZE (torchrun sets it before the script
    runs: a rank that runs or tunes before init_process_group must not decide alone either)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def can_time(device: torch.device) -> bool:
    """Whether a launch on ``device`` may time candidates now (see the module docstring)."""
    if not autotune_enabled() or device.type not in _state.device_types:
        return False
    if device.type == "cuda" and interpreter_active():
        return False
    if torch.compiler.is_compiling() or (device.type == "cuda" and _capturing()):
        return False
    return distributed_world() == 1 or _state.local_in_distributed


def may_use_cache() -> bool:
    """Cached choices apply when autotuning is on and this process decides alone (during tracing and
    capture too: reading a file launches nothing)."""
    return autotune_enabled() and (distributed_world() == 1 or _state.local_in_distributed)


# ---------------------------------------------------------------------------------- identities
def _driver_version() -> str:
    try:  # the CUDA driver API's own answer
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except (OSError, AttributeError):
        pass
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("\n")[0].strip()
    except OSError:
        return "unknown"


def environment(device: Optional[torch.device] = None) -> dict[str, str]:
    """What a cached choice is only valid for: the GPU, its driver and the software versions."""
    import triton

    import vit_fast

    if device is not None and device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        cap = "%d.%d" % torch.cuda.get_device_capability(device)
        driver = _driver_version()
    else:
        gpu, cap, driver = (device.type if device is not None else "none"), "", ""
    return {"gpu": gpu, "capability": cap, "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "vit_fast": getattr(vit_fast, "__version__", "unknown")}


_source_hashes: dict[str, str] = {}


def _kernel_modules(module_name: str) -> list[str]:
    """``module_name`` and every vit_fast.kernels module it reaches through its globals (the jit helpers
    a kernel inlines live there), transitively."""
    seen, todo = [], [module_name]
    while todo:
        name = todo.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.append(name)
        for value in vars(sys.modules[name]).values():
            owner = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            fn = getattr(value, "fn", None)  # a triton JITFunction wraps the python function
            owner = getattr(fn, "__module__", owner) if fn is not None and owner is None else owner
            if isinstance(owner, str) and owner.startswith("vit_fast.kernels") and owner not in seen:
                todo.append(owner)
    return sorted(seen)


def source_hash(module_name: str) -> str:
    """sha256 (16 hex digits) over the source files of ``module_name`` and the kernel modules it uses."""
    if module_name not in _source_hashes:
        h = hashlib.sha256()
        for name in _kernel_modules(module_name):
            path = getattr(sys.modules[name], "__file__", None)
            h.update(name.encode())
            if path:
                h.update(Path(path).read_bytes())
        _source_hashes[module_name] = h.hexdigest()[:16]
    return _source_hashes[module_name]


def entry_key(op: str, key: Any) -> str:
    return f"{op}|{key!r}" if not isinstance(key, str) else f"{op}|{key}"


# ---------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    if _state.cache_dir is not None:
        return Path(_state.cache_dir)
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vit_fast"


_warned: set[str] = set()


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"vit_fast autotune cache {path} {why}; it is ignored (choices are measured again "
                      f"and the file is rewritten)", RuntimeWarning, stacklevel=3)


class TuningCache:
    """One JSON file per environment: {"format", "env", "entries": {entry key: {"source", "choice", ...}}}.

    Reads take no lock (writes replace the file atomically, so a reader sees the old or the new file,
    never half of one). Writes merge under an exclusive ``flock`` on a side lock file: the file is read
    again under the lock, the new entries merged in, written to a temporary file in the same folder and
    ``os.replace``d over it, so concurrent writers from several processes lose nothing. A file that does
    not parse, or holds another environment (stale), is ignored with one warning per process.
    """

    def __init__(self, env: dict[str, str], folder: Optional[Path] = None):
        self.env = dict(env)
        digest = hashlib.sha256(json.dumps(self.env, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(folder if folder is not None else cache_dir()) / f"autotune-{digest}.json"

    def _read(self, warn: bool = True) -> dict[str, dict]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            if warn:
                _warn_once(self.path, f"cannot be read ({e})")
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ValueError(f"format {data.get('format') if isinstance(data, dict) else None!r}, "
                                 f"expected {CACHE_FORMAT}")
            if data.get("env") != self.env:
                if warn:
                    _warn_once(self.path, f"was written for another environment ({data.get('env')}, this one "
                                          f"is {self.env})")
                return {}
            entries = data["entries"]
            if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
                raise ValueError("entries is not a mapping of objects")
            return entries
        except (ValueError, KeyError, TypeError) as e:
            if warn:
                _warn_once(self.path, f"is corrupt ({e})")
            return {}

    def get(self, key: str, source: str) -> Optional[dict]:
        """The entry for ``key`` if it was measured with this kernel source, else None."""
        entry = self._read().get(key)
        return entry if entry is not None and entry.get("source") == source else None

    def entries(self) -> dict[str, dict]:
        return self._read()

    def put(self, new: dict[str, dict]) -> None:
        """Merge ``new`` entries into the file (see the class docstring). An unwritable folder warns."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                entries = self._read(warn=False)
                entries.update(new)
                data = {"format": CACHE_FORMAT, "env": self.env, "entries": entries}
                fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
                try:
                    os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would create it (mkstemp's is 0600)
                    with os.fdopen(fd, "w") as f:
                        json.dump(data, f, indent=1, sort_keys=True)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except OSError as e:
            _warn_once(self.path, f"cannot be written ({e})")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): the atomic replace alone keeps the file whole
            yield
            return
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


_caches: dict[tuple, TuningCache] = {}


def cache_for(device: torch.device) -> TuningCache:
    env = environment(device)
    folder = cache_dir()
    ident = (str(folder), json.dumps(env, sort_keys=True))
    if ident not in _caches:
        _caches[ident] = TuningCache(env, folder)
    return _caches[ident]


# ------------------------------------------------------------------------------- compile ahead
ENV_PARALLEL_COMPILE = "VIT_FAST_PARALLEL_COMPILE"


class _Warming(threading.local):
    on = False  # set by ``_compile_ahead`` for this thread while it compiles a candidate list


_warming = _Warming()


def launcher(kernel, grid):
    """``kernel[grid]``, the call that launches a jit kernel; while ``choose`` compiles its candidates ahead of
    timing them, ``kernel.warmup`` on that grid: Triton compiles and launches nothing."""
    return functools.partial(kernel.warmup, grid=grid) if _warming.on else kernel[grid]


ENV_DIRECT_LAUNCH = "VIT_FAST_DIRECT_LAUNCH"


def _picker(positions: tuple) -> Callable[[tuple], tuple]:
    """args -> the tuple of args at ``positions`` (operator.itemgetter returns a bare value for one position)."""
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions) if positions else (lambda args: ())


def _tensor_key(tensors: tuple) -> tuple:
    """What Triton specializes a tensor argument on: its dtype and whether its address is 16-byte aligned."""
    return tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


class _Direct(NamedTuple):
    """What a ``KernelLaunch`` needs to call its compiled kernel, and the specialization it was compiled for."""

    runner: Callable[..., Any]  # the compiled kernel's runner on the launch's grid
    tail: tuple  # the constexprs after the call's arguments, in the kernel's order
    device: int  # current at the first call
    driver: Any
    tensors: Callable[[tuple], tuple]  # pickers of the call's tensor, fixed and float arguments
    tensor_key: tuple
    fixed: Callable[[tuple], tuple]
    fixed_values: tuple
    fixed_types: tuple
    floats: Callable[[tuple], tuple]


class KernelLaunch:
    """``kernel[grid](*args, **constexprs)`` for one bound launch of a ``LaunchPlan`` (grid and constexprs fixed).
    The first call goes through Triton's JIT (argument binding, specialization, cache lookup: 21.6 us of host time
    per launch against 9.1 for the compiled kernel called directly, H200 host, torch 2.11 + triton 3.6,
    2026-11-27). Later calls that Triton would specialize alike (every tensor's dtype and 16-byte alignment, the
    None / int / bool arguments' types and values, and any argument of a constexpr parameter, floats of the others
    still floats), on the device current at the first, call the compiled kernel's runner with the arguments the JIT
    hands it: the call's, then the constexprs in the kernel's order. Otherwise, under the interpreter, for a
    wrapped kernel (autotuner, heuristics), a callable grid or pre-run hooks, while ``choose`` or the caller's
    AsyncCompileMode compiles ahead, or with VIT_FAST_DIRECT_LAUNCH=0 (read when a launch would first go direct):
    the JIT, as ``launcher``. The kernel is the one given when the plan was bound; what the JIT reads per call and
    this does not: Triton's debug and instrumentation knobs, pre-run hooks added later."""

    __slots__ = ("kernel", "grid", "constexprs", "direct")

    def __init__(self, kernel: Any, grid: tuple, **constexprs: Any):
        self.kernel, self.grid, self.constexprs = kernel, grid, constexprs
        self.direct: Union[_Direct, None, bool] = None  # None: not armed yet; False: the JIT for good

    def __call__(self, *args: Any) -> None:
        if _warming.on:
            self.kernel.warmup(*args, grid=self.grid, **self.constexprs)
            return
        direct = self.direct
        if direct:
            try:
                values = direct.fixed(args)
                same = (values == direct.fixed_values and tuple(map(type, values)) == direct.fixed_types
                        and all(type(x) is float for x in direct.floats(args))
                        and _tensor_key(direct.tensors(args)) == direct.tensor_key
                        and direct.driver.get_current_device() == direct.device)
            except (AttributeError, RuntimeError, TypeError):  # a None where a tensor was, a tensor compared as int
                same = False
            if same:
                direct.runner(*args, *direct.tail, stream=direct.driver.get_current_stream(direct.device))
                return
        compiled = self.kernel[self.grid](*args, **self.constexprs)
        if direct is None:
            self.direct = self._direct(compiled, args)

    def _direct(self, compiled: Any, args: tuple) -> Union[_Direct, None, bool]:
        """What the direct call needs; False where the JIT must run every call for good (a kernel that is not a
        JITFunction: interpreted or wrapped; a callable grid: asked once, not per launch), None where this call cannot
        arm it (asked again)."""
        from triton.compiler import CompiledKernel
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        if not isinstance(self.kernel, JITFunction) or callable(self.grid) or not all(
                isinstance(g, int) for g in self.grid):
            return False
        if (type(compiled) is not CompiledKernel or interpreter_active()
                or getattr(self.kernel, "pre_run_hooks", None) or not env_switch(ENV_DIRECT_LAUNCH)):
            return None
        tail = []
        for param in self.kernel.params[len(args):]:
            if param.name in self.constexprs:
                tail.append(self.constexprs[param.name])
            elif param.has_default:
                tail.append(param.default)
            else:
                return None
        constexpr = [param.is_constexpr for param in self.kernel.params[:len(args)]]
        kinds = [None if is_constexpr else torch.Tensor if isinstance(a, torch.Tensor) else float if type(a) is float
                 else None for a, is_constexpr in zip(args, constexpr)]
        if any(kind is None and not (a is None or type(a) in (int, bool, float)) for kind, a in zip(kinds, args)):
            return None  # an argument kind this check does not know: the JIT decides every call
        tensors = _picker(tuple(i for i, kind in enumerate(kinds) if kind is torch.Tensor))
        fixed = _picker(tuple(i for i, kind in enumerate(kinds) if kind is None))
        floats = _picker(tuple(i for i, kind in enumerate(kinds) if kind is float))
        values = fixed(args)
        return _Direct(compiled[tuple(self.grid) + (1,) * (3 - len(self.grid))], tuple(tail),
                       driver.active.get_current_device(), driver.active, tensors, _tensor_key(tensors(args)), fixed,
                       values, tuple(map(type, values)), floats)


def _compile_ahead(candidates: Sequence[Any], launch: Callable[[Any], Any], device: torch.device) -> None:
    """Compile every candidate's kernels at once before they are timed one by one: each ``launch`` runs with its
    Triton launches as warmups (``launcher``) under Triton's AsyncCompileMode, whose thread pool compiles them in
    parallel (Triton's JIT behind a fake sm_90 driver on this project's 2-core CPU machine: linear_act's four
    forward candidates in 2.7-3.8 s against 5.4 s one after another, triton 3.6 and 3.8). CUDA only; off with
    VIT_FAST_PARALLEL_COMPILE=0. Whatever fails here (a compile error, a Triton without AsyncCompileMode) is left
    for the timing loop, which meets it again."""
    if device.type != "cuda" or interpreter_active() or len(candidates) < 2:
        return
    if not env_switch(ENV_PARALLEL_COMPILE):
        return
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None:
        return
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(min(len(candidates), os.cpu_count() or 1)) as pool, mode(pool, ignore_errors=True):
            _warming.on = True
            try:
                for c in candidates:
                    try:
                        launch(c)
                    except Exception:  # noqa: BLE001  (timed as it fails, in the loop after this)
                        pass
            finally:
                _warming.on = False
    except Exception as e:  # noqa: BLE001  (compiling ahead only saves time; the timing loop compiles anyway)
        warnings.warn(f"vit_fast: compiling the autotuning candidates in parallel failed ({type(e).__name__}: {e}); "
                      "they compile one by one", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------- launch plans
class LaunchPlans:
    """One op's launch plans: what a launcher derives from its inputs' layout alone (the tuning key, the candidate
    tiles, flags, row counts, strides), built once per layout (shapes, strides, dtypes, flags, device: the caller's
    ``key``) instead of on every call. Bounded: layouts that keep changing are planned again rather than kept."""

    MAX_ENTRIES = 4096

    def __init__(self, build: Callable[..., Any]):
        self.build = build
        self.plans: dict = {}

    def get(self, key: Any, *args: Any) -> Any:
        """The plan for ``key``, built by ``build(*args)`` the first time."""
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= self.MAX_ENTRIES:
                self.plans.clear()
            plan = self.plans[key] = self.build(*args)
        return plan


class LaunchPlan:
    """One op's launch for one input layout (shapes, strides, dtypes, flags, device): its tuning key, its candidate
    configs, and per config a launch with its grid and constants built once (``bind``), so that a call does its
    allocations, reads the chosen config and launches. ``choose`` memoizes the choice once it is settled (decided,
    static with autotuning off, or the only candidate) for the tuning state it was made in."""

    __slots__ = ("op", "key", "candidates", "build", "bound", "memo", "last")

    def __init__(self, op: str, key: Any, candidates: Sequence[Any], build: Callable[[Any], Callable[..., Any]]):
        self.op, self.key, self.candidates, self.build = op, key, tuple(candidates), build
        self.bound: dict = {}
        self.memo: tuple = (None, -1, None, None, None)  # (state, version, autotune on, choose, config)
        self.last: tuple = (None, None)  # (config, its launch): the one bound last, found by identity

    def bind(self, cfg: Any) -> Callable[..., Any]:
        """The launch on ``cfg``, built once (its ``KernelLaunch`` launches the kernel the module held when it was
        bound; a warmup while ``choose`` compiles candidates ahead). The config of the previous call is found by
        identity (a config's hash is a Python call)."""
        last_cfg, launch = self.last
        if cfg is last_cfg:
            return launch
        launch = self.bound.get(cfg)
        if launch is None:
            launch = self.bound[cfg] = self.build(cfg)
        self.last = (cfg, launch)
        return launch

    def choose(self, device: torch.device, launch: Callable[[Any], Any]) -> Any:
        """``choose(op, key, candidates, launch, device)``, memoized once settled (per ``choose`` function too: a
        test that replaces it to force a config is asked)."""
        enabled = autotune_enabled()
        state, version, was_enabled, chooser, cfg = self.memo
        if state is _state and version == _version and was_enabled == enabled and chooser is choose:
            return cfg
        cfg = choose(self.op, self.key, self.candidates, launch, device)
        if (len(self.candidates) == 1 or not enabled or (self.op, self.key, device.type) in _state.fast
                or _settled_in_distributed(self.op, self.key, device)):
            self.memo = (_state, _version, enabled, choose, cfg)
        return cfg


def _settled_in_distributed(op: str, key: Any, device: torch.device) -> bool:
    """Under torch.distributed a rank never times alone: what it launches is rank 0's broadcast choice or the static
    config, and a broadcast (``install_decisions``) bumps the version, which makes every plan ask again."""
    return device.type in _state.device_types and not _state.local_in_distributed and distributed_world() > 1


# ---------------------------------------------------------------------------------------- choose
def describe(candidate: Any) -> str:
    """A stable text for a config (dataclass repr / tuple repr) that identifies it in the cache."""
    return repr(candidate)


def _failed(e: BaseException) -> bool:
    """A candidate that cannot run on this GPU (too much shared memory, a compile error: Triton's front end, ptxas,
    or an MLIR pass, or, for one that allocates a workspace, no device memory left for it) is skipped."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors

    build_errors = tuple(getattr(errors, name) for name in ("OutOfResources", "PTXASError") if hasattr(errors, name))
    if isinstance(e, (CompilationError, torch.cuda.OutOfMemoryError, *build_errors)):
        return True
    return isinstance(e, RuntimeError) and "PassManager::run failed" in str(e)  # an MLIR lowering failure


def choose(op: str, key: Any, candidates: Sequence[C], launch: Callable[[C], Any],
           device: torch.device, module: Optional[str] = None) -> C:
    """The config to launch ``op`` with for this ``key`` (shape bucket, dtype, arch: a hashable value
    that determines the candidate list); see the module docstring for the order of sources. ``module``:
    whose source hash guards the cached entry (default: the module that defines ``launch``). A candidate
    that fails to compile or exceeds the GPU's resources is timed as infinitely slow."""
    if not candidates:
        raise ValueError(f"choose({op!r}): expected at least one candidate config")
    if len(candidates) == 1 or not autotune_enabled():
        return candidates[0]
    index = _state.fast.get((op, key, device.type))  # the hot path: decided before, in this process
    if index is not None and index < len(candidates):
        return candidates[index]
    if _warming.on:  # launched inside another op's compile-ahead: its static config compiles, nothing is timed
        return candidates[0]
    ekey = entry_key(op, key)
    names = [describe(c) for c in candidates]
    with _lock:
        decided = _state.decisions.get(ekey)
    if decided in names:
        _state.fast[(op, key, device.type)] = names.index(decided)
        return candidates[names.index(decided)]
    if device.type not in _state.device_types:
        _state.fast[(op, key, device.type)] = 0  # nothing is ever measured on this device: the static config, at once
        return candidates[0]
    if not may_use_cache():
        return candidates[0]
    source = source_hash(module or launch.__module__)
    cache = cache_for(device)
    entry = None if _state.refresh else cache.get(ekey, source)
    if entry is not None and entry.get("choice") in names:
        with _lock:
            _state.decisions[ekey] = entry["choice"]
            _state.fast[(op, key, device.type)] = names.index(entry["choice"])
        return candidates[names.index(entry["choice"])]
    if not can_time(device):
        return candidates[0]
    _compile_ahead(candidates, launch, device)
    times, out_of_memory = [], False
    for c, name in zip(candidates, names):
        try:
            times.append(float(_state.timer(lambda c=c: launch(c), f"{op}:{name}")))
        except Exception as e:  # noqa: BLE001  (re-raised unless the candidate just cannot run here)
            if not _failed(e):
                raise
            out_of_memory |= isinstance(e, torch.cuda.OutOfMemoryError)
            times.append(float("inf"))
    best = min(range(len(times)), key=lambda i: (times[i], i))  # ties: the earlier (static first)
    record = TuneRecord(op, ekey, tuple(names), tuple(times), best)
    with _lock:
        _state.decisions[ekey] = names[best]
        _state.fast[(op, key, device.type)] = best
        _state.log.append(record)
    if not out_of_memory:  # memory is the moment's (the step's peak, the timer's flush buffer): not kept on disk
        cache.put({ekey: {"source": source, "choice": names[best], "candidates": names,
                          "times_ms": [t if math.isfinite(t) else None for t in times]}})
    return candidates[best]


def decisions() -> dict[str, str]:
    """This process's choices (entry key -> candidate repr): what rank 0 broadcasts."""
    with _lock:
        return dict(_state.decisions)


def cached_decisions(device: torch.device) -> dict[str, str]:
    """The disk cache's kernel choices made with the kernel sources loaded now (an entry's source hash is a loaded
    vit_fast.kernels module's): what rank 0 broadcasts beside this process's own, so a job whose parts' route comes
    from the cache (nothing timed, nothing launched yet) still runs the cached configs on every rank, as its first
    run did. Empty where the cache may not be used."""
    if not may_use_cache() or device.type not in _state.device_types:
        return {}
    sources = {source_hash(name) for name, module in list(sys.modules.items())
               if module is not None and name.startswith("vit_fast.kernels")}
    return {key: entry["choice"] for key, entry in cache_for(device).entries().items()
            if isinstance(entry, dict) and entry.get("source") in sources and isinstance(entry.get("choice"), str)}


def install_decisions(chosen: dict[str, str]) -> None:
    """Adopt choices made elsewhere (rank 0's, after a broadcast) in place of this process's own."""
    with _lock:
        _state.decisions.clear()
        _state.decisions.update(chosen)
        _state.fast.clear()
        _bump()


def records() -> list[TuneRecord]:
    """Every choice timed in this process so far, in order."""
    with _lock:
        return list(_state.log)


@contextlib.contextmanager
def refreshing() -> Iterator[None]:
    """Measure every key again (cached entries are not read, and are overwritten); the choices and
    records made inside are kept afterwards."""
    global _state
    saved = _state
    _state = dataclasses.replace(saved, refresh=True, decisions={}, fast={}, log=[])
    try:
        yield
    finally:
        inner, _state = _state, saved
        with _lock:
            saved.decisions.update(inner.decisions)
            saved.fast.clear()
            saved.log.extend(inner.log)
            _bump()


@contextlib.contextmanager
def overridden(timer: Optional[Timer] = None, device_types: Optional[tuple[str, ...]] = None,
               cache_dir: Optional[str | os.PathLike] = None, enabled: Optional[bool] = None,
               local_in_distributed: Optional[bool] = None, fresh: bool = True) -> Iterator[_State]:
    """Temporarily replace the timer, the device types where timing is allowed, the cache folder or the
    switch (tests inject a timer and allow 'cpu'; ``tune_model`` times rank 0 alone). ``fresh``: start
    with no in-process choices or log, and restore the previous ones afterwards."""
    global _state
    saved = _state
    _state = dataclasses.replace(
        saved, decisions={} if fresh else saved.decisions, log=[] if fresh else saved.log,
        fast={},  # a cache of the decisions and of the static fallbacks: rebuilt under the new settings
        **{k: v for k, v in dict(timer=timer, device_types=device_types, enabled=enabled,
                                 local_in_distributed=local_in_distributed).items() if v is not None},
        **({} if cache_dir is None else {"cache_dir": str(cache_dir)}))
    try:
        yield _state
    finally:
        _state = saved


# ------------------------------------------------------------------------------------ candidates
# Every variant of a static config below shrinks a tile, adds warps or (GEMM-like loops) adds one pipeline
# stage; a launch over the GPU's shared memory is skipped by choose(). Fewer live values per thread usually
# means no spills where the static config (checked by `vit-fast report`) has none, but ptxas does not
# promise it: an AOT spot check found the old fc2 GEMM's fwd with half the columns spilling 8 B on sm_80, so
# the GEMMs halve rows only. The candidate lists are not all in the report yet.
def _replace(cfg: Any, **changes: int) -> Any:
    if isinstance(cfg, dict):
        return {**cfg, **changes}
    return dataclasses.replace(cfg, **changes)


def _get(cfg: Any, name: str) -> int:
    return cfg[name] if isinstance(cfg, dict) else getattr(cfg, name)


def _memoized(build: Callable[..., list]) -> Callable[..., list]:
    """``build``'s list kept per (hashable) arguments: the launchers ask for their candidates on every call.
    Unhashable arguments (a dict config) build afresh."""
    memo: dict = {}

    def cached(*args, **kwargs) -> list:
        key = (args, tuple(sorted(kwargs.items())))
        try:
            found = memo.get(key)
        except TypeError:
            return build(*args, **kwargs)
        if found is None:
            found = memo[key] = tuple(build(*args, **kwargs))
        return list(found)

    cached.__doc__, cached.__name__, cached.__wrapped__ = build.__doc__, build.__name__, build
    return cached


class ProcessSwitch:
    """A process-wide switch, off until a ``with switch():`` block turns it on for that block: how a launcher is told
    to run one candidate whatever the autotuner would pick, so `vit-fast check` and the tests can compare that
    candidate with float64. Not per thread: autograd runs a CUDA backward on its own device thread, where a
    thread-local switch would read off and the backward would test another kernel."""

    def __init__(self):
        self._depth = 0
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1


def unique(items: list) -> list:
    out, seen = [], set()
    for item in items:
        if describe(item) not in seen:
            seen.add(describe(item))
            out.append(item)
    return out


@_memoized
def tile_candidates(static: Any, halve: Sequence[str] = ("block_m", "block_n"), warps: str = "num_warps",
                    stages: Optional[str] = None, min_block: int = 16, max_warps: int = 8) -> list:
    """``static`` first, then each ``halve`` field halved (kept >= ``min_block``: tl.dot's minimum), the
    warps doubled (<= ``max_warps``) and, with ``stages`` (the field name), one more pipeline stage.
    Works on frozen dataclasses and on dicts of launch parameters."""
    out = [static]
    for name in halve:
        if _get(static, name) // 2 >= min_block:
            out.append(_replace(static, **{name: _get(static, name) // 2}))
    if _get(static, warps) * 2 <= max_warps:
        out.append(_replace(static, **{warps: _get(static, warps) * 2}))
    if stages is not None:
        out.append(_replace(static, **{stages: _get(static, stages) + 1}))
    return unique(out)


@_memoized
def row_candidates(static: Any, grow: bool = True, max_warps: int = 16) -> list:
    """Tiles of a row-tile kernel (a ``RowTile``, vit_fast/kernels/_rows.py): the static tile, half the rows,
    twice the warps (both fewer elements per thread) and, with ``grow``, twice the rows with twice the warps
    (as many elements per thread as the static tile)."""
    block_m, block_n, warps = static.block_m, static.block_n, static.num_warps
    tile = type(static)
    out = [static]
    if block_m >= 2:
        out.append(tile(block_m // 2, block_n, warps))
    if warps * 2 <= max_warps:
        out.append(tile(block_m, block_n, warps * 2))
        if grow:
            out.append(tile(block_m * 2, block_n, warps * 2))
    return unique(out)


def bucket(n: int) -> int:
    """Shape bucket of a dimension that varies with the batch (rows, sequence length): the next power of two."""
    return 1 << max(0, int(n) - 1).bit_length()
