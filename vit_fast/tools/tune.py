"""`vit-fast tune`: measure the kernel configs and the per-fusion choices for one model on this GPU,
print the table and write it to the autotune cache (vit_fast/tuning.py, vit_fast/kernels/_tuning.py)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vit-fast tune", description=__doc__,
        epilog="Then `vit_fast.optimize(model, tune=True)` applies the cached choices (no timing). Without CUDA "
               "nothing is timed: every fusion stays fused and the static configs are used.")
    parser.add_argument("--model", default="vit_base_patch16_224", help="preset name (vit-fast info --list)")
    parser.add_argument("--batch", type=int, default=64, help="images per step to tune for (default 64)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                        help="compute dtype: bf16/fp16 run under autocast with fp32 weights (default bf16)")
    parser.add_argument("--img-size", type=int, default=None, help="square input size (default: the preset's)")
    parser.add_argument("--eval", action="store_true", help="tune the model in eval mode (default: training mode)")
    parser.add_argument("--cache-dir", default=None,
                        help="autotune cache folder (default $VIT_FAST_CACHE_DIR or ~/.cache/vit_fast)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON to PATH")
    args = parser.parse_args(list(argv))
    if args.batch < 1:
        parser.error("--batch must be >= 1")

    from vit_fast.kernels import _tuning

    try:
        with _tuning.overridden(cache_dir=args.cache_dir, fresh=False):
            report = tune_report(args.model, args.batch, args.dtype, img_size=args.img_size, train=not args.eval)
    except (ValueError, TypeError) as e:
        print(f"vit-fast tune: {e}", file=sys.stderr)
        return 2
    print(report["text"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "text"}, f, indent=1)
    return 0


def tune_report(model_name: str, batch: int, dtype: str = "bf16", img_size: int | None = None,
                train: bool = True) -> dict:
    """Tune ``model_name`` at ``batch`` / ``dtype`` ('fp32' | 'fp16' | 'bf16') on this machine's GPU (CPU:
    nothing timed) and return {"text": the printed table, "model", "batch", "dtype", "env", "timed",
    "fusions": [...], "kernels": [...]}: the stage `vit-fast bench --campaign` runs and includes."""
    import torch

    import vit_fast
    from vit_fast import tuning
    from vit_fast.kernels import _tuning

    if dtype not in DTYPES:
        raise ValueError(f"expected a dtype in {sorted(DTYPES)}, got {dtype!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    overrides = {} if img_size is None else {"img_size": img_size}
    model = vit_fast.create_model(model_name, **overrides).to(device).train(train)
    env = _tuning.environment(device)
    lines = [f"vit-fast tune: {model_name}, batch {batch}, {dtype}, {'train' if train else 'eval'}; "
             f"{env['gpu']} (sm {env['capability'] or '-'}, driver {env['driver'] or '-'}), torch {env['torch']}, "
             f"triton {env['triton']}, vit_fast {env['vit_fast']}"]
    if not _tuning.autotune_enabled():
        lines.append("VIT_FAST_AUTOTUNE=0 is set: nothing is timed")
    result = tuning.tune_model(model, batch, getattr(torch, DTYPES[dtype]), refresh=True)
    lines.append(tuning.format_table(result))
    if result.timed:
        lines.append(f"written to {_tuning.cache_for(device).path}")
    return {"text": "\n".join(lines), "model": model_name, "batch": batch, "dtype": dtype, "env": env,
            "timed": result.timed,
            "fusions": [{"op": r.op, "candidates": list(r.candidates), "times_ms": r.times_ms, "choice": r.choice}
                        for r in result.fusions],
            "kernels": [{"key": k.key, "candidates": k.candidates, "times_ms": k.times_ms, "choice": k.choice}
                        for k in result.kernels]}


def campaign_stage(c) -> dict:
    """The `vit-fast bench --campaign` stage (campaign.Stage's ``run``): tunes ViT-B/16 at batch 256 in bf16
    (a tiny preset at batch 2 with ``--dry-run``), puts one row per fusion and per kernel-config choice in
    ``c.results["tune"]`` (DIR/tune.csv), prints the table and returns it in the status. Registered
    with ``register_stage(Stage("tune", campaign_stage, budget_s=120), after="env")``: the first tuning of
    a model compiles every candidate config (about 1 s each), later runs read the cache."""
    model, batch = ("vit_tiny_patch16_224", 2) if c.dry_run else ("vit_base_patch16_224", 256)
    c.progress(f"tune: {model}, batch {batch}, bf16 (every implementation per fusion, kernel configs)")
    report = tune_report(model, batch, "bf16")
    rows = [{"kind": "fusion", "op": r["op"], "candidates": "|".join(r["candidates"]),
             "times_ms": "" if r["times_ms"] is None else "|".join(f"{t:.4f}" for t in r["times_ms"]),
             "choice": r["choice"]} for r in report["fusions"]]
    rows += [{"kind": "kernel", "op": k["key"], "candidates": "|".join(k["candidates"]),
              "times_ms": "|".join(f"{t:.4f}" for t in k["times_ms"]), "choice": k["candidates"][k["choice"]]}
             for k in report["kernels"]]
    c.results["tune"] = [c.tagged(r) for r in rows]
    print(report["text"], flush=True)
    return {"status": "ok", "model": model, "batch": batch, "timed": report["timed"],
            "fusions": {r["op"]: r["choice"] for r in report["fusions"]}, "kernel_choices": len(report["kernels"]),
            "table_rows": len(rows)}  # the table itself is printed and in tune.csv
