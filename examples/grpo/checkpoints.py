"""Where a run leaves its checkpoints, and how far a checkpoint got: what a resume goes on from."""

from __future__ import annotations

import json
from pathlib import Path

from grpo.config import GRPOError

# Written into each checkpoint: a loop resumed from it goes on with the next iteration
# (its prompts, its seeds, its checkpoint's name), not from iteration 1 again.
PROGRESS_FILE = "grpo_progress.json"
# Beside it, what the weights alone do not carry: the optimizer's moments and the KL
# reference (the first run's initial policy), so a resumed loop trains as one that went on.
TRAINER_STATE_FILE = "grpo_trainer_state.pt"


def check_out_dir(out_dir: Path, done: int, source: Path) -> None:
    """Refuse to run where another run's later checkpoints lie: this run's ``iter-K``
    would overwrite them, and its cleanup remove them."""
    later = sorted(
        (
            p
            for p in out_dir.glob("iter-*")
            if p.is_dir() and p.resolve() != source.resolve() and p.suffix != ".partial"
        ),
        key=lambda p: p.name,
    )
    later = [p.name for p in later if iterations_done(p) > done]
    if later:
        raise GRPOError(
            f"--out-dir {str(out_dir)!r} holds checkpoints of another run ({', '.join(later)}) that this "
            "run would overwrite: pass another --out-dir, or --resume from the latest of them"
        )


def iterations_done(path: Path) -> int:
    """The iteration a checkpoint of this loop ends (its PROGRESS_FILE); 0 for other weights."""
    file = path / PROGRESS_FILE
    if not file.is_file():
        return 0
    try:
        done = json.loads(file.read_text())["iteration"]
    except (ValueError, KeyError, TypeError):
        done = None
    if not isinstance(done, int) or isinstance(done, bool) or done < 1:
        raise GRPOError(f'{file} is damaged: expected {{"iteration": K}} with K >= 1')
    return done
