"""Test session setup and the fixtures every test file shares.

TRITON_INTERPRET must be set before triton is imported anywhere, so this happens at the top of
the first conftest pytest loads. On a CUDA machine the same tests run the compiled kernels.

Fixtures: ``poisoned_allocations`` (the one NaN-poisoning mechanism; kernel test files switch it on for
every test with ``pytestmark = pytest.mark.usefixtures("poisoned_allocations")``) and ``traffic`` (the one
interpreter instrumentation: launches, loads and stores). Shared constants and comparison helpers
(DEVICE, DTYPES, assert_close, check_matches_reference, ...) live in tests/numerics.py.
"""
import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)) if "PYTEST_XDIST_WORKER" not in os.environ else 1)


# The interpreter's bf16 gaps (tl.dot on bf16 bits, truncating fp32 -> bf16 casts) are fixed by the
# package's shims, which the kernels install at their first interpreted run; installed here before any test, so
# every test runs under them; see vit_fast/tools/interpreter.py for the upstream issues.
from vit_fast._compat import wrap_interpreted_run  # noqa: E402
from vit_fast.kernels._utils import interpreter_active  # noqa: E402 (after TRITON_INTERPRET is set)

if interpreter_active():
    from vit_fast.tools.interpreter import install_bf16_shims

    install_bf16_shims()


def pytest_runtest_logreport(report):
    """With VIT_FAST_FAILURES_AT_ONCE=1 (the GPU session's test step, which a deadline may kill before pytest's
    summary), each failure's traceback is printed as it happens."""
    if report.failed and os.environ.get("VIT_FAST_FAILURES_AT_ONCE") == "1":
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def default_device():
    """Tensors a test builds without naming a device land on the device the tests run on (tests/numerics.DEVICE):
    on a GPU the kernels refuse CPU tensors, so a test that forgot ``device=`` would test nothing there. On CPU a
    no-op."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every torch.empty (the launchers' only allocator) comes back filled with NaN (integer tensors: -1),
    so an output element or partial-sum row that a kernel forgets to write fails the comparison."""
    # torch's `with torch.device(...)` mode caches its set of factory functions on first use (dynamo's tracing
    # triggers it): filled while torch.empty is patched, it would hold the wrapper, and every later
    # `with torch.device("meta")` in this process would build real tensors through torch.empty
    import torch.utils._device as device_mode

    if hasattr(device_mode, "_device_constructors"):
        device_mode._device_constructors()
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t if t.dtype == torch.bool or t.is_complex() else t.fill_(-1)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


class Traffic:
    """Kernel launches and interpreter loads/stores, attributed to tensors by address."""

    def __init__(self):
        self.launches: list[str] = []
        self.accesses: dict[str, list[np.ndarray]] = {"read": [], "write": []}

    def record(self, kind, ptrs, mask):
        addresses = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data]
        self.accesses[kind].append(addresses.astype(np.uint64))
        self.accesses[kind + "_size"] = ptrs.get_element_ty().primitive_bitwidth // 8

    def bytes(self, kind: str, t: torch.Tensor) -> int:
        """Bytes of `kind` ('read'/'write') that fell inside t's storage."""
        start = t.untyped_storage().data_ptr()
        end = start + t.untyped_storage().nbytes()
        total = 0
        for addresses in self.accesses[kind]:
            total += int(((addresses >= start) & (addresses < end)).sum()) * t.element_size()
        return total

    def clear(self):
        self.__init__()


@pytest.fixture
def traffic(monkeypatch):
    """A Traffic record of every kernel launch and interpreter load / store while the test runs."""
    from vit_fast.kernels._utils import interpreter_active

    if not interpreter_active():
        pytest.skip("counts loads and stores inside the Triton interpreter (TRITON_INTERPRET=1)")
    from triton.runtime import interpreter as interp

    rec = Traffic()
    load, store = interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store

    def counted_load(self, ptrs, mask, *rest):
        rec.record("read", ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def counted_store(self, ptrs, value, mask, *rest):
        rec.record("write", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    def counted_run(self, run, *args, grid, warmup, **kwargs):
        rec.launches.append(self.fn.__name__)
        return run(*args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", counted_load)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", counted_store)
    restore = wrap_interpreted_run(counted_run)  # InterpretedFunction.run differs across triton versions
    yield rec
    restore()
