"""`vit-fast train`: train or fine-tune a vit_fast ViT on one CPU, one GPU or many GPUs (torchrun).

    vit-fast train --dataset digits                                   # CPU demo, >= 95% test accuracy
    vit-fast train --dataset imagefolder --data-dir DATA --model vit_base_patch16_224 --amp bf16
    torchrun --nproc_per_node 8 -m vit_fast.training.train --dataset imagefolder --data-dir DATA [--fsdp]
    vit-fast train ... --resume auto          # continue the newest checkpoint of --output-dir, bit for bit

--batch-size is the GLOBAL batch per optimizer step (all ranks and accumulation steps together); each
rank runs micro-batches of batch_size / (world_size * accum_steps). So a run's mathematics (schedule,
data order, every global batch) are the same on any number of processes, and a checkpoint resumes on
any world size. The learning rate is not rescaled automatically.

Outputs in the run directory: metrics.jsonl (train records every --log-every steps, eval records per
epoch), checkpoints/ (see vit_fast/checkpoint.py), curves.png, summary.json; rank 0 writes them all.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..interop.convert import load_state_dict
from ..tools import FRACTION, NONNEG_FLOAT, NONNEG_INT, POSITIVE_FLOAT, POSITIVE_INT
from . import checkpoint as ckpt
from .data import DATASETS, DataInfo, build_datasets, build_loaders
from .graphs import CudaGraphStep, restore_capturable
from .metrics import MetricsLog, plot_curves

log = logging.getLogger("vit_fast.training.train")

# Per-dataset defaults; any flag given on the command line wins. The digits recipe is ViT-Tiny cut down to
# 4 blocks of width 64 (4 heads of 16) with 8x8 patches on 32x32 images (16 tokens + class token) and
# average pooling, which learns markedly faster than the class token on 1,438 images.
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": dict(model="vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=64, num_heads=4,
                   global_pool="avg", epochs=20, batch_size=32, lr=3e-3, warmup_epochs=1, weight_decay=0.05,
                   workers=0, threads=1),
    "synthetic": dict(model="vit_base_patch16_224", epochs=1, batch_size=64, lr=1e-3, warmup_epochs=0,
                      weight_decay=0.05, workers=0),
    "imagefolder": dict(model="vit_base_patch16_224", epochs=100, batch_size=256, lr=1e-3, warmup_epochs=5,
                        weight_decay=0.05, workers=min(8, os.cpu_count() or 1)),
}
MODEL_OVERRIDES = ("img_size", "patch_size", "in_chans", "num_classes", "depth", "embed_dim", "num_heads",
                   "mlp_ratio", "drop_path_rate", "global_pool")


def check_device(text: str) -> str:
    """argparse type for --device: a device torch can parse and this machine has (cuda:N within the GPU count)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda or cuda:1, got {text!r}") from None
    if device.type == "cpu":
        return text
    backend = getattr(torch, device.type, None)
    if device.type == "meta" or backend is None or not hasattr(backend, "is_available"):
        raise argparse.ArgumentTypeError(f"expected cpu or a GPU device (cuda, cuda:N), got {text!r}")
    if not backend.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no {device.type} device is available on this machine "
                                         f"(torch.{device.type}.is_available() is False); use --device cpu")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} {device.type} device(s), "
                                         f"indices 0..{count - 1}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vit-fast train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--dataset", choices=DATASETS, default="digits", help="default: digits (the built-in demo)")
    d.add_argument("--data-dir", help="imagefolder root with train/ and val/ sub-folders (with --dataset imagefolder)")
    d.add_argument("--workers", type=NONNEG_INT, help="DataLoader worker processes per rank")
    m = p.add_argument_group("model (None: the dataset's default, then the preset's value)")
    m.add_argument("--model", help="preset name (vit_fast.list_models())")
    m.add_argument("--img-size", type=POSITIVE_INT)
    m.add_argument("--patch-size", type=POSITIVE_INT)
    m.add_argument("--in-chans", type=POSITIVE_INT)
    m.add_argument("--num-classes", type=POSITIVE_INT)
    m.add_argument("--depth", type=POSITIVE_INT)
    m.add_argument("--embed-dim", type=POSITIVE_INT)
    m.add_argument("--num-heads", type=POSITIVE_INT)
    m.add_argument("--mlp-ratio", type=POSITIVE_FLOAT)
    m.add_argument("--drop-path-rate", type=FRACTION)
    m.add_argument("--global-pool", choices=("token", "avg", "avgmax", "max"))
    m.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto")
    m.add_argument("--bf16-residual", dest="residual_in_fp32", action="store_false", default=argparse.SUPPRESS,
                   help="with --amp: keep the residual stream in the autocast dtype (residual_in_fp32=False; "
                        "default: the stream stays fp32, as in timm)")
    m.add_argument("--compile", action="store_true", help="torch.compile the model")
    m.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole training step (forward, loss, backward, clipping, AdamW) in a CUDA graph "
                        "and replay it: no per-step host work (one CUDA process, --accum-steps 1, --amp bf16 or off; "
                        "dropout and drop-path draw fresh masks every step; vit_fast.training.graphs)")
    m.add_argument("--grad-checkpointing", action="store_true", help="recompute block activations in backward")
    m.add_argument("--init-from", metavar="timm:NAME|hf:NAME|file:PATH",
                   help="start from converted weights (hub names must already be in the local cache)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=POSITIVE_INT)
    o.add_argument("--batch-size", type=POSITIVE_INT, help="GLOBAL batch per optimizer step")
    o.add_argument("--accum-steps", type=POSITIVE_INT, default=1, help="gradient accumulation micro-steps per step")
    o.add_argument("--lr", type=POSITIVE_FLOAT, help="peak learning rate (AdamW)")
    o.add_argument("--min-lr", type=NONNEG_FLOAT, default=1e-5, help="end of the cosine decay")
    o.add_argument("--warmup-epochs", type=NONNEG_FLOAT, help="linear warm-up length")
    o.add_argument("--weight-decay", type=NONNEG_FLOAT)
    o.add_argument("--label-smoothing", type=FRACTION, default=0.1)
    o.add_argument("--clip-grad", type=NONNEG_FLOAT, default=1.0, help="max global grad norm (0: off)")
    o.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off",
                   help="autocast dtype (fp16 adds a GradScaler)")
    o.add_argument("--seed", type=NONNEG_INT, default=0)
    r = p.add_argument_group("run")
    r.add_argument("--output-dir", help="run directory (default runs/<dataset>-<time>)")
    r.add_argument("--resume", metavar="PATH|auto", help="checkpoint dir / run dir, or 'auto': newest in --output-dir")
    r.add_argument("--ckpt-every", type=POSITIVE_INT, default=500,
                   help="checkpoint every N steps (and every epoch end)")
    r.add_argument("--keep-checkpoints", type=NONNEG_INT, default=2, help="newest checkpoints kept (0: all)")
    r.add_argument("--stop-at-step", type=POSITIVE_INT,
                   help="checkpoint and exit after this global step (time-sliced jobs)")
    r.add_argument("--eval-every", type=POSITIVE_INT, default=1, help="evaluate every N epochs (and at the end)")
    r.add_argument("--log-every", type=POSITIVE_INT, default=10, help="steps between metric records / progress updates")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--device", type=check_device, help="cpu, cuda, cuda:1... (default: the local GPU if any)")
    r.add_argument("--threads", type=POSITIVE_INT,
                   help="CPU threads for torch ops (default: torch's choice; digits: 1, "
                   "its matrices are too small to gain from more and lose badly on a loaded machine)")
    r.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard per block (needs torchrun)")
    return p


