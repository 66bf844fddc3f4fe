"""The one place where vit_fast bridges API differences between the torch / triton / pytest versions it supports.

Supported and tested: torch 2.11 + triton 3.6 and torch 2.14 + triton 3.8 (README, setup.py). Code elsewhere
calls these helpers instead of checking versions itself.

- ``wrap_interpreted_run``: Triton's interpreter launches a kernel through ``InterpretedFunction.run``, a method
  on the class in triton >= 3.5 but an attribute set on each instance in older releases (3.4). Wrapping it
  for launch counting (``vit-fast traffic``, tests) goes through here so both shapes work.
- ``aot_compile``: ahead-of-time compilation of one ``@triton.jit`` kernel for a GPU target that need not be
  present (``vit-fast report``): ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget)``
  on triton >= 3.3; older releases spelled the constants ``constants=``.
- ``monkeypatch_setting``: set a torch setting for one test and restore it explicitly. ``monkeypatch.setattr``
  in pytest 9.2 records the old value from the object's ``__dict__``, so for settings served by a module's
  ``__getattr__`` or a class descriptor (``torch.backends.cuda.matmul.allow_tf32``,
  ``torch.backends.cudnn.allow_tf32``, ``torch._dynamo.config.capture_scalar_outputs``) its undo deletes the
  setting instead of restoring it, which breaks later tests in the same process.
- ``driver_version``: the NVIDIA driver a result was measured with (tags of ``vit-fast bench``).
- ``install_interpreter_numpy_fix``: triton <= 3.6's interpreter calls ``int()`` on the one-element 1-D array
  that holds a scalar tensor (``range(tl.program_id(0), n, step)``, tensor indices), which numpy >= 2.4 refuses
  ("only 0-dimensional arrays can be converted to Python scalars"); triton 3.8 squeezes first. Installed by the
  kernels' device check whenever they run in the interpreter (so spawned DDP workers and users' scripts get it
  too), and by the tools. With it (triton 3.6 and 3.8 alike) the interpreter skips the int32 overflow checks it
  computes and then drops (its ``device_assert`` needs ``debug``, which it never sets), and patches
  triton.language once per launch instead of again at every call of a @triton.jit helper.
"""
from __future__ import annotations

import gc
import inspect
import subprocess
from typing import Any, Callable

_MISSING = object()
_numpy_fix_installed = False


class _Setting:
    """Stands for ``obj.name``: its ``value`` is read with getattr and every assignment to it is passed on
    with setattr, so monkeypatch records and restores a plain instance attribute, whatever its version does."""

    def __init__(self, obj: Any, name: str):
        object.__setattr__(self, "_target", (obj, name))
        object.__setattr__(self, "value", getattr(obj, name))

    def __setattr__(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)
        setattr(*self._target, value)


def monkeypatch_setting(monkeypatch, obj: Any, name: str, value: Any) -> None:
    """``monkeypatch.setattr(obj, name, value)`` for settings served by ``__getattr__`` or descriptors: the
    old value is read with ``getattr`` and put back with ``setattr`` at undo, never deleted."""
    monkeypatch.setattr(_Setting(obj, name), "value", value)


def wrap_interpreted_run(wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Route every interpreted launch through ``wrapper(fn_self, run, *args, grid, warmup, **kwargs)``, where
    ``run(*args, grid=..., warmup=..., **kwargs)`` is the original launch of ``fn_self`` (an
    ``InterpretedFunction``). Returns a function that undoes the wrapping."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.__dict__.get("run", _MISSING)
    if original is not _MISSING:  # triton >= 3.5: a method on the class
        def run_on_class(fn_self, *args, **kwargs):
            return wrapper(fn_self, lambda *a, **k: original(fn_self, *a, **k), *args, **kwargs)

        InterpretedFunction.run = run_on_class

        def restore_class() -> None:
            InterpretedFunction.run = original

        return restore_class

    # older triton: each InterpretedFunction carries its own `run`; wrap every live instance
    patched = []
    for obj in gc.get_objects():
        if isinstance(obj, InterpretedFunction) and "run" in vars(obj):
            own = vars(obj)["run"]

            def run_on_instance(*args, _own=own, _fn=obj, **kwargs):
                return wrapper(_fn, _own, *args, **kwargs)

            obj.run = run_on_instance
            patched.append((obj, own))

    def restore_instances() -> None:
        for obj, own in patched:
            obj.run = own

    return restore_instances


def aot_compile(fn, signature: dict, constexprs: dict, attrs: dict | None, arch: int, num_warps: int,
                num_stages: int):
    """Compile one jit kernel for ``sm_<arch>`` without a GPU; returns triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(ASTSource).parameters
    if "constexprs" in params:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    else:  # triton <= 3.2
        src = ASTSource(fn=fn, signature=signature, constants=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def driver_version() -> str:
    """The NVIDIA driver version (``nvidia-smi``), or 'unknown'."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] or "unknown"
    except Exception:
        return "unknown"


def install_interpreter_numpy_fix() -> bool:
    """Make ``int()`` of a scalar tensor squeeze first in Triton's interpreter, as triton 3.8 does, keep its
    launches quiet (``_quiet_interpreter_launches``), skip its discarded overflow checks, patch the language
    once per launch and build its types' fields and numpy dtypes once per shape and scalar type; once, a no-op where
    the interpreter is off or the installed triton has no such hook. Returns whether it is active."""
    global _numpy_fix_installed
    from vit_fast.kernels._utils import interpreter_active

    if not interpreter_active():
        return False
    if _numpy_fix_installed:
        return True
    import numpy as np
    from triton.runtime import interpreter as interp

    patch_lang_tensor = getattr(interp, "_patch_lang_tensor", None)
    if patch_lang_tensor is not None:
        def index_of_scalar(self):
            return int(np.asarray(self.handle.data).squeeze())

        def patch_lang_tensor_squeezed(tensor, *rest):
            patch_lang_tensor(tensor, *rest)
            if rest and hasattr(rest[0], "set_attr"):  # triton >= 3.5: the scope restores it after the launch
                rest[0].set_attr(tensor, "__index__", index_of_scalar)
            else:
                tensor.__index__ = index_of_scalar

        interp._patch_lang_tensor = patch_lang_tensor_squeezed
    _quiet_interpreter_launches(interp.GridExecutor)
    _skip_unasserted_overflow_checks(interp)
    _patch_language_once_per_launch(interp)
    _memoize_numpy_dtypes(interp)
    _memoize_type_fields(interp)
    _broadcast_alike_at_once()
    _numpy_fix_installed = True
    return True


def _skip_unasserted_overflow_checks(interp) -> None:
    """The interpreter widens every int32 add, sub and mul to int64 to check it for overflow, then drops the
    check: its device_assert is a no-op without debug, which the interpreter never sets. About a quarter of an
    interpreted kernel's time; with debug off, nothing else reads the option."""
    import dataclasses

    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) \
            and not getattr(options, "debug", True):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _patch_language_once_per_launch(interp) -> None:
    """The interpreter patches triton.language's functions for a launch (``_patch_lang``, undone after it), then
    again on every call of a @triton.jit helper inside it, for every program: the same patches over themselves,
    never undone (a third of an interpreted kernel's time in flash attention's backward). Inside a launch, a helper
    whose language modules are patched already is called as it is; any other call patches as before."""
    import inspect

    import triton.language as tl

    patch_lang, launch = getattr(interp, "_patch_lang", None), interp.GridExecutor.__call__
    if patch_lang is None or getattr(patch_lang, "once_per_launch", False):
        return
    state = {"in_launch": False, "patched": None}   # the language modules the launch under way has patched
    langs_of: dict = {}   # a function -> the language modules its globals hold

    class _Unpatched:
        @staticmethod
        def restore() -> None:
            pass

    def patch_lang_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        if state["in_launch"] and state["patched"] is not None and langs <= state["patched"]:
            return _Unpatched
        scope = patch_lang(fn)
        if state["in_launch"]:
            state["patched"] = langs | (state["patched"] or set())
        return scope

    def launch_patching_once(self, *args, **kwargs):
        before = dict(state)
        state.update(in_launch=True, patched=None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.update(before)

    patch_lang_once.once_per_launch = True
    interp._patch_lang = patch_lang_once
    interp.GridExecutor.__call__ = launch_patching_once


def _memoize_numpy_dtypes(interp) -> None:
    """The interpreter maps a Triton type to its numpy dtype (on every load, store, cast and constant) by building
    a table of nineteen numpy dtypes at each call; the answer depends on the scalar type alone: kept per scalar
    type's name."""
    import triton.language as tl

    lookup = getattr(interp, "_get_np_dtype", None)
    if lookup is None or getattr(lookup, "memoized", False):
        return
    known: dict = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        name = getattr(scalar, "name", None)
        found = known.get(name)
        if found is None:
            found = lookup(tt_dtype)
            if name is not None:
                known[name] = found
        return found

    np_dtype.memoized, np_dtype.original = True, lookup
    interp._get_np_dtype = np_dtype


def _memoize_type_fields(interp) -> None:
    """``tl.tensor`` and ``tl.block_type`` derive their fields from their type (a tensor's shape as constexprs, its
    numel and scalar dtype) and from the shape (a block type's validated numel and name) again at every
    construction: the interpreter makes several per operation and program. Each is computed once per type (per
    element type and shape) and copied; the fields that are the arguments themselves (handle, type, element_ty)
    are the call's. Only where a probe finds the fields this copies and nothing else (triton 3.6, 3.8); another
    triton keeps its constructors. Tensors are memoized for the interpreter's handles only (the compiler's keep
    their constructor)."""
    import triton.language.core as core

    tensor, block_type, constexpr = core.tensor, core.block_type, core.constexpr
    if getattr(tensor.__init__, "memoized", False):
        return
    try:
        probe_type = block_type(core.float32, [constexpr(2), 4])
        probe = tensor(None, probe_type)
    except Exception:  # noqa: BLE001  (a triton whose constructors differ: left as it is)
        return
    if set(vars(probe)) != {"handle", "shape", "numel", "type", "dtype"} or set(vars(probe_type)) != {
            "element_ty", "shape", "numel", "name"}:
        return
    tensor_init, block_init = tensor.__init__, block_type.__init__
    tensor_fields: dict = {}  # a type's shape (ints) -> the tensor's (shape as constexprs, numel)
    block_fields: dict = {}  # (element type's name, shape) -> the block type's (shape, numel, name)

    interpreted = interp.TensorHandle

    def tensor_memoized(self, handle, type):
        if handle.__class__ is not interpreted:
            tensor_init(self, handle, type)
            return
        shape = type.shape if type.is_block() else ()
        try:
            fields = tensor_fields.get(shape)
        except TypeError:  # not a shape of ints: the constructor itself
            fields = shape = None
        if fields is None:
            tensor_init(self, handle, type)
            if shape is not None and all(s.__class__ is int for s in shape):
                tensor_fields[shape] = (self.shape, self.numel)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = fields

    def block_memoized(self, element_ty, shape):
        try:
            key = (element_ty.name, tuple([s.value if s.__class__ is constexpr else s for s in shape]))
            fields = block_fields.get(key)
        except (AttributeError, TypeError):  # no name, not a sequence, unhashable: the constructor's own checks
            fields = key = None
        if fields is None:
            block_init(self, element_ty, shape)
            if key is not None and str(element_ty) == key[0] and all(type(s) is int for s in key[1]):
                block_fields[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = fields

    tensor_memoized.memoized = block_memoized.memoized = True
    tensor_memoized.original, block_memoized.original = tensor_init, block_init
    tensor.__init__, block_type.__init__ = tensor_memoized, block_memoized


def _broadcast_alike_at_once() -> None:
    """Triton's implicit broadcast of a binary operation's operands walks their shapes dimension by dimension even
    when they are alike (most elementwise operations of a kernel); operands of one block type (same name: same
    shape and element type) or two scalars are returned as they are, as the walk would return them."""
    from triton.language.semantic import TritonSemantic

    broadcast = getattr(TritonSemantic, "broadcast_impl_value", None)
    if broadcast is None or getattr(broadcast, "alike_at_once", False):
        return

    def broadcast_alike_at_once(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        lhs_block, rhs_block = lhs_ty.is_block(), rhs_ty.is_block()
        if (lhs_block and rhs_block and lhs_ty.name == rhs_ty.name) or not (lhs_block or rhs_block):
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    broadcast_alike_at_once.alike_at_once, broadcast_alike_at_once.original = True, broadcast
    TritonSemantic.broadcast_impl_value = broadcast_alike_at_once


def _quiet_interpreter_launches(executor: type) -> None:
    """Run interpreted kernels with numpy's floating-point warnings off: the interpreter evaluates masked-off
    lanes too (poisoned or padded values overflow, NaN slices reduce), which a GPU computes silently; the
    results are masked either way, and the tests check every output against float64."""
    import warnings

    import numpy as np

    launch = executor.__call__
    if getattr(launch, "quiet", False):
        return

    def quiet_launch(self, *args, **kwargs):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return launch(self, *args, **kwargs)

    quiet_launch.quiet = True
    executor.__call__ = quiet_launch



# ------------------------------------------------------------------------------------------------ inductor
INDUCTOR_LOWERING = "torch._inductor.lowering"
OP_NAMESPACE = "vit_fast"
_inductor_hook_installed = False


def custom_ops() -> list:
    """Every ``vit_fast::`` custom op (its default overload), after importing the op modules of vit_fast.kernels
    (its files not named ``_*``) that define them."""
    import importlib
    import pkgutil

    import torch

    import vit_fast.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"vit_fast.kernels.{info.name}")
    names = sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith(f"{OP_NAMESPACE}::")})
    return [getattr(getattr(torch.ops, OP_NAMESPACE), n).default for n in names]


def register_inductor_fallbacks() -> int:
    """Give every vit_fast custom op the fallback lowering inductor would create for it on first sight, ahead of
    time. torch 2.11's ``GraphLowering.call_function`` formats the op's IR arguments eagerly for a log line
    before creating an implicit fallback (2.14 wraps it in ``LazyString``); an argument's text includes its
    whole producer graph, so for an op first met deep in a ViT's backward (the patch embedding's, after 12
    blocks whose residual joins read each value twice) the text grows exponentially with depth: the first
    compiled backward of ViT-B/16 never finished. Registered, the op never reaches that line. The layout
    constraint is the one the implicit path chooses (the op's tag, else the default for custom ops).
    Returns how many ops were registered now."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    added = 0
    for op in custom_ops():
        if op in lowering.lowerings:
            continue
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False)
        added += 1
    return added


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``callback`` right after module ``name`` is first executed."""

    def __init__(self, name: str, callback: Callable[[], Any]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        import sys

        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: find the real spec with the other finders
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_register(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_register
        return spec


def install_inductor_fallbacks() -> None:
    """Register vit_fast's ops with inductor as soon as inductor's lowering module exists: now if it is already
    imported, else right after it is (so a process that never compiles never pays inductor's import)."""
    global _inductor_hook_installed
    import sys

    if _inductor_hook_installed:
        return
    _inductor_hook_installed = True
    if INDUCTOR_LOWERING in sys.modules:
        register_inductor_fallbacks()
    else:
        sys.meta_path.insert(0, _AfterImport(INDUCTOR_LOWERING, register_inductor_fallbacks))
