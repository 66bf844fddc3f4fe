"""Bytes and launches per training step with a roofline (same as `vit-fast traffic`)."""
import sys

from vit_fast.tools.traffic import main

if __name__ == "__main__":
    sys.exit(main())
