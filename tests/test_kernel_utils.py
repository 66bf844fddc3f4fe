"""vit_fast.kernels._utils: the one parser of TRITON_INTERPRET agrees with Triton's own."""
import contextlib

import pytest

from vit_fast.kernels._utils import interpreter_active


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "on", "yes", "y", "0", "false", "off", "", "2", " 1"])
def test_interpreter_active_parses_like_triton(monkeypatch, value):
    getenv_bool = pytest.importorskip("triton._C.libtriton").getenv_bool
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_active() == getenv_bool("TRITON_INTERPRET", False)
    assert interpreter_active() == (value.lower() in ("1", "true", "on", "yes", "y"))


def test_interpreter_active_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not interpreter_active()


def test_an_environment_switch_follows_every_change_of_its_variable(monkeypatch):
    """The switches keep the raw value last read and its meaning: every assignment (the same text again included),
    deletion and direct write to os.environ is read at the next call, for each (name, parser, default) apart."""
    import os

    from vit_fast.kernels._utils import env_switch

    name = "VIT_FAST_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    seen = [env_switch(name)]
    for value in ("0", "0", "1", " OFF ", "no", "yes"):
        monkeypatch.setenv(name, value)
        seen.append(env_switch(name))
    os.environ[name] = "false"
    seen.append(env_switch(name))
    monkeypatch.delenv(name)
    seen.append(env_switch(name))
    assert seen == [True, False, False, True, False, False, True, False, True]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_active()
    monkeypatch.setenv("TRITON_INTERPRET", "off")  # same name, another parser's cache entry
    assert not interpreter_active()


def test_inside_direct_ops_a_switch_is_read_once_and_again_after(monkeypatch):
    """``direct_ops`` (one fused block's run of launches) reads each switch once; outside it, and in the next run,
    the variable's current value."""
    from vit_fast.kernels._utils import direct_ops, env_switch

    name = "VIT_FAST_TEST_SWITCH"
    monkeypatch.setenv(name, "1")
    with direct_ops():
        assert env_switch(name)
        monkeypatch.setenv(name, "0")
        assert env_switch(name)  # the run's reading
        with direct_ops():  # a nested run reads afresh, and the outer one keeps its reading after it
            assert not env_switch(name)
        assert env_switch(name)
    assert not env_switch(name)
    with direct_ops():
        assert not env_switch(name)


def test_every_operator_is_a_kernel_op_with_its_fake_and_no_autograd_kernel():
    """Every ``vit_fast::`` operator is a ``KernelOp``: a dispatcher op whose one backend kernel is the launcher
    function, with a fake kernel (torch.compile, fake tensors) and the pt2-compliant tag; no autograd kernel (the
    autograd Functions own the gradients, and custom_op's Python autograd kernel cost 4-7 us a call)."""
    import torch
    from torch._library.simple_registry import singleton

    from vit_fast._compat import custom_ops
    from vit_fast.kernels._utils import KernelOp, kernel_op_of

    ops = custom_ops()
    assert len(ops) >= 18
    for overload in ops:
        op = kernel_op_of(overload)
        assert isinstance(op, KernelOp) and op.default is overload, overload
        assert singleton.find(op.qualname).fake_impl.kernel is not None, overload
        assert torch.Tag.pt2_compliant_tag in overload.tags, overload
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, "Autograd"), overload
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, "CompositeExplicitAutograd"), overload
    assert kernel_op_of(torch.ops.aten.add.Tensor) is None



def test_a_kernel_op_defined_again_replaces_the_first_and_takes_keywords():
    """A module imported again (importlib.reload, IPython's autoreload) defines its operators again: the second
    definition replaces the first. Arguments with defaults may be given by keyword, as with any torch operator."""
    import torch

    from vit_fast.kernels._utils import kernel_op

    def first(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale

    def second(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale + 1

    op = kernel_op("vit_fast_test::redefined")(first)
    assert torch.equal(op(torch.ones(2), scale=3.0), torch.full((2,), 3.0))
    op = kernel_op("vit_fast_test::redefined")(second)
    assert torch.equal(op(torch.ones(2), scale=3.0), torch.full((2,), 4.0))
    assert torch.equal(torch.ops.vit_fast_test.redefined(torch.ones(2)), torch.full((2,), 2.0))


def test_a_double_backward_raises_instead_of_returning_zeros():
    """The fused kernels have one derivative: a gradient taken with create_graph=True raises as it is taken, with and
    without a dispatch mode, never a silent constant; an operator called directly on inputs that require grad is
    refused, naming the fix."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from vit_fast.kernels._utils import run_op
    from vit_fast.kernels.swiglu import swiglu, swiglu_fwd

    a, b = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    for context in (contextlib.nullcontext, lambda: FlopCounterMode(display=False)):
        with context():
            ga, = torch.autograd.grad(swiglu(a, b).sum(), a)  # a first derivative is fine
            assert ga.shape == a.shape
            with pytest.raises(RuntimeError, match="no second derivative.*backend='torch'"):
                torch.autograd.grad(swiglu(a, b).pow(3).sum(), a, create_graph=True)
    with FlopCounterMode(display=False):
        with pytest.raises(RuntimeError, match="vit_fast::swiglu_fwd: .*no second derivative.*backend='torch'"):
            run_op(swiglu_fwd, a, b)


def test_a_users_bf16_kernel_run_in_the_interpreter_is_right_without_asking():
    """The interpreter multiplies bf16 bit patterns in tl.dot (error ~1e9): the kernels install the shims at their
    first interpreted run, so a process that never imported the test suite's conftest gets bf16 rounding errors."""
    import subprocess
    import sys

    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "import torch\n"
            "from vit_fast.kernels.attention import attention, attention_ref\n"
            "torch.manual_seed(0); qkv = torch.randn(1, 9, 48).bfloat16()\n"
            "print(float((attention(qkv, 2).float() - attention_ref(qkv, 2).float()).abs().max()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert float(out.strip().splitlines()[-1]) < 0.05
