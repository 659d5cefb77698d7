"""Checkpoint files written past the page cache (``O_DIRECT``): every length comes back byte for byte,
written in pieces of any size, on a disk and on the memory filesystem; with ``REWIND_DIRECT_WRITES=off``
through the page cache; and a file that exists is never overwritten."""

from __future__ import annotations

import mmap
import os
import random
import threading
from pathlib import Path

import pytest

from rewind.infra.format import direct, store

SIZES = (0, 1, 4095, 4096, 4097, direct.BLOCK - 1, direct.BLOCK, direct.BLOCK + 1, 2 * direct.BLOCK + 123)


def _write(path: Path, data: bytes, rnd: random.Random) -> bool:
    with direct.NewFile(path) as f:
        at = 0
        while at < len(data):
            n = rnd.randint(1, 5 << 20)
            assert f.write(data[at : at + n]) == len(data[at : at + n])
            at += n
        return f.direct


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_every_length_comes_back_byte_for_byte(tmp_path: Path, where: str) -> None:
    root = tmp_path if where == "disk" else Path("/dev/shm")
    if not root.is_dir():
        pytest.skip("this machine has no /dev/shm")
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    for size in SIZES:
        data = rnd.randbytes(size)
        path = root / f"rewind-direct-test-{seed}-{size}"
        try:
            _write(path, data, rnd)
            assert path.stat().st_size == size and path.read_bytes() == data, f"seed {seed}, size {size}"
        finally:
            path.unlink(missing_ok=True)


def test_off_writes_through_the_page_cache_and_the_entry_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random.Random(7).randbytes(direct.BLOCK + 5)
    entries, modes = [], []
    for mode in ("auto", "off"):
        monkeypatch.setenv(direct.ENV, mode)
        modes.append(_write(tmp_path / f"probe-{mode}", b"x", random.Random(1)))
        entries.append(store.write_file(tmp_path / f"file-{mode}", store.bytes_writer(data)))
    assert modes[1] is False  # off: never direct
    assert entries[0].xxh3 == entries[1].xxh3 and entries[0].size == entries[1].size == len(data)
    assert (tmp_path / "file-auto").read_bytes() == (tmp_path / "file-off").read_bytes() == data


def test_a_file_that_exists_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "taken"
    path.write_bytes(b"someone's")
    with pytest.raises(FileExistsError):
        direct.NewFile(path)
    assert path.read_bytes() == b"someone's"


def test_a_setting_that_is_not_auto_or_off_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from rewind.infra.errors import ConfigError

    monkeypatch.setenv(direct.ENV, "yes")
    with pytest.raises(ConfigError, match="not auto or off"):
        direct.wanted()


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_filesystem_refusing_direct_writes_when_asked_gets_the_file_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmpfs before Linux 6.6, ramfs: asking for O_DIRECT fails with EINVAL (simulated here); the file is
    made all the same, through the page cache, and nothing is left behind by the refusal."""
    import errno
    import fcntl
    import os

    real = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    data = random.Random(3).randbytes(direct.BLOCK + 4097)
    assert _write(tmp_path / "f", data, random.Random(4)) is False
    assert (tmp_path / "f").read_bytes() == data and [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("how", ["refused-at-a-write", "short-direct-write"])
def test_a_direct_write_refused_or_short_mid_file_finishes_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The second direct block is refused (EOPNOTSUPP, as a FUSE filesystem may) or written only in part:
    the rest of the file goes through the page cache, at the right offset; every byte as written."""
    import errno
    import os

    real, calls = os.write, []

    def flaky(fd: int, data: memoryview) -> int:
        if _flags(fd) & os.O_DIRECT:
            calls.append(len(data))
            if len(calls) == 2:
                if how == "refused-at-a-write":
                    raise OSError(errno.EOPNOTSUPP, "Operation not supported")
                return real(fd, data[: len(data) // 2 - 100])  # an odd length: the rest is unaligned
        return real(fd, data)

    monkeypatch.setattr(direct.os, "write", flaky)
    seed = random.randrange(1 << 30)
    data = random.Random(seed).randbytes(3 * direct.BLOCK + 12345)
    entry = store.write_file(tmp_path / "f", store.bytes_writer(data))
    assert len(calls) == 2, calls  # after the second, never direct again
    assert (tmp_path / "f").read_bytes() == data, f"seed {seed}"
    assert entry.size == len(data)


def test_a_forked_child_writes_files_with_buffers_of_its_own(tmp_path: Path) -> None:
    """The parent's buffers are not mapped in a forked child (``MADV_DONTFORK``): a child that writes a file
    from the thread that forked must not use them (it died of SIGSEGV when it did)."""
    data = random.Random(11).randbytes(direct.BLOCK + 4097)
    _write(tmp_path / "parent", data, random.Random(1))  # the parent keeps a buffer for its next file
    assert direct._free, "no buffer kept: the child would not meet one"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports only through its exit status
        code = 1
        try:
            _write(tmp_path / "child", data, random.Random(2))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "child").read_bytes() == data


def test_files_written_one_after_another_reuse_one_buffer(tmp_path: Path) -> None:
    """Each background save runs in a thread of its own: its files take the buffer the last one left, so a
    save does not fault in (and zero) a fresh 16 MiB."""
    data = random.Random(5).randbytes(direct.BLOCK // 2)
    taken: list[int] = []
    real_take = direct._take

    def watched() -> mmap.mmap:
        buf = real_take()
        taken.append(id(buf))
        return buf

    direct._free.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(direct, "_take", watched)
        for i in range(3):
            t = threading.Thread(target=_write, args=(tmp_path / f"f{i}", data, random.Random(i)))
            t.start()
            t.join(timeout=60)
            assert not t.is_alive()
    assert len(set(taken)) == 1 and len(taken) == 3
    assert all((tmp_path / f"f{i}").read_bytes() == data for i in range(3))
