"""vit_fast.kernels._utils: the one parser of TRITON_INTERPRET agrees with Triton's own."""
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