def resolve_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and fill the dataset's defaults. Every option is validated here, with argparse's error (exit 2):
    types and ranges by each option's type, the relations between options below."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.residual_in_fp32 = getattr(args, "residual_in_fp32", True)  # --bf16-residual's default, kept off --help
    warmup_given = args.warmup_epochs is not None
    for key, value in DATASET_DEFAULTS[args.dataset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workers is None:
        args.workers = 0
    if args.weight_decay is None:
        args.weight_decay = 0.05
    if not args.residual_in_fp32 and args.amp == "off":  # the stream is the parameters' dtype without autocast
        parser.error("argument --bf16-residual: only with --amp bf16 or fp16 (without autocast it changes nothing)")
    if args.data_dir and args.dataset != "imagefolder":  # else the folder was silently unused
        parser.error(f"argument --data-dir: only with --dataset imagefolder (got --dataset {args.dataset})")
    if args.min_lr > args.lr:
        parser.error(f"argument --min-lr: expected a value <= --lr ({args.lr}), got {args.min_lr}")
    if warmup_given and args.warmup_epochs > args.epochs:   # (a dataset default longer than a short run is kept)
        parser.error(f"argument --warmup-epochs: expected a value <= --epochs ({args.epochs}), "
                     f"got {args.warmup_epochs}")
    if args.fsdp and not launched_by_torchrun():   # refused before any data loads
        parser.error("argument --fsdp: expected a launch by torchrun (RANK and WORLD_SIZE are not set): "
                     "torchrun --nproc_per_node N -m vit_fast.training.train ... --fsdp")
    if args.cuda_graph:
        wrong = [f"--accum-steps {args.accum_steps} (expected 1)"] * (args.accum_steps != 1) + \
            ["--amp fp16 (its GradScaler synchronises the host; use bf16)"] * (args.amp == "fp16") + \
            ["--compile (--cuda-graph captures the uncompiled step; in your own loop torch.compile(mode="
             "'reduce-overhead') is the compiled way to graphs)"] * args.compile + \
            ["--fsdp"] * args.fsdp
        if wrong:
            parser.error(f"argument --cuda-graph: not with {', '.join(wrong)}")
    return args


# ------------------------------------------------------------------------------------------ distributed
def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class Dist:
    """Rank, world size and device; initialises torch.distributed when launched by torchrun."""

    def __init__(self, device: Optional[str]):
        self.enabled = launched_by_torchrun()
        self.rank = int(os.environ.get("RANK", 0)) if self.enabled else 0
        self.world = int(os.environ.get("WORLD_SIZE", 1)) if self.enabled else 1
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.enabled and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.main = self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(tensor)
        return tensor

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ signals
class StopSignal:
    """SIGINT/SIGTERM set a flag: the loop finishes its step, checkpoints and exits 0. A second SIGINT aborts."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then checkpoint and exit "
              "(Ctrl-C again aborts without a checkpoint)", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ model
def build_model(args: argparse.Namespace, data: DataInfo) -> nn.Module:
    import vit_fast

    overrides = {key: getattr(args, key) for key in MODEL_OVERRIDES if getattr(args, key) is not None}
    overrides.setdefault("img_size", data.img_size)
    overrides.setdefault("in_chans", data.in_chans)
    overrides.setdefault("num_classes", data.num_classes)
    if overrides["img_size"] != data.img_size or overrides["in_chans"] != data.in_chans:
        raise ValueError(f"model expects {overrides['in_chans']}x{overrides['img_size']}px images but the "
                         f"{args.dataset} data gives {data.in_chans}x{data.img_size}px")
    if overrides["num_classes"] < data.num_classes:   # labels >= num_classes would fail inside the loss
        raise ValueError(f"--num-classes {overrides['num_classes']} is fewer than the {args.dataset} data's "
                         f"{data.num_classes} classes (labels 0..{data.num_classes - 1}); expected "
                         f"--num-classes >= {data.num_classes}")
    model = vit_fast.create_model(args.model, backend=args.backend, residual_in_fp32=args.residual_in_fp32,
                                  **overrides)
    if args.init_from:
        for note in ckpt.load_pretrained(model, args.init_from):
            log.info("--init-from: %s", note)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no decay for no_weight_decay() names, norms and biases (every parameter with ndim <= 1)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier: linear warm-up from ~0 to 1, then cosine from 1 to min_ratio at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def wrap_model(model: nn.Module, args: argparse.Namespace, world: Dist) -> nn.Module:
    """Move to the device; DDP or FSDP2 under torchrun; torch.compile last. Returns the module to call."""
    from ..backend import kernels_can_run_on

    if args.backend == "triton" and not kernels_can_run_on(world.device):
        raise ValueError(f"--backend triton needs a CUDA device (or TRITON_INTERPRET=1 on CPU, very slow); this run is "
                         f"on {world.device}: use --backend auto or torch")
    model.to(world.device)
    if args.fsdp:   # resolve_args refused --fsdp outside torchrun
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    elif world.enabled:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model,
                                          device_ids=[world.device.index] if world.device.type == "cuda" else None)
    else:
        wrapped = model
    return torch.compile(wrapped) if args.compile else wrapped


# ------------------------------------------------------------------------------------------ data
@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, world: Dist, autocast) -> dict[str, float]:
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=world.device)   # loss sum, correct, count
    for images, labels, valid in loader:
        images, labels, valid = (t.to(world.device, non_blocking=True) for t in (images, labels, valid))
        with autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="none")
        totals += torch.stack([(loss * valid).sum(), ((logits.argmax(-1) == labels) & valid).sum(), valid.sum()])
    world.all_reduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / max(count, 1), "test_acc": correct / max(count, 1), "test_count": int(count)}


# ------------------------------------------------------------------------------------------ run directory
def default_run_dir(args: argparse.Namespace) -> Path:
    runs = Path("runs")
    if args.resume == "auto":   # newest run directory that has a checkpoint
        candidates = [d for d in runs.glob("*") if ckpt.latest_checkpoint(d / "checkpoints")] if runs.is_dir() else []
        if candidates:
            return max(candidates, key=lambda d: d.stat().st_mtime)
    return runs / f"{args.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


# ------------------------------------------------------------------------------------------ training
def _resume_checkpoint(args: argparse.Namespace, run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume: with 'auto' (or a run / checkpoints directory) the newest intact one, each
    damaged newer one named in a warning and set aside; a checkpoint directory given explicitly must be intact."""
    if args.resume == "auto":
        return ckpt.resumable_checkpoint(run_dir / "checkpoints")
    path = Path(args.resume)
    if path.is_file() and path.name in (ckpt.WEIGHTS, ckpt.STATE):
        path = path.parent
    if (path / ckpt.WEIGHTS).is_file() and (path / ckpt.STATE).is_file():
        ckpt.verify_checkpoint(path)
        return path
    for root in (path, path / "checkpoints"):
        if ckpt.list_checkpoints(root):
            return ckpt.resumable_checkpoint(root)
    return ckpt.resolve_checkpoint(path)   # FileNotFoundError naming what was expected


def load_resume(ckpt_dir: Path, args: argparse.Namespace, model: nn.Module) -> dict[str, Any]:
    """Check the checkpoint belongs to this model and run, load its weights; return the rest of its state."""
    state = ckpt.read_state(ckpt_dir)
    diffs = ckpt.architecture_differences(state["model_config"], ckpt.model_config_dict(model.config))
    if diffs:
        raise ValueError(f"refusing to resume from {ckpt_dir}: it holds a different model ({'; '.join(diffs)})")
    saved = state["args"]
    if saved["batch_size"] != args.batch_size:
        raise ValueError(f"refusing to resume from {ckpt_dir}: --batch-size {args.batch_size} differs from the "
                         f"checkpoint's {saved['batch_size']} "
                         "(the global batch defines the data position and schedule)")
    run_control = {"resume", "output_dir", "stop_at_step", "no_progress", "no_plot", "device", "workers", "threads",
                   "log_every", "ckpt_every", "keep_checkpoints", "eval_every", "compile", "cuda_graph"}
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in vars(args).items()
               if k not in run_control and saved.get(k) != v]
    if changed:
        log.warning("resuming with changed settings: %s", "; ".join(changed))
    load_state_dict(model, ckpt.read_weights(ckpt_dir))   # strict; names every key / shape that differs
    return state


