"""Metrics file and curves of a `vit-fast train` run (written by rank 0)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def _parse(line: str) -> Optional[dict[str, Any]]:
    """A record, or None for a line cut short by a kill during its write."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class MetricsLog:
    """metrics.jsonl of the run (rank 0 only). On resume, records the checkpoint does not cover are dropped:
    those past its step, evaluations after its last evaluated epoch (they run again), a half-written line."""

    def __init__(self, path: Path, enabled: bool, resume_step: Optional[int], last_eval_epoch: Optional[int] = None):
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None and path.is_file():
            kept = []
            for line in path.read_text().splitlines():
                record = _parse(line)
                if record is None or record.get("step", 0) > resume_step:
                    continue
                if (record.get("kind") == "eval" and last_eval_epoch is not None
                        and record.get("epoch", 0) > last_eval_epoch + 1):
                    continue
                kept.append(line)
            path.write_text("".join(line + "\n" for line in kept))
        elif enabled:
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        return [r for r in map(_parse, self.path.read_text().splitlines()) if r is not None]


def plot_curves(records: list[dict[str, Any]], path: Path) -> None:
    """Loss and accuracy against the step: train (per --log-every window) and test (per evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    test = [r for r in records if r["kind"] == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    ax_loss.plot([r["step"] for r in test], [r["test_loss"] for r in test], "o-", label="test")
    ax_acc.plot([r["step"] for r in train], [r["acc"] for r in train], label="train")
    ax_acc.plot([r["step"] for r in test], [r["test_acc"] for r in test], "o-", label="test")
    for ax, name in ((ax_loss, "loss (train: label-smoothed CE, test: CE)"), (ax_acc, "accuracy")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
