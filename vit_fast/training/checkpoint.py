"""Crash-safe training checkpoints for `vit-fast train`.

Layout of a run directory::

    RUN/checkpoints/step_00000440/model.safetensors   model weights (full, unsharded, fp32 as trained)
    RUN/checkpoints/step_00000440/state.pt            everything else, loadable with torch.load(weights_only=True)
    RUN/checkpoints/step_00000440/manifest.json       size and sha256 of the two files above
    RUN/checkpoints/latest                            text file: the name of the newest complete checkpoint

``state.pt`` holds plain types and tensors only: the optimizer state (keyed by parameter name, the
"full" state dict of torch.distributed.checkpoint.state_dict, so it loads into a single process, DDP or
FSDP2 at any world size), the LR scheduler, the GradScaler, the global step, the RNG states of every
rank (as uint8/int64 tensors), the run's arguments and the model's configuration.

Atomicity: a checkpoint is written into ``step_N.tmp``, every file fsync'ed, then the directory is
renamed with os.replace and the ``latest`` pointer is replaced the same way. A kill at any moment leaves
either the previous checkpoint or the new one, never a half-written one that ``--resume auto`` would pick.
With FSDP2 every rank takes part in gathering the full state dict; with any wrapper only rank 0 writes.

Verification: after the files are written and fsync'ed they are read back and hashed; their sizes and
sha256 go into ``manifest.json`` (written last, inside the temporary directory). ``verify_checkpoint``
checks them again; ``resumable_checkpoint`` (``--resume auto``) takes the newest checkpoint that passes,
warns naming every damaged one and renames it ``step_N.damaged`` (kept for inspection, never picked
again); if checkpoints exist but none is intact it raises CheckpointError instead of starting over.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..interop.convert import CheckpointError, tensors_to_save

log = logging.getLogger("vit_fast.training.checkpoint")

FORMAT = "vit_fast.training.train/1"
WEIGHTS, STATE, LATEST, MANIFEST = "model.safetensors", "state.pt", "latest", "manifest.json"
# ViTConfig fields that do not change the parameters: a checkpoint may be resumed with other values.
NON_ARCH_FIELDS = {"backend", "weight_init", "drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate",
                   "drop_path_rate", "dynamic_img_size", "residual_in_fp32"}


# ----------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and ints (torch, CUDA, numpy, python `random`)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # the current device only: querying every visible GPU would create a context on each of them
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": py_gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"][0])
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))


# ------------------------------------------------------------------------------------------ config
def model_config_dict(config) -> dict[str, Any]:
    """A ViTConfig as plain types (tuples become lists), for the checkpoint and for comparisons."""
    import dataclasses

    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(config).items()}


def architecture_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'field: checkpoint X, this run Y' for every parameter-shaping field that differs."""
    keys = sorted((set(saved) | set(current)) - NON_ARCH_FIELDS)
    return [f"{key}: checkpoint {saved.get(key, '<absent>')!r}, this run {current.get(key, '<absent>')!r}"
            for key in keys if saved.get(key, "<absent>") != current.get(key, "<absent>")]


# ------------------------------------------------------------------------------------------ writing
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