def _sync_context(wrapped: nn.Module, raw: nn.Module, sync: bool):
    """Skip the gradient all-reduce on accumulation micro-steps (DDP no_sync / FSDP2 requires_gradient_sync)."""
    if hasattr(raw, "set_requires_gradient_sync"):   # FSDP2
        raw.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    ddp = getattr(wrapped, "_orig_mod", wrapped)
    return ddp.no_sync() if not sync and hasattr(ddp, "no_sync") else contextlib.nullcontext()


def train(args: argparse.Namespace) -> dict[str, Any]:
    world, threads = Dist(args.device), torch.get_num_threads()
    try:
        return _train(args, world)
    finally:
        world.close()
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace, world: Dist) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from tqdm.auto import tqdm

    t_setup = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    global_batch, accum = args.batch_size, args.accum_steps
    if global_batch % (world.world * accum):
        raise ValueError(f"--batch-size {global_batch} must be divisible by world size x --accum-steps "
                         f"({world.world} x {accum})")
    rank_batch = global_batch // world.world
    data = build_datasets(args.dataset, args.img_size, args.in_chans, args.num_classes, args.data_dir)
    sampler, train_loader, test_loader = build_loaders(data, rank_batch // accum, world.rank, world.world, args.seed,
                                                       args.workers, pin_memory=world.device.type == "cuda")
    steps_per_epoch = sampler.num_samples // rank_batch
    if steps_per_epoch == 0:
        raise ValueError(f"--batch-size {global_batch} is larger than the training set ({len(data.train)} images)")
    total_steps = steps_per_epoch * args.epochs

    run_dir = Path(world.broadcast(str(Path(args.output_dir) if args.output_dir else default_run_dir(args))))
    resume_dir = None
    if args.resume:
        # rank 0 verifies (sizes + sha256 of the manifest), falls back past damaged ones, tells the others
        found: Any = None
        if world.main:
            try:
                found = str(_resume_checkpoint(args, run_dir) or "")
            except (ValueError, FileNotFoundError) as err:   # every rank raises it, none waits in a collective
                found = err
        found = world.broadcast(found)
        if isinstance(found, BaseException):
            raise found
        resume_dir = Path(found) if found else None
        if resume_dir is None and world.main:
            print(f"--resume auto: no checkpoint in {run_dir / 'checkpoints'}, starting from scratch", flush=True)

    torch.manual_seed(args.seed)   # identical initial weights on every rank
    model = build_model(args, data)
    state = load_resume(resume_dir, args, model) if resume_dir else None
    wrapped = wrap_model(model, args, world)
    if args.cuda_graph and (world.device.type != "cuda" or world.enabled):
        raise ValueError(f"--cuda-graph needs one process on a CUDA device; this run has {world.world} process(es) "
                         f"on {world.device.type}")
    # a captured step reads the learning rate from a tensor the scheduler fills in place
    lr = torch.tensor(args.lr, device=world.device) if args.cuda_graph else args.lr
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=lr, betas=(0.9, 0.999),
                                  capturable=args.cuda_graph)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(round(args.warmup_epochs * steps_per_epoch), total_steps, args.min_lr / args.lr))
    scaler = torch.amp.GradScaler(world.device.type, enabled=args.amp == "fp16")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    step, last_eval_epoch, best_acc, last_eval = 0, -1, 0.0, None
    last_train: dict[str, float] = {}
    resumed_window: Optional[torch.Tensor] = None
    window = torch.zeros(3, dtype=torch.float64, device=world.device)   # loss sum, correct, count since the last log
    if state is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(state["scheduler"])
        if args.cuda_graph:  # the checkpoint's groups replaced the run's: capturable, lr a device tensor again
            restore_capturable(optimizer, world.device)
        if scaler.is_enabled() and state["scaler"]:   # empty when the checkpoint ran without fp16
            scaler.load_state_dict(state["scaler"])
        step, last_eval_epoch, best_acc = state["step"], state["last_eval_epoch"], state["best_acc"]
        last_eval = state["last_eval"] or None
        last_train = dict(state.get("last_train") or {})
        if world.main:   # the metrics window open at the checkpoint's step (summed over ranks; rank 0 carries it)
            resumed_window = state.get("train_window")
        if len(state["rng"]) == world.world:
            ckpt.set_rng_state(state["rng"][world.rank])
        else:   # another world size: per-rank streams cannot be mapped, derive fresh ones
            torch.manual_seed(args.seed + 1_000_003 * step + world.rank)
            log.info("checkpoint written by %d process(es), resumed on %d: data order and batches are the same, "
                     "dropout / drop-path streams are re-seeded", len(state["rng"]), world.world)
    else:
        torch.manual_seed(args.seed + world.rank)   # per-rank stream for dropout / drop-path

    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps(vars(args), indent=1))
    metrics = MetricsLog(run_dir / "metrics.jsonl", world.main, step if state is not None else None,
                         last_eval_epoch if state is not None else None)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    autocast = lambda: torch.autocast(world.device.type, dtype=amp_dtype, enabled=amp_dtype is not None)  # noqa: E731
    should_eval = lambda epoch: (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs  # noqa: E731

    def save_checkpoint() -> None:
        weights = get_model_state_dict(model, options=full)       # FSDP2: all ranks gather, rank 0 receives
        optim_state = get_optimizer_state_dict(model, optimizer, options=full)
        open_window = world.all_reduce(window.clone()).cpu()   # the steps since the last metrics record, all ranks
        rngs = [None] * world.world
        if world.enabled:
            dist.all_gather_object(rngs, ckpt.rng_state())
        else:
            rngs = [ckpt.rng_state()]
        if world.main:
            ckpt.write_checkpoint(run_dir / "checkpoints", step, weights, dict(
                optimizer=optim_state, scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), rng=rngs,
                world_size=world.world, args=vars(args), model_config=ckpt.model_config_dict(model.config),
                last_eval_epoch=last_eval_epoch, best_acc=best_acc, last_eval=last_eval or {},
                last_train=last_train, train_window=open_window),
                keep=args.keep_checkpoints)
        world.barrier()

    def run_eval(epoch: int) -> None:
        nonlocal last_eval_epoch, best_acc, last_eval
        last_eval = evaluate(wrapped, test_loader, world, autocast)
        last_eval_epoch, best_acc = epoch, max(best_acc, last_eval["test_acc"])
        metrics.write({"kind": "eval", "step": step, "epoch": epoch + 1, **last_eval})

    if world.main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"vit-fast train: {args.dataset} ({len(data.train)} train / {len(data.test)} test), {args.model} "
              f"{ckpt.model_config_dict(model.config)['img_size']} px, {n_params / 1e6:.2f} M params, "
              f"backend {args.backend}, {world.world} process(es) on {world.device.type}, "
              f"{steps_per_epoch} steps/epoch, run dir {run_dir}"
              + (f", resumed from {resume_dir} at step {step}" if state is not None else ""), flush=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    graph_step = None  # --cuda-graph: captured on the first batch
    stop = StopSignal()
    stopped, train_images, t_train = False, 0, time.perf_counter()
    first_step = step   # a resumed run's rates count only the steps this process runs
    wrapped.train()
    with stop:
        for epoch in range(step // steps_per_epoch, args.epochs):
            start = step - epoch * steps_per_epoch
            if start == 0 and epoch > 0 and last_eval_epoch < epoch - 1 and should_eval(epoch - 1):
                run_eval(epoch - 1)   # resumed at an epoch end whose evaluation had not run yet
            sampler.set_epoch(epoch, start=start * rank_batch)
            batches = iter(train_loader)
            bar = tqdm(total=steps_per_epoch, initial=start, desc=f"epoch {epoch + 1}/{args.epochs}",
                       disable=not world.main or args.no_progress, leave=False, dynamic_ncols=True)
            window.zero_()
            if resumed_window is not None:   # resumed mid-window: the next record covers the same steps
                window.copy_(resumed_window.to(window))
                resumed_window = None
            t_window, window_first_step = time.perf_counter(), step
            for _ in range(start, steps_per_epoch):
                for micro in range(accum):
                    images, labels = next(batches)
                    images = images.to(world.device, non_blocking=True)
                    labels = labels.to(world.device, non_blocking=True)
                    if args.cuda_graph:  # forward, backward, clipping and the optimizer step, replayed
                        if graph_step is None:
                            graph_step = CudaGraphStep(model, optimizer, criterion, images, labels, amp_dtype,
                                                       max_grad_norm=args.clip_grad or None)
                        loss, logits = graph_step(images, labels), graph_step.outputs
                    else:
                        with _sync_context(wrapped, model, sync=micro == accum - 1):
                            with autocast():
                                logits = wrapped(images)
                            loss = criterion(logits.float(), labels)
                            scaler.scale(loss / accum).backward()
                    window += torch.stack([loss.detach() * len(labels), (logits.argmax(-1) == labels).sum(),
                                           torch.full((), len(labels), device=world.device)])  # no H2D copy
                if not args.cuda_graph:
                    if args.clip_grad > 0:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                train_images += global_batch
                bar.update(1)
                if step % args.log_every == 0 or step % steps_per_epoch == 0:
                    loss_sum, correct, count = world.all_reduce(window).tolist()
                    last_train = {"loss": loss_sum / count, "acc": correct / count,
                                  "lr": float(scheduler.get_last_lr()[0]),
                                  # a resumed window's count holds the earlier run's images: not timed here
                                  "img_per_s": (step - window_first_step) * global_batch
                                  / (time.perf_counter() - t_window)}
                    metrics.write({"kind": "train", "step": step, "epoch": epoch + 1, **last_train})
                    bar.set_postfix(loss=f"{last_train['loss']:.3f}", acc=f"{last_train['acc']:.3f}",
                                    lr=f"{last_train['lr']:.2e}", img_s=f"{last_train['img_per_s']:.0f}")
                    window.zero_()
                    t_window, window_first_step = time.perf_counter(), step
                stopped = stop.signum is not None or step == args.stop_at_step
                if world.enabled:   # every rank must stop after the same step
                    stopped = bool(world.all_reduce(torch.tensor([int(stopped)], device=world.device)).item())
                if stopped or step % args.ckpt_every == 0:
                    save_checkpoint()
                if stopped:
                    break
            bar.close()
            if stopped:
                break
            if should_eval(epoch):
                run_eval(epoch)
                if world.main:
                    print(f"epoch {epoch + 1}/{args.epochs}: step {step}, "
                          f"train loss {last_train.get('loss', float('nan')):.4f}, "
                          f"test loss {last_eval['test_loss']:.4f}, test acc {last_eval['test_acc']:.2%}", flush=True)
            save_checkpoint()
        if not stopped and step == total_steps and last_eval_epoch < args.epochs - 1:
            # resumed from a checkpoint of the last step whose final evaluation had not run (killed between them)
            run_eval(args.epochs - 1)
            save_checkpoint()

    t_end = time.perf_counter()
    summary = {"dataset": args.dataset, "model": args.model, "steps": step, "total_steps": total_steps,
               "epochs": args.epochs, "stopped_early": stopped, "train_seconds": t_end - t_train,
               "total_seconds": t_end - t_setup, "img_per_s": train_images / max(t_end - t_train, 1e-9),
               "train_loss": last_train.get("loss"), "test_acc": (last_eval or {}).get("test_acc"),
               "test_loss": (last_eval or {}).get("test_loss"), "best_test_acc": best_acc,
               "run_dir": str(run_dir), "world_size": world.world}
    if world.main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if not args.no_plot and not stopped:
            plot_curves(metrics.records(), run_dir / "curves.png")
        if stopped:
            print(f"stopped at step {step}/{total_steps}; checkpoint in {run_dir / 'checkpoints'}; "
                  f"continue with --resume auto --output-dir {run_dir}", flush=True)
        else:
            acc, seconds = summary["test_acc"], summary["train_seconds"]
            resumed_at = f" (resumed at step {first_step}, now {step})" if first_step else ""
            print(f"done: {args.dataset} {args.model}, {step - first_step} steps{resumed_at} in {seconds:.1f} s "
                  f"({(step - first_step) / max(seconds, 1e-9):.1f} steps/s, {summary['img_per_s']:.0f} img/s), "
                  f"test acc {acc:.2%} (best {best_acc:.2%}), "
                  f"train loss {summary['train_loss']:.4f}; run dir {run_dir}", flush=True)
    return summary


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Parse arguments and train; returns the run summary (used by the tests)."""
    return train(resolve_args(argv))


def cli_main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"vit-fast train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
