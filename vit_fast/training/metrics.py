"""Metrics file and curves of a `vit-fast train` run (written by rank 0)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


class MetricsLog:
    """metrics.jsonl of the run (rank 0 only). On resume, records past the checkpoint's step are dropped."""

    def __init__(self, path: Path, enabled: bool, resume_step: Optional[int]):
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif enabled:
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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
