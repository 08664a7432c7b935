"""Where a run's progress goes: a rich progress bar, log lines, and optional wandb (offline by default)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("fl_platform")


class Reporter:
    def __init__(self, total_rounds: int, *, progress: bool = True, wandb: bool = False,
                 wandb_project: str = "fl_platform", wandb_mode: str = "offline",
                 run_dir: str | None = None, config: dict[str, Any] | None = None,
                 name: str | None = None, log_every: int = 1, start_round: int = 0) -> None:
        self.log_every = max(1, log_every)
        self._progress = None
        self._task = None
        self._wandb = None
        if progress:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(stderr=True)
            self._progress = Progress(TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                      console=console, transient=False, disable=not console.is_terminal)
            self._task = self._progress.add_task("rounds", total=total_rounds, completed=start_round, status="")
            self._progress.start()
        if wandb:
            import wandb as wb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wb.init(project=wandb_project, mode=wandb_mode, dir=run_dir, config=config,
                                  name=name, reinit=True)

    def round_done(self, row: dict[str, Any]) -> None:
        acc = row.get("test_accuracy")
        status = f"loss {row.get('train_loss', float('nan')):.4f}"
        if acc is not None:
            status += f"  test acc {acc:.4f}"
        if self._progress is not None:
            self._progress.update(self._task, advance=1, status=status)
        if row["round"] % self.log_every == 0 or acc is not None:
            log.info("round %d: %s", row["round"], status)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, int | float) and v is not None},
                            step=row["round"])

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            if summary:
                for k, v in summary.items():
                    if isinstance(v, int | float):
                        self._wandb.summary[k] = v
            self._wandb.finish()
