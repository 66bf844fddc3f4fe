"""Tools behind the ``vit-fast`` CLI: check, report, traffic, bench, and the interpreter shims and numerics they
share; the argparse types the commands share."""
import argparse
import math


def preset_name(value: str) -> str:
    """argparse ``type=`` for a model preset: an unknown name is argparse's one-line error (exit 2)."""
    from vit_fast.presets import PRESETS, list_models

    if value not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown model {value!r}; available: {', '.join(list_models())}")
    return value


def number_arg(kind, low=None, high=None, low_open=False, high_open=False):
    """argparse type: an int / finite float in [low, high] (open ends with *_open); argparse's own error otherwise."""
    name = "an integer" if kind is int else "a number"
    bounds = " and ".join(([f"{'>' if low_open else '>='} {low}"] if low is not None else [])
                          + ([f"{'<' if high_open else '<='} {high}"] if high is not None else []))

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if (not math.isfinite(value) or (low is not None and (value < low or low_open and value == low))
                or (high is not None and (value > high or high_open and value == high))):
            raise argparse.ArgumentTypeError(f"expected {name} {bounds}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} {bounds}"   # argparse names the type in 'invalid <type> value' errors
    return parse


POSITIVE_INT, NONNEG_INT = number_arg(int, 1), number_arg(int, 0)
POSITIVE_FLOAT, NONNEG_FLOAT = number_arg(float, 0, low_open=True), number_arg(float, 0)
FRACTION = number_arg(float, 0, 1, high_open=True)   # probabilities / rates in [0, 1)
