"""Multi-rank checkpoints through torch.distributed.checkpoint (DCP), with Rewind's integrity.

Every rank writes its own shards (DCP), hashes the files it wrote and reports
their digests; rank 0 writes the manifest, renames the directory and commits it
only after every rank succeeded. A checkpoint saved by W ranks loads into W'
ranks (DCP reshards), optimizer state included.

DCP would pickle non-tensor values (learning rates, betas, steps) and load them
with an unrestricted ``torch.load``; Rewind hands DCP tensors only and keeps
the rest of the tree in JSON (``state.json``). DCP's own ``.metadata`` is still a
pickle. Restore goes through the one restore path (:mod:`rewind.infra.restore`) on rank
0: the copy is held to the manifest digest the catalog recorded (a remote copy is
fetched first); then every rank loads through :class:`rewind.infra.format.dcp.VerifiedReader`,
which reads each file whole, hashes it against the manifest, and only then hands
DCP the bytes, ``.metadata`` unpickled by an unpickler that admits DCP's own
metadata classes and nothing else. The verdict of every rank goes back to rank 0,
which records it against the copy and, if need be, tries the next one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rewind.infra.catalog import commits, leases, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.writer_lease import WriterLease
from rewind.infra.checkpoint import assemble, remotes, spread
from rewind.infra.checkpoint import priority as persist_priority
from rewind.infra.checkpoint.background import BackgroundRunner
from rewind.infra.checkpoint.engine import SaveMode
from rewind.infra.checkpoint.recording import recorded_save
from rewind.infra.checkpoint.send_on import SendOn
from rewind.infra.checkpoint.sharded_load import PER_RANK_PREFIX
from rewind.infra.checkpoint.sharded_restore import ShardedRestoring
from rewind.infra.checkpoint.sharded_save import (
    LeadHooks,
    RankShare,
    failed_share,
    save,
    share_of,
)
from rewind.infra.checkpoint.shells import ShellStager
from rewind.infra.checkpoint.state import environment
from rewind.infra.errors import CatalogUnavailable, ConfigError, RankFailed, RunBusy, is_transient
from rewind.infra.faults import fault_point
from rewind.infra.format import direct, payload, store
from rewind.infra.format import manifest as mf
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.health.layout import Layout, ModelShape
from rewind.infra.restore.execute import Skip

log = logging.getLogger("rewind.sharded")


PER_RANK_DATA = "per-rank"  # a layout record's "data": the loader's state is each rank's own


def per_rank_part(rank: int) -> str:
    """The state part of a rank's own loader state (its own key: restored by the same rank only)."""
    return f"{PER_RANK_PREFIX}{rank}"


def layout_of(
    world: int, given: Layout | None = None, shape: ModelShape | None = None, *, per_rank_data: bool = False
) -> dict[str, Any]:
    """What a checkpoint records of how it was saved: the layout the job reported (data-parallel when it
    reported none), where known the model's shape (for the layout planner of a later rebuild), and
    whether the loader's state is per rank (restorable on the same world size only)."""
    used = given if given is not None and given.world_size == world else Layout(tp=1, pp=1, dp=world)
    out: dict[str, Any] = {**used.as_dict(), **({"model": shape.as_dict()} if shape is not None else {})}
    return {**out, "data": PER_RANK_DATA} if per_rank_data else out


