"""GPU training throughput, timm vs vit_fast, eager and compiled (same as `vit-fast bench`)."""
import sys

from vit_fast.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
