"""Where a run's progress goes: a rich progress bar, log lines, and optional wandb (offline by default).

A run with a run dir keeps its wandb run id in ``<run dir>/wandb_id``. A resumed run
(``start_round > 0``) continues that wandb run (``wandb.init(id=..., resume="allow")``), so its
rounds land in the same run; a run that starts at round 1 gets a new id. Offline, each process
writes its own ``wandb/offline-run-*`` folder with the same id, and ``wandb sync <run dir>/wandb``
uploads them into that one run in order. Rounds logged after the checkpoint and before the kill
are logged again on resume with the same results (the timing fields may differ); wandb keeps
the first ones.
"""

from __future__ import annotations

import logging
import os
import secrets
import string
from typing import Any

from fl_platform.outputs import RunDir, atomic_write_text

log = logging.getLogger("fl_platform")


class Reporter:
    def __init__(self, total_rounds: int, *, progress: bool = True, wandb: bool = False,
                 wandb_project: str = "fl_platform", wandb_mode: str = "offline",
                 run_dir: str | None = None, config: dict[str, Any] | None = None,
                 name: str | None = None, log_every: int = 1, start_round: int = 0) -> None:
        self.log_every = log_every  # a log line every k rounds and the last (check_run: k >= 1)
        self.total_rounds = total_rounds
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
            run_id, resume = wandb_run_id(run_dir, start_round)
            self._wandb = wb.init(project=wandb_project, mode=wandb_mode, dir=run_dir, config=config, name=name,
                                  id=run_id, resume=resume, reinit="create_new")

    def round_done(self, row: dict[str, Any]) -> None:
        acc = row.get("test_accuracy")
        status = f"loss {row.get('train_loss', float('nan')):.4f}"
        if acc is not None:
            status += f"  test acc {acc:.4f}"
        if self._progress is not None:
            self._progress.update(self._task, advance=1, status=status)
        if row["round"] % self.log_every == 0 or row["round"] == self.total_rounds:
            log.info("round %d: %s", row["round"], status)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, int | float) and v is not None},
                            step=row["round"])

    def close(self, summary: dict[str, Any] | None = None, failed: bool = False) -> None:
        """Stop the progress bar and finish the wandb run (marked failed when the run raised)."""
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            if summary:
                for k, v in summary.items():
                    if isinstance(v, int | float):
                        self._wandb.summary[k] = v
            self._wandb.finish(exit_code=1 if failed else 0)


def wandb_run_id(run_dir: str | os.PathLike[str] | None, start_round: int) -> tuple[str | None, str | None]:
    """(id, resume) for ``wandb.init``: the id stored in ``run_dir`` when resuming after round
    ``start_round`` > 0, else a new id, stored there (no run dir: wandb picks one)."""
    if run_dir is None:
        return None, None
    path = RunDir(run_dir).wandb_id
    stored = path.read_text().strip() if path.exists() else ""
    if start_round > 0 and stored:
        return stored, "allow"
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # wandb's form
    atomic_write_text(path, run_id + "\n")
    return run_id, None