class ShardedCheckpointer(ShardedRestoring):
    """The multi-rank counterpart of ``Checkpointer``: every rank calls every method.

    Rank 0 alone talks to the catalog and runs the restore plan; the others follow
    its broadcasts, so all ranks always load the same checkpoint.
    """

    def __init__(
        self,
        run: str,
        *,
        root: Path,
        catalog: Any = None,
        mode: SaveMode | str = SaveMode.SYNC,
        exit_timeout_s: float = 300.0,
        layout: Layout | None = None,
        model_shape: ModelShape | None = None,
        per_rank_data: bool = False,
        format: str = payload.PLAIN,
    ) -> None:
        self.run = run
        self.format = payload.check_format(format)  # chunked: packs, unchanged items linked (dcp_packs)
        self.root = Path(root).expanduser().resolve()
        self.run_dir = self.root / run
        self.mode = SaveMode(mode)
        priority = persist_priority.configured()  # every rank reads the same environment: all refuse alike
        direct.wanted()  # a bad REWIND_DIRECT_WRITES too, before anything is written
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if layout is not None and layout.world_size != self.world:
            raise ConfigError(f"layout {layout} is {layout.world_size} ranks; this job has {self.world}")
        self.layout = layout_of(
            self.world, layout, model_shape, per_rank_data=per_rank_data
        )  # with every checkpoint
        # Rank 0 leads: it alone holds the catalog and the run's id.
        self.catalog: Catalog | None = None
        self._lead: tuple[Catalog, int] | None = None
        self._lease: WriterLease | None = None
        failed: Exception | None = None
        if self.rank == 0:
            try:
                self.catalog = catalog or Catalog()
                self._lead = (self.catalog, lineage.ensure_run(self.catalog, run))
                self._lease = WriterLease(*self._lead)
            except Exception as exc:  # every rank hears of it (none left waiting for rank 0)
                failed = exc
        self._take_writer(failed)
        try:
            self._start(run, exit_timeout_s, priority, catalog)
        except BaseException:
            if self._lease is not None:  # never held past a construction that failed
                self._lease.release()
            raise

    def _start(
        self, run: str, exit_timeout_s: float, priority: persist_priority.PersistPriority, catalog: Any
    ) -> None:
        """The rest of the construction, once the run's writer lease is held."""
        self._parent_id: int | None = None
        self._parent: tuple[int, str | None] | None = None  # rank 0: (step, manifest digest) of the parent
        self.skipped: tuple[Skip, ...] = ()  # rank 0: what the last restore passed over, and why
        self.restored_checkpoint_id: int | None = None  # rank 0: the checkpoint the last restore loaded
        # Async saves persist in a thread of each rank, talking over a group of their own (gloo: the
        # staged tensors are on the CPU), so that they never interleave with the job's collectives.
        self._group = dist.new_group(backend="gloo") if self.mode is SaveMode.ASYNC else None
        self._stager = ShellStager()
        self._runner = BackgroundRunner(f"rewind-{run}-rank{self.rank}", exit_timeout_s, priority=priority)
        self.last_stall_s: float | None = None
        self.disks = spread.discover(self.root)  # the hosts' own disks, or one disk for every rank
        # a spread restore sends files' bytes between ranks as CPU tensors: over gloo, whatever the job's backend
        self._files_group = (self._group or dist.new_group(backend="gloo")) if self.disks.spread else None
        self.sources: list[assemble.Sources] = []  # rank 0: where the last restore's bytes came from
        self.read_from: dict[str, Any] = {}  # rank 0: the same, for the record (``assemble.read_from``)
        self._remote: remotes.RemoteFiles | None = None  # rank 0: the last restore's fetcher of lost files
        self.loaded: dict[str, int] = {}  # the last load's bytes from memory and disk, every rank's summed
        self._read_whole = True  # rank 0: whether its disk's ranks read that copy there, none from memory
        self.send_on = SendOn(self.run, self.run_dir, self.disks, catalog=catalog if self.rank else self.catalog,
                              exit_timeout_s=exit_timeout_s, background=self.mode is SaveMode.ASYNC,
                              behind=self._runner)  # fmt: skip
        if self.disks.leads(self.rank):
            store.sweep_temp(self.run_dir)
        dist.barrier()

    def _take_writer(self, failed: Exception | None) -> None:
        """Rank 0 takes the run's writer lease; every rank learns whether it was refused, or whether rank 0
        could not reach its catalog (``failed``): none goes on alone, none waits for rank 0."""
        refused = ""
        if failed is None and self._lease is not None:
            try:
                self._lease.take()
            except RunBusy as exc:
                refused = str(exc)
            except Exception as exc:
                failed = exc
        why = f"{type(failed).__name__}: {failed}" if failed is not None else ""
        box: list[Any] = [(refused, why, failed is not None and is_transient(failed))]
        dist.broadcast_object_list(box, src=0)
        refused, why, transient = box[0]
        if failed is not None:
            raise failed
        if why:  # a catalog that blinked is retried like rank 0's own error, on every rank
            raise (CatalogUnavailable if transient else RankFailed)(
                f"rank 0 could not begin saving run {self.run!r}: {why}"
            )
        if refused:
            raise RunBusy(refused)

    def save(
        self,
        step: int,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> float:
        """Collective: a checkpoint of ``state`` (and this rank's ``rank_state``) at ``step``; returns
        the seconds the caller was blocked.

        Sync: returns on every rank once the checkpoint is committed (by default the peer ring's pass, if
        any, then runs on this rank's background runner, which the next save, a restore, ``wait`` and
        ``close`` wait for: ``close`` must come before the process group is destroyed). Async: returns once this rank's
        tensors are copied into its staging shells and its JSON is serialised (later changes never
        reach the checkpoint); the rank then writes and hashes in the background, and rank 0 commits
        once every rank reported its digests. A save asked for while the previous one is still
        persisting waits for it (one save in flight, one staging copy); a background failure is raised
        by the next ``save``, ``wait``, restore or ``close``, on every rank.
        """
        started = time.perf_counter()
        metrics = dict(metrics or {})  # frozen at the call, like the state
        if self.mode is SaveMode.SYNC:
            self._runner.wait()  # the previous save's ring pass, if still running: one at a time, in order
            self._persist(step, self._share(state, rank_state), metrics, None)
            dist.barrier()  # no rank goes on before the checkpoint is committed
            self.last_stall_s = time.perf_counter() - started
            return self.last_stall_s
        self._runner.wait()  # back-pressure: the shells are the previous save's until it is done
        share = self._share(state, rank_state)
        ready: Callable[[], None] = lambda: None  # noqa: E731
        if share.error is None:
            try:
                staged = self._stager.stage(share.tensors)
                share, ready = RankShare(staged.tensors, share.shared_json, share.rank_json), staged.ready
            except Exception as exc:  # told to every rank by the save itself, never a rank left out
                share = failed_share(exc)
        stall = time.perf_counter() - started
        self.last_stall_s = stall

        def persist() -> None:
            ready()
            self._persist(step, share, metrics, stall)

        self._runner.submit(f"sharded save of step {step}", persist)
        return stall

    def prepare(self, state: dict[str, Any]) -> None:
        """Async mode: this rank's staging shells for ``state`` as it is now, allocated and made resident
        in the background, so that the first save stalls for a copy alone (``Checkpointer.prepare``). Not a
        collective; a save waits for it. Never fails the job: while a save is in flight or its failure is
        still to be raised, it does nothing; the first save allocates the shells then."""
        if self.mode is not SaveMode.ASYNC or not self._runner.idle:
            return
        share = self._share(state, {})
        if share.error is not None:  # the save that needs it says why, on every rank
            return
        self._runner.submit("staging shells", lambda: self._prepare(share.tensors))

    def _prepare(self, tensors: dict[str, torch.Tensor]) -> None:
        try:
            self._stager.prepare(tensors)
        except Exception as exc:  # never raised by a save (on one rank alone): the first save allocates
            log.warning("staging shells not prepared: %s", exc)

    def _share(self, state: dict[str, Any], rank_state: dict[str, Any]) -> RankShare:
        """This rank's share, or its error as a share: a rank that cannot save still takes part in the
        save's collectives, so every rank learns of it and none waits on it."""
        try:
            return share_of(state, rank_state, self.rank)
        except Exception as exc:
            return failed_share(exc)

    def _persist(self, step: int, share: RankShare, metrics: dict[str, float], stall: float | None) -> None:
        layout = self.layout
        kw: dict[str, Any] = {
            "layout": layout, "metrics": metrics, "group": self._group, "disks": self.disks, "fmt": self.format,
        }  # fmt: skip
        if self._lead is None:
            save(self.run_dir, self.run, step, share, **kw)
            self.send_on.after_commit(step, self._group, None, None)
            return
        cat, run_id = self._lead
        with contextlib.ExitStack() as stack:
            row: list[int] = []
            displacers: list[Callable[[Path], None]] = []  # the row's, once begun

            def begin() -> None:
                fault_point("save.before_catalog", step)  # rank 0 alone: its catalog fails, not the ranks
                ck_id, _, displace = stack.enter_context(recorded_save(
                    cat, run_id, self.run_dir, step, parent_id=self._parent_id, layout=layout,
                    environment=environment(), writer=leases.writer_name(),
                ))  # fmt: skip
                row.append(ck_id)
                displacers.append(displace)

            def commit(final: Path, digest: str, also_on: Sequence[tuple[str, LocalTier]]) -> None:
                commits.commit(
                    cat, row[0], mf.read(final), digest=digest, stall_s=stall, uri=str(final),
                    writer=leases.writer_name(), also_on=also_on,
                )  # fmt: skip
                if self._lease is not None:
                    self._lease.touch()

            _, digest = save(
                self.run_dir,
                self.run,
                step,
                share,
                parent=self._parent,
                lead=LeadHooks(begin, commit, self._lead_aside, lambda final: displacers[0](final)),
                **kw,
            )
            self._parent_id, self._parent = row[0], (step, digest)
        self.send_on.after_commit(step, self._group, cat, self._parent_id, digest=digest)

    def wait(self) -> None:
        """Block until this rank's in-flight background work ended (an async save's persist, a sync save's
        ring pass); raise if a save failed."""
        self._runner.wait()

    def close(self) -> None:
        """Wait for an in-flight save (or ring pass), then let another process write this run (rank 0 holds
        the writer lease). Must come before the process group is destroyed: a pass still running talks over
        a group of its own."""
        try:
            self._runner.close()
            self.send_on.close()
        finally:
            if self._lease is not None:
                self._lease.release()
