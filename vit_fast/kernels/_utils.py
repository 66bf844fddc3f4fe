"""Launcher helpers shared by every kernel family: the ``vit_fast::`` operators (``kernel_op``), whether the
Triton interpreter is on, input checks, device policy, dropout seeds, architecture lookup for the config tables
and how many programs fill a GPU. Nothing here touches a device at import time.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import Callable

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The values Triton's own getenv_bool (triton/_C, read by triton.knobs.runtime.interpret) takes as
# true, compared case-insensitively; anything else (unset, "", "0", "false", "2") is false.
_TRUE_VALUES = ("1", "true", "on", "yes", "y")


def interpreter_active() -> bool:
    """True when Triton runs kernels on CPU tensors with its interpreter. The one place the project
    reads TRITON_INTERPRET; parsed as Triton parses it (``1``, ``true``, ``on``, ``yes``, ``y``, any
    case), read at every call (tests and tools set it at run time). Importing this module imports
    triton, but Triton reads the variable at launch time, so setting it after the import still works."""
    return _env_meaning("TRITON_INTERPRET", _interpret_on, "")


_OFF_VALUES = ("0", "false", "off", "no")


def env_switch(name: str) -> bool:
    """A vit_fast on/off environment variable (VIT_FAST_AUTOTUNE, VIT_FAST_PARALLEL_COMPILE,
    VIT_FAST_BLOCK_FUNCTION, VIT_FAST_DIRECT_LAUNCH): on unless set to '0', 'false', 'off' or 'no' (any case,
    spaces ignored). Read at every call (tests and users set them at run time), so it is asked on every launch:
    where os.environ keeps its encoded copy (POSIX CPython) the raw value is read from it and its meaning kept per
    value. Inside ``direct_ops`` (one fused block's run of launches) each switch is read once."""
    if _direct.on:
        switches = _direct.switches
        on = switches.get(name)
        if on is None:
            on = switches[name] = _env_meaning(name, _switch_on, "1")
        return on
    return _env_meaning(name, _switch_on, "1")


def _switch_on(value: str) -> bool:
    return value.strip().lower() not in _OFF_VALUES


def _interpret_on(value: str) -> bool:
    return value.lower() in _TRUE_VALUES


def _env_meaning(name: str, parse, default: str) -> bool:
    """``parse(os.environ.get(name, default))``, read on every launch: the raw value last seen and its meaning are
    kept per (name, parse, default), and while os.environ holds that same value object (it stores a new one on every
    assignment) the meaning is returned without parsing. A traced call reads the variable itself: dynamo would guard
    on the cache, which eager calls update (a compiled model recompiled after an eager step)."""
    if _ENVIRON_DATA is None or torch.compiler.is_compiling():
        return parse(os.environ.get(name, default))
    last = _ENV_LAST.get((name, parse, default))  # [encoded name, raw value, meaning]
    if last is None:
        last = _ENV_LAST[(name, parse, default)] = [os.environ.encodekey(name), _UNREAD, None]
    raw = _ENVIRON_DATA.get(last[0])
    if raw is not last[1]:
        last[2] = parse(default if raw is None else os.environ.decodevalue(raw))
        last[1] = raw
    return last[2]


_ENVIRON_DATA = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_ENV_LAST: dict = {}  # (name, parse, default) -> [encoded name, raw value last read, its meaning]
_UNREAD = object()


# ------------------------------------------------------------------------------------------------ operators
class KernelOp:
    """A ``vit_fast::`` operator: a kernel launcher registered with the dispatcher (``torch.library.Library``:
    its schema inferred from ``function``'s annotations, ``function`` its one backend kernel, its fake kernel from
    ``register_fake``), what torch.compile's graphs, fake tensors, dispatch modes and profilers call. The autograd
    Functions own the gradients, so no autograd kernel is registered (``run_op`` refuses a dispatched call that
    would need one): a dispatched call then costs 2-3 us above ``function`` where a ``torch.library.custom_op``'s
    Python autograd and aliasing checks made it 6-9 us (CPU check, docs/internals.md). Plain tensors with nothing
    tracing skip the dispatcher (``run_op``)."""

    def __init__(self, qualname: str, function: Callable):
        namespace, self.name = qualname.split("::")
        self.qualname, self.function = qualname, function
        previous = _KERNEL_OPS.get(qualname)
        if previous is not None:  # its module imported again (importlib.reload, IPython's autoreload)
            previous._library._destroy()
        # one library fragment per operator: destroying it unregisters this operator alone
        library = self._library = torch.library.Library(namespace, "FRAGMENT")
        library.define(self.name + torch.library.infer_schema(function, mutates_args=()),
                       tags=(torch.Tag.pt2_compliant_tag,))
        library.impl(self.name, function, "CompositeExplicitAutograd")
        self.default = getattr(getattr(torch.ops, namespace), self.name).default  # the OpOverload (opcheck's)
        self.__doc__, self.__name__ = function.__doc__, function.__name__
        _KERNEL_OPS[qualname] = self

    def register_fake(self, fake: Callable) -> Callable:
        """The shapes and dtypes of ``function``'s outputs without running it (a decorator, as custom_op's)."""
        torch.library.register_fake(self.qualname, fake, lib=self._library)
        return fake

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def __repr__(self) -> str:
        return f"KernelOp({self.qualname})"


_KERNEL_OPS: dict = {}  # qualified name -> KernelOp


def kernel_op_of(func) -> "KernelOp | None":
    """The KernelOp behind a dispatcher operator (``torch.ops.vit_fast.name.default``, as a dispatch mode sees
    it); None for any other operator."""
    return _KERNEL_OPS.get(f"{getattr(func, 'namespace', '')}::{getattr(func, '_opname', '')}")


def kernel_op(qualname: str) -> Callable[[Callable], KernelOp]:
    """``@kernel_op("vit_fast::name")`` over a fully annotated launcher function defines the operator (tests define
    theirs in another namespace)."""
    return lambda function: KernelOp(qualname, function)


class _Direct(threading.local):
    on = False  # set by ``direct_ops`` for this thread
    switches: dict = {}  # ``env_switch`` meanings read inside it, one read per switch


_direct = _Direct()


class direct_ops:
    """``with direct_ops():`` the caller has checked that every tensor the ops inside will see is a plain CUDA
    tensor (or a CPU one under the interpreter): ``run_op`` calls the ops' Python functions without looking at
    the arguments again (a fused block runs its parts so), and each environment switch is read once for the run
    (``env_switch``: the autotuning switch, asked at every launch's config choice, among them). Tracing
    (torch.compile, compiled autograd, a dispatch mode) still gets the custom ops."""

    def __enter__(self):
        self.was = (_direct.on, _direct.switches)
        _direct.on, _direct.switches = True, {}

    def __exit__(self, *exc):
        _direct.on, _direct.switches = self.was


def run_op(op, *args):
    """Call the operator ``op`` (a ``KernelOp``) from an autograd Function. On plain CUDA tensors (or CPU ones
    under the interpreter) with nothing tracing, its Python function runs directly: the dispatcher's round trip
    buys nothing there. torch.compile, fake or meta tensors, tensor subclasses and dispatch modes (FakeTensorMode,
    counting modes) get the dispatcher's operator, whose fake kernel and schema they need."""
    compiling = torch.compiler.is_compiling()
    tracing = compiling or _get_current_dispatch_mode() is not None
    if _direct.on and not tracing and not torch.autograd.profiler._is_profiler_enabled:
        return op.function(*args)
    if tracing:
        return op(*args) if compiling else _dispatched(op, args)
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS or a.device.type not in ("cuda", "cpu")):
            return _dispatched(op, args)
    if torch.autograd.profiler._is_profiler_enabled:  # profiles (vit-fast host) still see the op by its name
        with torch.profiler.record_function(op.qualname):
            return op.function(*args)
    return op.function(*args)


