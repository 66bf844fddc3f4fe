"""GPU-readiness report: AOT-compile every kernel config for sm_80/sm_90 (same as `vit-fast report`)."""
import sys

from vit_fast.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
