"""`rewind logs RUN [--launch N] [--node K] [--follow]`: the job's own output, as kept per launch and node."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap
from rewind.infra import joblog
from rewind.infra.errors import ConfigError

FOLLOW_POLL_S = 0.5


def cmd_logs(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    chosen = _launch(args.run, args.launch)
    nodes = [(n, p) for n, p in chosen.nodes() if args.node is None or n == args.node]
    if not nodes:
        raise ConfigError(f"launch {chosen.launch_id} of {args.run} kept no output of node {args.node}")
    several = len(nodes) > 1
    followers = [_Follower(node, path, several) for node, path in nodes]
    try:
        for f in followers:
            f.show_all()
        if args.follow:
            _follow(followers, _ended(catalog, chosen.launch_id))
        sys.stdout.flush()
    except BrokenPipeError:  # `rewind logs RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    return 0


def _launch(run: str, wanted: int | None) -> joblog.LaunchLogs:
    launches = joblog.kept(run)
    if not launches:
        raise ConfigError(
            f"no output of run {run!r} is kept in {joblog.run_dir(run)}: it is kept on the machine that "
            "supervised the job (the worker's REWIND_HOME)"
        )
    if wanted is None:
        return launches[-1]
    found = [launch for launch in launches if launch.launch_id == wanted]
    if not found:
        ids = ", ".join(str(launch.launch_id) for launch in launches)
        raise ConfigError(f"no kept output of launch {wanted} of {run}; kept: {ids}")
    return found[0]


class _Follower:
    """One node's file: what it held, then what is appended (across a rotation), complete lines only."""

    def __init__(self, node: int, path: Path, prefixed: bool) -> None:
        self.node, self.path, self.prefix = node, path, f"[node {node}] " if prefixed else ""
        self.offset, self.inode, self.partial = 0, _inode(path), ""

    def show_all(self) -> None:
        rotated = self.path.with_name(self.path.name + ".1")
        if rotated.is_file():
            self._print(_read_from(rotated, 0)[0])
        self.show_new()

    def show_new(self) -> None:
        inode = _inode(self.path)
        if inode != self.inode:  # rotated since the last look: the rest of the old file is now ``.1``
            rotated = self.path.with_name(self.path.name + ".1")
            if _inode(rotated) == self.inode:
                self._print(_read_from(rotated, self.offset)[0])
            self.offset, self.inode = 0, inode
        text, read = _read_from(self.path, self.offset)
        self.offset += read
        self._print(text)

    def _print(self, text: str) -> None:
        if not text:
            return
        text, self.partial = self.partial + text, ""
        lines = text.split("\n")
        self.partial = lines.pop()  # what follows the last newline is not a whole line yet
        for line in lines:
            sys.stdout.write(f"{self.prefix}{line}\n")
        sys.stdout.flush()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    """The text from ``offset`` to the end, and how many bytes that was."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return "", 0
    return data.decode("utf-8", errors="replace"), len(data)


def _follow(followers: list[_Follower], ended: Callable[[], bool]) -> None:
    """Show what the nodes print until the launch has ended (and its last lines are shown), or Ctrl-C."""
    try:
        while True:
            done = ended()
            for f in followers:
                f.show_new()
            if done:
                return
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return


def _ended(catalog: OpenCatalog, launch_id: int) -> Callable[[], bool]:
    """Whether the launch has ended, by the catalog (opened once); without one, never (follow to Ctrl-C)."""
    from rewind.infra.catalog import jobs
    from rewind.infra.errors import NotFoundError, RewindError

    opened: list[Any] = []

    def ended() -> bool:
        try:
            if not opened:
                opened.append(catalog())
            return jobs.get_launch(opened[0], launch_id).ended_at is not None
        except NotFoundError:  # this catalog never heard of the launch: nothing to wait for
            return True
        except RewindError:  # no catalog here, or it blinked
            return False

    return ended


def register(sub: Any, add: Add, wrap: Wrap) -> None:
    logs = add(sub, "logs", wrap(cmd_logs), "the job's own output, kept per launch and node")
    logs.add_argument("run")
    logs.add_argument("--launch", type=int, help="this launch (default: the newest; rewind status shows it)")
    logs.add_argument("--node", type=int, help="only this node (default: every node, each line prefixed)")
    logs.add_argument(
        "--follow", "-f", action="store_true", help="keep showing new lines until the launch ends"
    )
