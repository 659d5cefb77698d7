"""The restore half of the multi-rank checkpointer (``ShardedCheckpointer``): rank 0 leads the one restore path
(:mod:`rewind.infra.restore`), the other ranks follow its broadcasts, and every try is collective: every rank
loads (spread over hosts' disks, its own disk's copy completed from the others' first), every verdict is
gathered, and rank 0 records it against the copy and, if need be, tries the next one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra.catalog import lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import assemble, remotes, ring_held, spread
from rewind.infra.checkpoint.background import BackgroundRunner
from rewind.infra.checkpoint.send_on import SendOn
from rewind.infra.checkpoint.sharded_load import CheckpointFailures, load, unwrap
from rewind.infra.errors import ConfigError, CorruptCheckpoint, NoRestorableCheckpoint, RankFailed
from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.format.digest import manifest_digest
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.format.nearest import Nearest
from rewind.infra.format.verify import Finding, Problem
from rewind.infra.restore import execute as restore_exec
from rewind.infra.restore import plan as restore_plan
from rewind.infra.restore.execute import Skip

StateTree = dict[str, Any] | Callable[[], dict[str, Any]]


class ShardedRestoring:
    """What ``ShardedCheckpointer`` restores with; its attributes are the checkpointer's (set in its
    construction)."""

    run: str
    root: Path
    run_dir: Path
    rank: int
    world: int
    disks: spread.Disks
    send_on: SendOn
    _lead: tuple[Catalog, int] | None  # rank 0's catalog and run id
    _runner: BackgroundRunner
    _parent_id: int | None
    _parent: tuple[int, str | None] | None
    skipped: tuple[Skip, ...]
    restored_checkpoint_id: int | None
    sources: list[assemble.Sources]
    read_from: dict[str, Any]
    _remote: remotes.RemoteFiles | None
    loaded: dict[str, int]
    _read_whole: bool
    _files_group: Any  # the gloo group a spread restore's files travel over (None: not spread)

    def restore_latest(
        self, state: StateTree, *, target: restore_plan.RestoreTarget | None = None
    ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """(step, restored tree, this rank's state) of the newest checkpoint that proves itself, or None.

        ``state`` is the tree to load into, or a function that builds it: called (on every
        rank at once) only when there is a checkpoint to load, so a fresh run never pays
        for it (asking an optimizer for its state dict initialises its state). ``target``: the
        restore point a recovery chose (rank 0 plans from it; ``restored_checkpoint_id`` says what
        was loaded).
        """
        self._runner.wait()  # a load never races a save of this run still in flight
        self.send_on.settle()  # nor a pass of the hosts' memory agents
        if self.rank == 0:
            return self._lead_restore(state, target)
        return self._follow_restore(state)

    def _attempt(
        self,
        directory: Path,
        manifest: mf.Manifest,
        raw: bytes,
        state: StateTree,
        remote: remotes.RemoteFiles | None = None,
    ) -> Any:
        """One collective try: every rank loads, every verdict is gathered; rank 0 raises the worst.

        Spread over hosts' disks, each rank loads its own disk's copy, completed from the others' first
        (``assemble``); ``directory`` is rank 0's choice, used by the ranks on its disk."""
        mine: Any = None
        into: Any = None
        error: BaseException | None = None
        reads, tier_id = Nearest(directory), ""
        try:
            if self.disks.spread:
                own = self.disks.leader(self.rank) == self.disks.leader(0)
                here = directory if own else store.step_dir(self.run_dir, manifest.step)
                leads = self._lead is not None
                done = assemble.complete(here, raw, manifest, self.disks, remote, group=self._files_group,
                                         refused=self._lead_refused if leads else None,
                                         displaced=self._displaced(raw) if leads else None,
                                         put_back=self._put_back if leads else None)  # fmt: skip
                directory, self.sources = done.directory, done.sources
                reads, tier_id = Nearest(directory, done.nearer), done.tier_id  # this node's memory first
            into = state() if callable(state) else state
        except Exception as exc:  # every rank must reach the gathers below, whatever went wrong
            error = exc
        # every rank enters DCP's collectives, or none does: one left out would leave the others waiting in them
        ready: list[Any] = [None] * self.world
        dist.all_gather_object(ready, error is None)
        if all(ready):
            try:
                mine = load(directory, manifest, into, reads)
            except Exception as exc:
                error = exc
        every: list[Any] = [None] * self.world
        missed = tuple((path, str(copy), tier_id) for path, copy in reads.missed)
        dist.all_gather_object(every, (error, reads.near_bytes, reads.here_bytes, missed))
        record = self._lead_refused if self._lead is not None else None
        ring_held.drop_missed(manifest, self.disks, self.rank, [x[3] for x in every], record)
        failed = [e for e, _, _, _ in every if e is not None]
        if failed and self.rank == 0:
            raise unwrap(directory, CheckpointFailures(failed))
        self.loaded = {"memory": sum(x[1] for x in every), "disk": sum(x[2] for x in every)}
        lead = self.disks.leader(0)  # rank 0's disk's copy is not proven by reads its ranks took from memory
        self._read_whole = not any(x[1] for r, x in enumerate(every) if self.disks.leader(r) == lead)
        return mine if not failed else None

    def _lead_aside(
        self,
        moved: Sequence[tuple[spread.Moved, LocalTier]],
        staying: str | None = None,
        reason: str = "moved aside for another checkpoint",
    ) -> None:
        """Copies disks moved aside (a step saved again, a restore completing a disk that held another
        checkpoint there), or found nothing where a save put its own: the rows naming them follow them, or
        are let go, matched by each disk's id (another host's path may be this host's too); those of the
        checkpoint whose manifest digest is ``staying`` (made there now) stay."""
        if self._lead is not None:
            moves = [(m.old, m.new, disk) for m, disk in moved]
            moved_copies.followed(self._lead[0], moves, reason, staying=staying)

    def _displaced(self, raw: bytes) -> assemble.Displaced:
        """Rank 0's record of copies moved aside while disks complete the checkpoint whose manifest is ``raw``."""
        return lambda moved: self._lead_aside(moved, manifest_digest(raw))

    def _put_back(self, moved: Sequence[tuple[spread.Moved, LocalTier]]) -> None:
        """Rank 0's record of copies of the checkpoint being restored that disks put back from aside."""
        self._lead_aside(moved, reason="put back: a save of its step again did not commit")

    def _lead_refused(self, tier_id: str, copies: tuple[str, ...]) -> None:
        """Ring copies a node's memory refused at this restore: no recovery counts on them again."""
        if self._lead is not None:
            ring_held.record_refused(self._lead[0], tier_id, copies)

    def _lead_restore(
        self, state: StateTree, target: restore_plan.RestoreTarget | None
    ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        tried: list[int] = []

        def load_everywhere(directory: Path, manifest: mf.Manifest) -> Any:
            tried.append(manifest.step)
            raw = (directory / mf.MANIFEST_NAME).read_bytes() if self.disks.spread else b""
            if raw and mf.parse(raw) != manifest:  # changed since the plan held it to the catalog
                raise CorruptCheckpoint(
                    str(directory), [Finding(Problem.MANIFEST, mf.MANIFEST_NAME, "changed")]
                )
            remote = remotes.files_of(p, manifest, raw)  # before the broadcast: rank 0 never fails alone
            self._remote = remote
            dist.broadcast_object_list([("try", str(directory), (manifest, raw))], src=0)
            return self._attempt(directory, manifest, raw, state, remote)

        if self._lead is None:
            raise ConfigError("only rank 0 leads a restore")
        cat = self._lead[0]
        try:
            p = restore_plan.plan(cat, self.run, root=self.root, target=target)
            done = restore_exec.execute(
                cat, p, load_everywhere, partial=self.disks.spread, whole=lambda: self._read_whole
            )
        except NoRestorableCheckpoint as exc:
            self.skipped = exc.skipped
            if tried:  # DCP loads in place: a failed attempt leaves the state partly loaded
                why = f"{exc}; the state was partly loaded from step {tried[-1]}: start the job again to begin anew"
                dist.broadcast_object_list([("error", why, None)], src=0)
                raise NoRestorableCheckpoint(why, exc.skipped) from exc
            if target is not None:  # a recovery chose a restore point: starting over would lose the run
                dist.broadcast_object_list([("error", str(exc), None)], src=0)
                raise
            dist.broadcast_object_list([("none", None, None)], src=0)
            return None
        except BaseException as exc:
            dist.broadcast_object_list([("error", f"{type(exc).__name__}: {exc}", None)], src=0)
            raise
        dist.broadcast_object_list([("done", done.step, None)], src=0)
        self._parent_id, self.skipped = done.checkpoint_id, done.skipped
        self.restored_checkpoint_id = done.checkpoint_id
        remote_tiers = list(self._remote.fetched) if self._remote is not None else []
        self.read_from = assemble.read_from(
            self.sources,
            done.manifest.total_bytes,
            done.source,
            done.fetched,
            (remote_tiers or ["shared"])[0],
        )
        if self.sources:  # spread over hosts' disks: what the loads read from memory, and from the disks
            self.read_from["loaded"] = dict(self.loaded)
        self._parent = (done.step, lineage.get_checkpoint(cat, done.checkpoint_id).manifest_digest)
        restored, mine = done.value
        return done.step, restored, mine

    def _follow_restore(self, state: StateTree) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        last: Any = None
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            kind, value, sent = box[0]
            if kind == "try":
                last = self._attempt(Path(value), sent[0], sent[1], state)
            elif kind == "done":
                restored, mine = last
                return int(value), restored, mine
            elif kind == "none":
                return None
            else:
                raise RankFailed(f"restore failed on rank 0: {value}")