SECOND_DERIVATIVE_ERROR = ("vit_fast's fused kernels (and its packed-SDPA route) have no second derivative (a "
                           "backward under create_graph=True: torch.autograd.grad(..., create_graph=True), "
                           "Hessian-vector products, torch.autograd.functional.jvp / hvp / hessian); backend='torch' "
                           "runs the reference path, which autograd differentiates twice, and first-order gradients "
                           "need no create_graph")


def first_order_only(backward):
    """The decorator of every kernel Function's backward: ``once_differentiable``, and a backward run under
    create_graph=True raises at once. once_differentiable alone raises only where its error node is reached: a
    ``torch.autograd.grad`` of the gradients with respect to chosen inputs (a Hessian-vector product, autograd's
    functional jvp / hvp) prunes that node and would get the kernels' second-order terms as zeros."""
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():  # the engine runs a backward in grad mode only under create_graph=True
            raise RuntimeError(SECOND_DERIVATIVE_ERROR)
        return once(ctx, *grads)
    return checked


def _dispatched(op, args: tuple):
    """``op(*args)`` through the dispatcher (a dispatch mode, a tensor subclass), refusing a call that autograd
    would have to differentiate: the operators have no autograd kernel (their Functions own the gradients), and
    torch's fallback would only warn and leave the gradients None. It happens with an operator called directly on
    inputs that require grad in grad mode (a backward under create_graph=True raises before, in
    ``first_order_only``)."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise RuntimeError(f"{op.qualname}: an operator called on inputs that require grad in grad mode: "
                           + SECOND_DERIVATIVE_ERROR)
    return op(*args)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def op_caller():
    """How a caller inside ``direct_ops`` (its tensors checked) calls a run of custom ops: ``op(*args)`` through
    ``run_op``'s first case decided once for the run (the ops' Python functions directly when nothing traces and no
    profiler listens), else ``run_op`` itself."""
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or torch.autograd.profiler._is_profiler_enabled):
        return run_op
    return _call_directly


def _call_directly(op, *args):
    return op.function(*args)


def check_kernel_device(op: str, *tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device that can run Triton kernels: CUDA, or CPU under the interpreter."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for t in present[1:]:
        if t.device != device:
            raise ValueError(f"{op}: expected all tensors on one device, got {device} and {t.device}")
    if device.type == "cuda":
        return device
    if device.type == "cpu" and interpreter_active():
        # not while dynamo traces (it cannot trace the patching); the op's call at run time installs it
        if not torch.compiler.is_compiling() and not _interpreter_fixed:
            _fix_interpreter()
        return device
    raise RuntimeError(
        f"{op}: the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
        f"before triton is imported); got a tensor on {device}. Use backend='torch' for the reference path."
    )


_interpreter_fixed = False


def _fix_interpreter() -> None:
    """The interpreter's gaps (vit_fast/tools/interpreter.py), once: its bf16 dot and fp32 -> bf16 cast, without
    which a bf16 kernel run on CPU is silently wrong, and triton <= 3.6 with numpy >= 2.4."""
    global _interpreter_fixed
    from vit_fast.tools.interpreter import install_bf16_shims

    _interpreter_fixed = install_bf16_shims()


def check_float(op: str, name: str, t: torch.Tensor, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: expected {name} with dtype in ({names}), got {t.dtype}")


def check_ndim(op: str, name: str, t: torch.Tensor, ndim: int | tuple[int, ...]) -> None:
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in allowed:
        raise ValueError(f"{op}: expected {name} with {' or '.join(map(str, allowed))} dims, "
                         f"got shape {tuple(t.shape)}")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: expected {name} of shape {tuple(shape)}, got {tuple(t.shape)}")


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels index per-column parameters (weights, biases, LayerScale, drop-path scales) as
    ``ptr + col``: a strided or expanded (stride-0) 1-D view is copied once. Called in the public
    functionals, before autograd, so gradients still flow back through the view."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def cast_to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t.to(dtype)`` (None stays None) without the call where ``t`` has the dtype: ``Tensor.to`` costs about a
    microsecond of host time even where it returns ``t``, and the fused paths ask it for every weight, stream and
    parameter gradient of a step."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def next_seed(device: torch.device) -> torch.Tensor:
    """A fresh Philox seed for one kernel call: a 1-element int64 tensor drawn on ``device`` (the tensors'
    own) from torch's generator of that device, which the kernels read through a pointer.

    On the device, the draw is part of the step: a CUDA graph replays the draw with its generator advanced
    (torch registers the generator with the capture), so every replay gets a fresh dropout mask, and no host
    sync is needed. It follows ``torch.manual_seed`` (which seeds every device), and
    ``torch.utils.checkpoint`` restores the device's generator before recomputing, so a recomputed forward
    draws the same mask. torch.compile traces the draw as a graph op (a fresh seed per call, no graph break).
    The seed is saved for backward, which regenerates the mask from it instead of storing the mask.
    """
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


@triton.jit
def dropout_keep_mask(seed, offsets, p):
    """Keep-mask of inverted dropout for the elements at ``offsets`` (int32 or int64 tensor).

    Philox via tl.rand(seed, offsets): the same (seed, offset) pair gives the same draw in forward
    and backward, on every run and in the interpreter. An element is kept with probability 1 - p.
    """
    return tl.rand(seed, offsets) >= p


# Attention dropout draws 8-bit random values: its rate is quantised to multiples of 1/256.
DROPOUT_LEVELS = 256


def dropout_threshold(p: float) -> int:
    """The 8-bit threshold t = round(256 p) (halves up) of ``dropout_keep_tile``: an element is kept iff its
    random byte is >= t, so the rate actually applied is t / 256 (p = 0.1 -> 26 / 256 = 0.1016) and the kept
    values are scaled by 1 / (1 - t / 256), which keeps the expectation exact. t = 0 (p < 1/512) keeps
    everything and draws nothing; t = 256 (p > 511/512) drops everything."""
    return int(math.floor(float(p) * DROPOUT_LEVELS + 0.5))


def dropout_rate(p: float) -> float:
    """The dropout rate ``dropout_keep_tile`` applies for a requested rate p: t / 256, t = dropout_threshold(p)."""
    return dropout_threshold(p) / DROPOUT_LEVELS


@triton.jit
def dropout_keep_tile(seed, stream, rows, col_start, threshold, BLOCK_N: tl.constexpr):
    """Keep mask of the (len(rows) x BLOCK_N) tile of columns col_start .. col_start + BLOCK_N - 1 (col_start a
    multiple of 16) of a per-element dropout over a (rows x columns) matrix, e.g. one head's attention scores
    (``stream`` = b * H + h, ``rows`` the query indices, columns the keys).

    One Philox-4x32-10 call serves 16 elements: element (i, j) reads the counter (j // 16, i, stream, 0) under
    key ``seed``; byte k (bits 8k .. 8k + 7) of the call's 32-bit word w decides column 16 * (j // 16) + 4w + k,
    kept iff that byte >= ``threshold`` (``dropout_threshold(p)``, 0..256). The decision depends only on
    (seed, stream, i, j), not on the tile: any tiling, or a transposed tile (``tl.trans`` of a tile drawn in
    this orientation), regenerates the same mask bit for bit. Draws run on a (rows x BLOCK_N / 16) grid;
    two rounds of ``tl.interleave`` spread the four words, two more the four bytes of each word.
    """
    tl.static_assert(BLOCK_N % 16 == 0, "dropout_keep_tile: BLOCK_N must be a multiple of 16")
    zero = tl.zeros([rows.shape[0], BLOCK_N // 16], tl.uint32)
    groups = (col_start // 16 + tl.arange(0, BLOCK_N // 16)).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, zero + groups[None, :], zero + rows.to(tl.uint32)[:, None],
                               zero + stream.to(tl.uint32), zero)
    words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # column 4g + w holds word w of group g
    lo = tl.interleave(words & 0xFF, (words >> 16) & 0xFF)  # bytes 0 and 2
    hi = tl.interleave((words >> 8) & 0xFF, words >> 24)  # bytes 1 and 3
    # compared as uint32: t = 256 (drop all) must not wrap to 0
    return tl.interleave(lo, hi) >= threshold.to(tl.uint32)  # column 16g + 4w + k holds byte k of word w


def gpu_arch(device: torch.device) -> int:
    """Compute capability as an int (80 for A100, 90 for H100) used to index the config tables.

    Under the interpreter there is no GPU; the sm_80 table is used (it is the smaller one, so the
    interpreted programs are what an A100 would run).
    """
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        arch = _ARCH_OF_DEVICE.get(index)
        if arch is None:  # asked at every launch: the capability query is kept per device
            major, _ = torch.cuda.get_device_capability(index)
            arch = _ARCH_OF_DEVICE[index] = 90 if major >= 9 else 80
        return arch
    return 80


_ARCH_OF_DEVICE: dict = {}


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision for a kernel's dot operands: fp32 operands follow torch's matmul flag
    (IEEE fp32 unless torch.backends.cuda.matmul.allow_tf32 is True, then tf32 tensor cores), read
    at launch time like cuBLAS does; fp16/bf16 operands always run on tensor cores ('ieee' is the
    value that changes nothing for them)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def next_power_of_2(n: int) -> int:
    """Host-side sizes (triton.next_power_of_2 and triton.cdiv wrap their arithmetic in a constexpr_function
    call that costs microseconds per launch on the host)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# SMs of the GPUs the config tables are written for (A100 SXM, H100 SXM), for launches that size
# their grid from the architecture rather than from the device they run on.
SM_COUNT = {80: 108, 90: 132}


def programs_to_fill(device_or_arch: torch.device | int, per_sm: int) -> int:
    """The one policy for how many programs fill a GPU: ``per_sm`` programs on every SM, of the CUDA
    device itself (queried at launch, never at import) or of the architecture's reference GPU
    (``SM_COUNT``) when given an arch int. Launches use it to split reductions (rows of the fp32
    partial buffers), so the split is fixed per device and shape and the result reproducible."""
    if isinstance(device_or_arch, int):
        return per_sm * SM_COUNT[device_or_arch]
    return per_sm * torch.cuda.get_device_properties(device_or_arch).multi_processor_count


def compute_dtype_for(t: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for t's device (what the next GEMM computes in), else t's dtype."""
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype
