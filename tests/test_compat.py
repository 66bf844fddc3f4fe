"""vit_fast/_compat.py and the interpreter's numpy fix: what keeps the project working on torch 2.11 + triton 3.6
as on torch 2.14 + triton 3.8 (`.ci/run` runs this file on both). _compat.aot_compile is exercised by
tests/test_report.py through `vit-fast report`'s compile workers."""
import pytest
import torch
import triton
import triton.language as tl
from _pytest.monkeypatch import MonkeyPatch

from vit_fast import _compat
from vit_fast.kernels._utils import interpreter_active

SETTINGS = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
            (torch._dynamo.config, "capture_scalar_outputs")]


def test_monkeypatch_setting_restores_getattr_served_settings():
    """pytest 9.2's monkeypatch deletes such settings on undo; through _compat they come back as they were."""
    before = [getattr(obj, name) for obj, name in SETTINGS]
    mp = MonkeyPatch()
    for (obj, name), old in zip(SETTINGS, before):
        _compat.monkeypatch_setting(mp, obj, name, not old)
    assert [getattr(obj, name) for obj, name in SETTINGS] == [not old for old in before]
    mp.undo()
    assert [getattr(obj, name) for obj, name in SETTINGS] == before


@triton.jit
def _grid_stride_copy_kernel(Y, X, n_rows, N, BLOCK: tl.constexpr):
    """A grid-stride loop over rows, as kernels/layer_norm.py has: range() of a program id."""
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x = tl.load(X + row * N + cols, mask=cols < N)
        tl.store(Y + row * N + cols, x * 2, mask=cols < N)


@pytest.mark.skipif(not interpreter_active(), reason="the interpreter's launch path (TRITON_INTERPRET=1)")
def test_interpreter_runs_grid_stride_loops_and_counts_launches():
    """int() of a program id works whatever numpy (triton 3.6 + numpy >= 2.4 needs the fix), and
    wrap_interpreted_run sees every launch, whichever way this triton holds InterpretedFunction.run."""
    from vit_fast.tools.interpreter import install_numpy_fix

    assert install_numpy_fix()
    x = torch.randn(7, 5)
    y = torch.full_like(x, float("nan"))
    seen = []

    def counted(fn_self, run, *args, grid, warmup, **kwargs):
        seen.append((fn_self.fn.__name__, grid))
        return run(*args, grid=grid, warmup=warmup, **kwargs)

    restore = _compat.wrap_interpreted_run(counted)
    try:
        _grid_stride_copy_kernel[(3,)](y, x, 7, 5, BLOCK=8)
    finally:
        restore()
    assert torch.equal(y, 2 * x)
    assert seen == [("_grid_stride_copy_kernel", (3,))]
    _grid_stride_copy_kernel[(2,)](y, x, 7, 5, BLOCK=8)
    assert len(seen) == 1, "restore() unwraps"



@pytest.mark.skipif(not interpreter_active(), reason="the interpreter's options (TRITON_INTERPRET=1)")
def test_interpreter_skips_only_the_overflow_checks_it_would_drop():
    """The interpreter computes an int64 overflow check for every int32 add, sub and mul and asserts it only with
    debug, which it never sets: with the fix it computes none, and still computes the kernels' int32 arithmetic."""
    from triton.runtime import interpreter as interp

    from vit_fast.tools.interpreter import install_numpy_fix

    assert install_numpy_fix()
    options = interp.interpreter_builder.options
    assert options.sanitize_overflow is False and options.debug is False
    x = torch.randn(7, 5)
    y = torch.full_like(x, float("nan"))
    _grid_stride_copy_kernel[(3,)](y, x, 7, 5, BLOCK=8)   # row * N + cols: int32 arithmetic
    assert torch.equal(y, 2 * x)


@triton.jit
def _doubled(x):
    return x * 2


@triton.jit
def _copy_through_helper_kernel(Y, X, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + tl.program_id(0) * N + cols, mask=cols < N)
    tl.store(Y + tl.program_id(0) * N + cols, _doubled(x), mask=cols < N)


@pytest.mark.skipif(not interpreter_active(), reason="the interpreter's language patches (TRITON_INTERPRET=1)")
def test_interpreter_patches_the_language_once_per_launch_and_undoes_it(monkeypatch):
    """A @triton.jit helper inside a launch runs on the launch's patches (the interpreter patched the language again
    at each call of it, in every program, never undoing them): one program or six patch alike, the results are
    right, and after the launch triton.language is as it was."""
    from triton.runtime import interpreter as interp

    from vit_fast.tools.interpreter import install_numpy_fix

    assert install_numpy_fix()
    before = (tl.load, tl.store, tl.arange, tl.core.tensor.__mul__)
    patch_builtin, patched = interp._patch_builtin, []
    monkeypatch.setattr(interp, "_patch_builtin", lambda *a: (patched.append(a[0]), patch_builtin(*a))[1])
    counts = []
    for programs in (1, 6):
        x = torch.randn(programs, 5)
        y = torch.full_like(x, float("nan"))
        _copy_through_helper_kernel[(programs,)](y, x, 5, BLOCK=8)
        assert torch.equal(y, 2 * x)
        assert (tl.load, tl.store, tl.arange, tl.core.tensor.__mul__) == before
        counts.append(len(patched))
        patched.clear()
    assert counts[0] == counts[1] > 0


def _fields(cls, init, *args) -> dict:
    """The fields ``init`` gives a new ``cls``, or the exception type it raises."""
    obj = cls.__new__(cls)
    try:
        init(obj, *args)
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e)}
    return vars(obj)


@pytest.mark.skipif(not interpreter_active(), reason="the interpreter's type memos (TRITON_INTERPRET=1)")
def test_interpreter_types_built_once_per_shape_are_what_triton_builds():
    """The interpreter's tensor and block types, their fields kept per shape, and its numpy dtypes, kept per scalar
    type: every field as triton's own constructors and table give it, first call and cached (shapes of ints or
    constexprs, scalar, const and non-const pointer elements, a scalar tensor), and the same errors (a 0-d block,
    a side not a power of two, a shape that is not a sequence)."""
    import triton.language.core as core
    from triton.runtime import interpreter as interp

    from vit_fast.tools.interpreter import install_numpy_fix

    assert install_numpy_fix()
    tensor_init, block_init, np_dtype = core.tensor.__init__, core.block_type.__init__, interp._get_np_dtype
    assert tensor_init.memoized and block_init.memoized and np_dtype.memoized
    import numpy as np

    handle = interp.TensorHandle(np.zeros(1, np.float32), tl.float32)  # the memo's case; others construct as before
    elements = [tl.float32, tl.bfloat16, tl.int1, tl.uint8, tl.pointer_type(tl.float16),
                tl.pointer_type(tl.float16, const=True), tl.pointer_type(tl.int32, address_space=3)]
    for element in elements:
        for shape in ([4], [tl.constexpr(2), 8], (16, 1, 2), [], [3], 5):
            for _ in range(2):  # the first call fills the memo, the second reads it
                block = _fields(core.block_type, block_init, element, shape)
                assert block == _fields(core.block_type, block_init.original, element, shape), (element, shape)
                if "raised" in block:
                    continue
                block_type = core.block_type(element, shape)
                tensor = _fields(core.tensor, tensor_init, handle, block_type)
                assert tensor == _fields(core.tensor, tensor_init.original, handle, block_type)
                assert tensor["handle"] is handle and tensor["type"] is block_type
                assert np_dtype(block_type) == np_dtype.original(block_type)
        for _ in range(2):
            scalar = _fields(core.tensor, tensor_init, handle, element)
            assert scalar == _fields(core.tensor, tensor_init.original, handle, element) and scalar["shape"] == ()
            assert scalar["dtype"] is element and np_dtype(element) == np_dtype.original(element)
    compiler_handle = object()
    assert _fields(core.tensor, tensor_init, compiler_handle, tl.float16) == _fields(
        core.tensor, tensor_init.original, compiler_handle, tl.float16)


@pytest.mark.skipif(not interpreter_active(), reason="the interpreter's broadcast (TRITON_INTERPRET=1)")
def test_alike_operands_skip_the_broadcast_walk_and_the_rest_broadcast_as_triton_does():
    """Operands of one block type or two scalars come back as they are, as Triton's walk over their shapes returns
    them; every other pair (another element type, (M, 1) against (M, N), a lower rank, a block and a scalar) takes
    Triton's walk: the same types, values and objects as Triton's own, and incompatible shapes still refused."""
    import numpy as np
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter as interp

    from vit_fast.tools.interpreter import install_numpy_fix

    assert install_numpy_fix()
    broadcast = TritonSemantic.broadcast_impl_value
    assert broadcast.alike_at_once
    semantic = TritonSemantic(interp.interpreter_builder)

    def value(shape, dtype=tl.float32):
        data = np.arange(int(np.prod(shape)), dtype=np.float32 if dtype == tl.float32 else np.int32)
        if not shape:
            return tl.tensor(interp.TensorHandle(data, dtype), dtype)
        return tl.tensor(interp.TensorHandle(data.reshape(shape), dtype), tl.block_type(dtype, list(shape)))

    pairs = [(value((4, 8)), value((4, 8))), (value(()), value(())), (value((4, 8)), value((4, 8), tl.int32)),
             (value((4, 1)), value((4, 8))), (value((8,)), value((4, 8))), (value((4, 8)), value(())),
             (value(()), value((4, 8)))]
    for a, b in pairs:
        fast, slow = broadcast(semantic, a, b), broadcast.original(semantic, a, b)
        label = (str(a.type), str(b.type))
        assert [str(t.type) for t in fast] == [str(t.type) for t in slow], label
        assert all(np.array_equal(f.handle.data, s.handle.data) for f, s in zip(fast, slow)), label
        assert [f is x for f, x in zip(fast, (a, b))] == [s is x for s, x in zip(slow, (a, b))], label
    with pytest.raises(ValueError, match="Cannot make_shape_compatible"):
        broadcast(semantic, value((4, 8)), value((4, 2)))
