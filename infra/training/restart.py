"""In-process restart: a step that raises is undone by restoring the newest checkpoint in the same process.

``TrainingSession.train(step, total, restarts=N)`` runs ``step(i, batch)`` for every step left (the session
draws the batches from its loader, reports each loss, saves when due). An exception a step raises (a
transient device error, an out-of-memory on an odd batch) does not end the process: the newest checkpoint
that proves itself is restored into the live model, optimizer, loader position and random generators,
from the nearest tier, every byte hashed, and the loop goes on from it, at most ``N`` times; the restarts
are told to the supervisor with the rank's progress (``restarts``). The interpreter, the imports, the
device context and the job's own start-up are kept: the restart costs the restore alone.

Its limits: one process only (a rank of a distributed job cannot leave a collective its peers are in:
those come back through the supervisor's relaunch); an anomaly (NaN, spike) is not restarted here (the
supervisor rolls back past the bad data); no checkpoint yet, nothing to restart from: the error is raised;
``KeyboardInterrupt`` and ``SystemExit`` always end the job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from rewind.infra.errors import ConfigError

if TYPE_CHECKING:
    from rewind.infra.training.session import TrainingSession

log = logging.getLogger("rewind.session")
Step = Callable[[int, Any], float | None]


def run(session: TrainingSession, step: Step, total: int, restarts: int) -> int:
    """The loop of ``TrainingSession.train``; the last step run."""
    if restarts < 0:
        raise ConfigError("restarts cannot be negative")
    if restarts and session.distributed:
        raise ConfigError(
            "in-process restart takes one process: a rank cannot leave a collective its peers are in "
            "(a distributed job comes back through the supervisor's relaunch)"
        )
    if session.loader is None:
        raise ConfigError("TrainingSession.train draws the batches: give the session a loader")
    from rewind.infra.training.session import TrainingAnomaly  # the session's own module imports this one

    done, used = session.start_step, 0
    while True:
        failed: Exception | None = None
        try:
            for i, batch in zip(session.steps(total), _batches(session), strict=False):
                session.report(i, step(i, batch))
                done = i
            return done
        except (TrainingAnomaly, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            if used >= restarts:
                raise
            failed = exc
        used += 1  # out of the handler: the failed step's frames (its activations) are let go first
        done = _restore(session, failed, used)
        failed = None


def _batches(session: TrainingSession) -> Iterator[Any]:
    loader: Any = session.loader
    return iter(loader)  # a new iterator: from the loader's position now


def _restore(session: TrainingSession, exc: Exception, count: int) -> int:
    """The newest checkpoint back in place (or the error raised: nothing to go back to); its step."""
    after = session.last_step  # the newest step reported: the one after it raised
    step = session.restart_from_newest()
    if step is None:
        raise exc
    log.warning(
        "the step after %s of %s raised %s: %s; restored step %d in this process (restart %d)",
        after, session.run, type(exc).__name__, exc, step, count,
    )  # fmt: skip
    session.note_restart(
        count=count, after_step=after, restored_step=step, error=f"{type(exc).__name__}: {exc}"
    )
    return step


def undo_step(part: Any) -> None:
    """What a failed step left in ``part`` outside its checkpointed state: its gradients, and a
    ``GradScaler``'s record of the optimizers it unscaled since its last ``update()`` (its
    ``load_state_dict`` keeps that record, and the retried step's ``unscale_`` would be refused)."""
    if hasattr(part, "zero_grad"):
        part.zero_grad(set_to_none=True)
    if isinstance(part, torch.amp.GradScaler) and part.is_enabled():  # a disabled one keeps no record
        part._per_optimizer_states.clear()  # a defaultdict: each optimizer's record starts afresh
