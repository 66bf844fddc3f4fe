"""The ``vit-fast`` command line.

Subcommands are "module:function" strings imported only when chosen, so adding one is one line in
COMMANDS plus a function ``f(argv: list[str]) -> int`` (parse its own arguments, return the exit code)
in its own module.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Callable, Optional, Sequence

COMMANDS: dict[str, str] = {
    "info": "vit_fast.tools.cli:info_main",
    "host": "vit_fast.tools.host_cost:main",
    "report": "vit_fast.tools.report:main",
    "traffic": "vit_fast.tools.traffic:main",
    "bench": "vit_fast.tools.bench:main",
    "check": "vit_fast.tools.check:main",
    "train": "vit_fast.training.train:cli_main",
    "tune": "vit_fast.tools.tune:main",
}


def resolve(target: str) -> Callable[[list[str]], Optional[int]]:
    module_name, _, function_name = target.partition(":")
    return getattr(importlib.import_module(module_name), function_name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vit-fast", description="vit_fast: a drop-in faster Vision Transformer for GPU training.",
        epilog="Run `vit-fast COMMAND --help` for the options of a command.")
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND",
                        help="one of: " + ", ".join(sorted(COMMANDS)))
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return int(resolve(COMMANDS[ns.command])(ns.args) or 0)


# ------------------------------------------------------------------------------------------------ info
def info_main(argv: Sequence[str]) -> int:
    """Build a preset, print its size and analytic FLOPs, run one forward on random images on CPU."""
    parser = argparse.ArgumentParser(prog="vit-fast info", description=info_main.__doc__)
    parser.add_argument("--model", default="vit_base_patch16_224", help="preset name (see --list)")
    parser.add_argument("--batch", type=int, default=2, help="images in the random batch (default 2)")
    parser.add_argument("--img-size", type=int, default=None, help="square input size (default: the preset's)")
    parser.add_argument("--backend", default="torch", choices=("torch", "triton", "auto"),
                        help="module backend (default torch: the reference path runs anywhere)")
    parser.add_argument("--list", action="store_true", help="print the preset names and exit")
    args = parser.parse_args(list(argv))

    import torch

    import vit_fast

    if args.list:
        print("\n".join(vit_fast.list_models()))
        return 0
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    from vit_fast.kernels._utils import interpreter_active

    if args.backend == "triton" and not interpreter_active():  # the forward runs on CPU tensors
        parser.error("--backend triton runs the Triton kernels on CPU only in Triton's interpreter: set "
                     "TRITON_INTERPRET=1, or use --backend torch / auto")
    overrides = {"backend": args.backend}
    if args.img_size is not None:
        overrides["img_size"] = args.img_size
    try:
        model = vit_fast.create_model(args.model, **overrides).eval()
    except (ValueError, TypeError) as e:
        print(f"vit-fast info: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    params = vit_fast.count_params(model)
    flops = vit_fast.forward_flops(cfg)
    print(f"model        {args.model}: img {cfg.img_size[0]}x{cfg.img_size[1]}, patch {cfg.patch_size[0]}, "
          f"{cfg.num_tokens} tokens, width {cfg.embed_dim}, depth {cfg.depth}, heads {cfg.num_heads}, "
          f"mlp {cfg.mlp_hidden}, classes {cfg.num_classes}")
    print(f"parameters   {params:,} ({params / 1e6:.1f} M)")
    print(f"GFLOPs       {flops / 1e9:.2f} per image, forward (analytic count: patch-embed GEMM + per block "
          f"qkv, q@k^T, attn@v, proj, fc1, fc2 + head; 2 FLOPs per multiply-add)")
    images = torch.randn(args.batch, cfg.in_chans, *cfg.img_size)
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(images)
        seconds = time.perf_counter() - start
    print(f"forward      logits {tuple(logits.shape)} from {args.batch} random images in {seconds:.3f} s "
          f"(CPU, fp32, backend '{cfg.backend}', {args.batch * flops / seconds / 1e9:.1f} GFLOP/s)")
    if not torch.isfinite(logits).all():
        print("vit-fast info: the forward produced non-finite values", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
