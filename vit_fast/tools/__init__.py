"""Tools behind the ``vit-fast`` CLI: check, report, traffic, bench, and the interpreter shims and numerics they
share."""
