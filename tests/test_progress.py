"""Progress of long work: a byte bar on a real pseudo-terminal, plain lines in a log, a Prefect progress artifact.

The checkpoint is ``REWIND_TEST_PROGRESS_MB`` MB (300 by default; ``make test-heavy`` replicates 2.2 GB),
sent to the real S3 server.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

from rewind.flows.progress_view import LineMeter
from rewind.infra import progress
from tests.prefect_support import REPO
from tests.s3_support import BUCKET, big_checkpoint

MB = int(os.environ.get("REWIND_TEST_PROGRESS_MB", "300"))
READING = re.compile(rb"(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) (MiB|GiB)")


def on_a_terminal(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """Run ``argv`` with a pseudo-terminal as stdin, stdout and stderr; everything it drew, bounded."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO, start_new_session=True
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            out += data
        else:
            proc.kill()
            raise TimeoutError(
                f"{argv[2:]} still running after {timeout}s:\n{out[-2000:].decode(errors='replace')}"
            )
        return proc.wait(timeout=30), bytes(out)
    finally:
        os.close(master)


def test_line_meter_prints_a_line_per_tenth_and_the_end_not_per_chunk():
    out = io.StringIO()
    with (
        LineMeter(out, every_s=3600, min_bytes=0) as meter,
        progress.watching(meter),
        progress.phase("send x", 1000),
    ):
        for _ in range(100):
            progress.advance(10)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("send x:   0.0%")
    assert [ln.split()[2] for ln in lines[1:-1]] == [f"{10 * i}.0%" for i in range(1, 10)]
    assert lines[-1].startswith("send x: 100.0%") and "done in" in lines[-1]
    quiet = io.StringIO()  # a small phase (a restore of a few MiB, one of 20 small checkpoints): no lines
    with LineMeter(quiet) as meter, progress.watching(meter), progress.phase("verify y", 4 << 20):
        progress.advance(4 << 20)
    assert quiet.getvalue() == ""


def test_replicate_shows_byte_progress_on_a_terminal_and_as_a_prefect_artifact(
    s3_env, rewind_env, run_name, tmp_path, prefect_api
):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    from rewind.tasks.replicate import replicate_checkpoint

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=MB)
    total = saved.total_bytes
    env = {**os.environ, **rewind_env, **s3_env.env, "TERM": "xterm-256color"}
    argv = [sys.executable, "-m", "rewind.flows.cli", "replicate", run_name, "--to", f"s3://{BUCKET}/tty"]
    argv += ["--part-size-mib", "16", "--concurrency", "4"]
    rc, drawn = on_a_terminal(argv, env, timeout=600)
    assert rc == 0, drawn[-2000:]
    sending = drawn[drawn.index(f"send {run_name[:20]}".encode()) :]  # the bar's label, cut to fit
    readings = {float(m[1]) for m in READING.finditer(sending)}
    assert len(readings) >= 3, (
        f"the bar never moved: {sorted(readings)}"
    )  # drawn as it went, not once at the end
    assert b"\r" in sending or b"\x1b[" in sending  # redrawn in place: a terminal bar, not lines
    assert f"replicated to s3://{BUCKET}/tty".encode() in drawn

    @flow(name="replicate-with-progress")
    def replicate_one(checkpoint_id: int, target: str) -> dict:
        return replicate_checkpoint(checkpoint_id, target, part_size_mib=16, concurrency=4)

    state = replicate_one(saved.checkpoint_id, f"s3://{BUCKET}/flow", return_state=True)
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
                type=ArtifactFilterType(any_=["progress"]),
            )
        )
    shown = {a.description: a.data for a in artifacts}
    gib = f"{total / (1 << 30):.2f} GiB"
    assert shown.get(f"send {run_name}/step-1 to s3://{BUCKET}/flow: {gib}") == 100.0, shown
    assert shown.get(f"verify {run_name}/step-1: {gib}") == 100.0, (
        shown
    )  # the source, proven before it is sent
