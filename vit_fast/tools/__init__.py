"""Tools behind the ``vit-fast`` CLI: check, report, traffic, bench, and the interpreter shims and numerics they
share."""


def preset_name(value: str) -> str:
    """argparse ``type=`` for a model preset: an unknown name is argparse's one-line error (exit 2)."""
    import argparse

    from vit_fast.presets import PRESETS, list_models

    if value not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown model {value!r}; available: {', '.join(list_models())}")
    return value


def positive_int(value: str) -> int:
    """argparse ``type=`` for a count that must be >= 1."""
    import argparse

    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return number