def write_checkpoint(ckpt_root: str | Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, Any],
                     keep: int = 3) -> Path:
    """Write ``weights`` (safetensors) and ``state`` (torch.save) as checkpoint ``step``; keep the newest ``keep``."""
    from safetensors.torch import save_file

    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)   # leftover of a run killed while writing
    tmp.mkdir()
    save_file(tensors_to_save(weights), str(tmp / WEIGHTS),
              metadata={"format": "pt", "producer": FORMAT, "step": str(step)})
    torch.save({"format": FORMAT, "step": step, **state}, tmp / STATE)
    for name in (WEIGHTS, STATE):
        _fsync(tmp / name)
    files = {name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in (WEIGHTS, STATE)}
    _check_readable(tmp)   # read back: a file the readers reject is never published
    (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    _fsync(tmp / MANIFEST)
    if final.exists():   # same step written twice (step interval and epoch end): swap, then drop the old one
        old = root / f"step_{step:08d}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(root)
    _replace_text(root / LATEST, final.name + "\n")
    for stale in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_readable(ckpt_dir: Path) -> None:
    """Both files parse (the safetensors header covers the file; state.pt is a complete torch.save archive)."""
    from ..interop.convert import sniff_checkpoint_format

    weights = Path(ckpt_dir) / WEIGHTS
    if sniff_checkpoint_format(weights) != "safetensors":
        raise CheckpointError(f"{weights}: expected a safetensors file")
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except Exception as err:
        raise CheckpointError(f"{weights}: damaged safetensors file ({type(err).__name__}: {err})") from err
    state = Path(ckpt_dir) / STATE
    if sniff_checkpoint_format(state) == "torch-zip":
        import zipfile

        if not zipfile.is_zipfile(state):
            raise CheckpointError(f"{state}: truncated or damaged torch.save file (no zip central directory)")


def verify_checkpoint(ckpt_dir: str | Path) -> None:
    """CheckpointError naming the damaged file unless every file has its manifest's size and sha256.
    A checkpoint written before manifests existed is only checked for readable headers."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        _check_readable(ckpt_dir)
        return
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path}: damaged manifest ({type(err).__name__}: {err})") from None
    for name, expected in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"{path}: {size} bytes, expected {expected['size']} (truncated or overwritten)")
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from {MANIFEST} (the file's bytes are damaged)")


def resumable_checkpoint(ckpt_root: str | Path) -> Optional[Path]:
    """The newest checkpoint under ``ckpt_root`` that passes verify_checkpoint, or None when there is none at
    all. Each damaged newer one is logged as a warning naming it and renamed ``step_N.damaged``; if every
    checkpoint is damaged, CheckpointError (never a silent fresh start)."""
    root = Path(ckpt_root)
    damaged = []
    for candidate in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(candidate)
        except CheckpointError as err:
            aside = candidate.with_name(candidate.name + ".damaged")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(candidate, aside)
            log.warning("checkpoint %s is damaged (%s); moved to %s, falling back to the previous one",
                        candidate, err, aside.name)
            damaged.append(f"{candidate.name}: {err}")
            continue
        if damaged:
            _replace_text(root / LATEST, candidate.name + "\n")
        return candidate
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {root}; every one is damaged (renamed *.damaged): "
                              + "; ".join(damaged))
    return None


# ------------------------------------------------------------------------------------------ reading
def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first (temporary directories are not complete)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()
             and (p / WEIGHTS).is_file() and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(ckpt_root: str | Path) -> Optional[Path]:
    root = Path(ckpt_root)
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / WEIGHTS).is_file() and (candidate / STATE).is_file():
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, its state.pt / model.safetensors, a checkpoints/ folder or a run directory."""
    path = Path(path)
    if path.is_file() and path.name in (WEIGHTS, STATE):
        path = path.parent
    if (path / WEIGHTS).is_file() and (path / STATE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise FileNotFoundError(f"no complete checkpoint (a directory with {WEIGHTS} and {STATE}) at {path}")


def read_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The training state of a checkpoint, loaded with torch.load(weights_only=True): no pickled code runs.
    A damaged file raises CheckpointError naming it."""
    from ..interop.convert import _read_raw, sniff_checkpoint_format

    path = Path(ckpt_dir) / STATE
    state = _read_raw(str(path), sniff_checkpoint_format(path))
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        state = state if isinstance(state, dict) else {}
        raise CheckpointError(f"{ckpt_dir}/{STATE} is not a vit_fast training checkpoint (format "
                              f"{state.get('format')!r}, expected {FORMAT!r})")
    return state


def read_weights(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint; a damaged file raises CheckpointError naming it."""
    from ..interop.convert import read_state_dict

    return read_state_dict(Path(ckpt_dir) / WEIGHTS)


# ------------------------------------------------------------------------------------------ fine-tuning
def _offline_hub() -> None:
    """No network here (and on many clusters): hub look-ups must use the local cache or fail at once."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import huggingface_hub.constants as hub_constants
        hub_constants.HF_HUB_OFFLINE = True
    except ImportError:
        pass


def pretrained_state_dict(spec: str) -> dict[str, torch.Tensor]:
    """timm-keyed weights for ``--init-from timm:NAME | hf:NAME | file:PATH``.

    Hub names are looked up in the local Hugging Face cache only (offline mode): a name that is not
    there fails immediately with a message saying how to provide the file, instead of hanging on the network.
    """
    from ..interop import convert

    kind, sep, name = spec.partition(":")
    if not sep or not name or kind not in ("timm", "hf", "file"):
        raise ValueError(f"--init-from {spec!r}: expected timm:NAME, hf:NAME or file:PATH")
    if kind == "file":
        if not os.path.exists(name):
            raise FileNotFoundError(f"--init-from {spec!r}: no such file")
        # read_state_dict: the format from the bytes; a directory, damaged file or pickled code -> CheckpointError
        return convert.to_timm_state_dict(convert.read_state_dict(name))
    _offline_hub()
    try:
        if kind == "timm":
            import timm

            source = timm.create_model(name, pretrained=True)
            return convert.from_timm(source).state_dict()
        from transformers import ViTForImageClassification

        source = ViTForImageClassification.from_pretrained(name, local_files_only=True)
        return convert.from_hf(source).state_dict()
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"--init-from {spec!r}: the weights are not in the local Hugging Face cache and the hub "
                         f"is not contacted (offline). Download them on a connected machine (e.g. "
                         f"`huggingface-cli download ...` or save the model's state_dict) and pass "
                         f"--init-from file:PATH. ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None


def load_pretrained(model, spec: str) -> list[str]:
    """Load ``--init-from`` weights into ``model`` for fine-tuning; returns notes on what was adapted.

    A head of another class count is left at its fresh initialisation, a position embedding of another
    grid is resampled (bicubic, as timm), patch-embedding weights for another channel count are summed
    (1 channel) or tiled (timm's adapt_input_conv), the final norm moves between ``norm`` and ``fc_norm``
    when the pooling differs. Everything else must match exactly.
    """
    from ..interop.convert import load_state_dict
    from ..layers import resample_abs_pos_embed

    sd = pretrained_state_dict(spec)
    own = model.state_dict()
    notes = []
    for key in ("head.weight", "head.bias"):
        if key in sd and (key not in own or sd[key].shape != own[key].shape):
            sd.pop(key)
            notes.append(f"{key} re-initialised ({tuple(own[key].shape) if key in own else 'no head'})")
        if key in own and key not in sd:
            sd[key] = own[key]
    for src, dst in (("norm", "fc_norm"), ("fc_norm", "norm")):   # token pooling <-> average pooling
        if (f"{src}.weight" in sd and f"{src}.weight" not in own
                and f"{dst}.weight" in own and f"{dst}.weight" not in sd):
            for part in ("weight", "bias"):
                sd[f"{dst}.{part}"] = sd.pop(f"{src}.{part}")
            notes.append(f"final {src} moved to {dst} (pooling {model.global_pool!r})")
    pos = sd.get("pos_embed")
    if pos is not None and "pos_embed" in own and pos.shape != own["pos_embed"].shape:
        prefix = 0 if model.config.no_embed_class else model.config.num_prefix_tokens
        sd["pos_embed"] = resample_abs_pos_embed(pos, model.patch_embed.grid_size, num_prefix_tokens=prefix)
        notes.append(f"pos_embed resampled {tuple(pos.shape)} -> {tuple(sd['pos_embed'].shape)}")
    weight = sd.get("patch_embed.proj.weight")
    if weight is not None and weight.shape[1] != own["patch_embed.proj.weight"].shape[1]:
        chans = own["patch_embed.proj.weight"].shape[1]
        adapted = weight.sum(1, keepdim=True) if chans == 1 else \
            weight.repeat(1, math.ceil(chans / weight.shape[1]), 1, 1)[:, :chans] * (weight.shape[1] / chans)
        sd["patch_embed.proj.weight"] = adapted
        notes.append(f"patch_embed.proj.weight adapted to {chans} input channel(s)")
    load_state_dict(model, sd)
    return notes
