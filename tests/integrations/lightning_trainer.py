"""The tests' Lightning fit: ``examples/lightning_train.py`` with a kill and a dump of the end.

``--kill-at STEP`` (repeatable): the process SIGKILLs itself at the end of that optimizer step,
the first time only (``--kill-marker DIR`` gets a file for it just before: a restarted attempt
finds it and trains on). ``--dump PATH`` saves rank 0's final model and optimizer state (``torch.save``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import lightning_train


class KillOnce(L.Callback):
    def __init__(self, steps: list[int], markers: Path) -> None:
        self.steps, self.markers = steps, markers

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        marker = self.markers / f"killed_at_{trainer.global_step}"
        if trainer.global_step in self.steps and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=int, action="append", default=[])
    parser.add_argument("--kill-marker", type=Path)
    parser.add_argument("--dump", type=Path)
    ours, rest = parser.parse_known_args()
    callbacks = [KillOnce(ours.kill_at, ours.kill_marker)] if ours.kill_at else []
    trainer, model = lightning_train.main(rest, callbacks)
    if ours.dump is not None and trainer.is_global_zero:
        state = {"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
        torch.save(state, ours.dump)


if __name__ == "__main__":
    main()
