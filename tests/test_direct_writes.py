"""Checkpoint files written past the page cache (``O_DIRECT``): every length comes back byte for byte,
written in pieces of any size, on a disk and on the memory filesystem; with ``REWIND_DIRECT_WRITES=off``
through the page cache; and a file that exists is never overwritten."""

from __future__ import annotations

import mmap
import os
import random
import struct
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
    save does not fault in (and zero) a fresh buffer."""
    data = random.Random(5).randbytes(direct.BLOCK // 2)
    taken: list[mmap.mmap] = []
    real_take = direct._take

    def watched() -> mmap.mmap:
        buf = real_take()
        taken.append(buf)  # the objects, not their ids: a freed one's id may come back
        return buf

    direct._free.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(direct, "_take", watched)
        for i in range(3):
            t = threading.Thread(target=_write, args=(tmp_path / f"f{i}", data, random.Random(i)))
            t.start()
            t.join(timeout=60)
            assert not t.is_alive()
    assert len(taken) == 3 and all(b is taken[0] for b in taken)
    assert all((tmp_path / f"f{i}").read_bytes() == data for i in range(3))


def _page_aligned(data: bytes, shift: int) -> tuple[mmap.mmap, memoryview]:
    """``data`` copied to a page-aligned mapping, ``shift`` bytes in: a writable source whose address is known."""
    buf = mmap.mmap(-1, len(data) + shift + mmap.PAGESIZE)
    buf[shift : shift + len(data)] = data
    return buf, memoryview(buf)[shift : shift + len(data)]


@pytest.mark.parametrize("how", ["aligned", "misaligned", "refused-at-a-write", "short-direct-write"])
def test_a_source_at_its_file_address_goes_to_the_disk_from_where_it_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A header, then a large writable source lying at the address its bytes take in the file (modulo 4 KiB,
    as staged tensors do): its whole blocks are written from the source itself, not copied through the
    buffer; a source that does not lie so is copied; a refusal or a short write on the way finishes through
    the page cache. Every byte as written, in every case."""
    import errno

    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    head = rnd.randbytes(rnd.randint(1, 3 * direct.ALIGN))
    body = rnd.randbytes(direct.BLOCK + rnd.randint(1, 3 * direct.ALIGN))
    shift = len(head) % direct.ALIGN + (1 if how == "misaligned" else 0)
    keep, src = _page_aligned(body, shift)
    lo = direct._address(src)
    assert lo is not None
    real, straight, calls = os.write, [], []

    def watched(fd: int, data: memoryview) -> int:
        at = direct._address(data)
        from_source = at is not None and lo <= at < lo + len(body)
        straight.append(from_source)
        if from_source and how not in ("aligned", "misaligned") and _flags(fd) & os.O_DIRECT:
            calls.append(len(data))
            if how == "refused-at-a-write":
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            if len(calls) == 1:
                return real(fd, data[: len(data) // 2 - 100])
        return real(fd, data)

    monkeypatch.setattr(direct.os, "write", watched)
    try:
        with direct.NewFile(tmp_path / "f") as f:
            f.write(head)
            f.write(src)
    finally:
        src.release()
        keep.close()
    assert (tmp_path / "f").read_bytes() == head + body, f"seed {seed}"
    assert any(straight) is (how != "misaligned"), f"seed {seed}: {straight}"


def test_an_async_save_writes_its_staged_tensors_from_the_staging_buffer(
    rewind_env: dict[str, str], run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged tensors lie as they will in their file, so an async save sends them to the disk from the staging
    buffer in one write per file (no second copy); the file stays plain safetensors, which the safetensors
    library reads back equal, with its tensors from a 4 KiB boundary; the values at ``save()`` are the ones
    saved, although the tensors change right after."""
    from safetensors.torch import load_file

    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer, SaveMode

    seed = random.randrange(1 << 30)
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    # mixed element sizes, odd lengths: each tensor must still land aligned to its own element size
    state = {
        "w": torch.randn(700, 1001, generator=gen),
        "h": torch.randn(333, 77, generator=gen).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (517,), generator=gen),
        "b": torch.randint(0, 2, (1001,), generator=gen).bool(),
    }
    expected = {k: v.clone() for k, v in state.items()}
    real, from_staging = os.write, []

    def watched(fd: int, data: memoryview) -> int:
        if len(data) >= direct.STRAIGHT_FROM and _flags(fd) & os.O_DIRECT:
            at = direct._address(data)
            staged = ck._staging._buf
            lo = staged.data_ptr() if staged is not None else -1
            from_staging.append(at is not None and lo <= at < lo + staged.numel())  # type: ignore[union-attr]
        return real(fd, data)

    monkeypatch.setattr(direct.os, "write", watched)
    ck = Checkpointer(
        run_name, states={"model": state}, root=tmp_path, catalog=Catalog(), mode=SaveMode.ASYNC
    )
    ck.save(1)
    for t in state.values():
        t.zero_() if t.dtype is torch.bool else t.add_(1)  # changed while the save persists
    ck.wait()
    saved = ck.last_saved
    assert saved is not None
    ck.close()
    path = Path(saved.path) / "model.safetensors"
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + header_len) % 4096 == 0
    back = load_file(str(path))
    assert back.keys() == {f"model.{k}" for k in expected}
    assert all(torch.equal(back[f"model.{k}"], v) for k, v in expected.items()), f"seed {seed}"
    with direct.NewFile(tmp_path / "probe") as probe:
        takes_direct = probe.direct  # this filesystem takes direct writes
    if takes_direct:
        assert from_staging and all(from_staging), f"seed {seed}: {from_staging}"


def test_two_files_written_at_once_each_have_a_buffer_of_their_own(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    a_data, b_data = rnd.randbytes(2 * direct.BLOCK + 77), rnd.randbytes(2 * direct.BLOCK + 4099)
    with direct.NewFile(tmp_path / "a") as a, direct.NewFile(tmp_path / "b") as b:
        assert a._buf is not b._buf
        step = direct.BLOCK // 3
        for at in range(0, max(len(a_data), len(b_data)), step):
            a.write(a_data[at : at + step])
            b.write(b_data[at : at + step])
    assert (tmp_path / "a").read_bytes() == a_data, f"seed {seed}"
    assert (tmp_path / "b").read_bytes() == b_data, f"seed {seed}"


CHILD_EXITS_NORMALLY = """
import os, sys
from pathlib import Path
from rewind.infra.format import direct
d = Path(sys.argv[1])
with direct.NewFile(d / "parent") as f:
    f.write(b"p" * (direct.BLOCK + 1))
open_across = direct.NewFile(d / "open-across")
pid = os.fork()
if pid == 0:
    try:
        open_across.write(b"x")
        sys.exit(3)  # a parent's open file must not be written by the child
    except RuntimeError:
        pass
    with direct.NewFile(d / "child") as f:
        f.write(b"c" * (direct.BLOCK + 1))
    junk = [bytearray(1 << 20) for _ in range(64)]  # the child maps memory where the parent's buffers lay
    sys.exit(0)  # a normal exit: the interpreter frees every object
_, status = os.waitpid(pid, 0)
open_across.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_that_exits_normally_frees_nothing_it_must_not(tmp_path: Path) -> None:
    """The child of a process that wrote files forks, writes one of its own, maps memory and exits through the
    interpreter's shutdown (which frees every object, the parent's buffers with them): exit status 0, both
    files right; a file the parent had open is refused to the child."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CHILD_EXITS_NORMALLY, str(tmp_path)], timeout=120, check=False
    )
    assert done.returncode == 0
    assert (tmp_path / "child").read_bytes() == b"c" * (direct.BLOCK + 1)
    assert (tmp_path / "parent").read_bytes() == b"p" * (direct.BLOCK + 1)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_file_that_cannot_be_made_leaves_no_descriptor_and_keeps_its_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "taken").write_bytes(b"")
    _write(tmp_path / "warm", b"w", random.Random(0))  # one buffer kept
    kept, before = len(direct._free), _fds()
    with pytest.raises(FileExistsError):
        direct.NewFile(tmp_path / "taken")
    assert _fds() == before and len(direct._free) == kept

    def no_memory() -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(direct, "_take", no_memory)
    with pytest.raises(OSError):
        direct.NewFile(tmp_path / "never")
    assert _fds() == before and not (tmp_path / "never").exists()


def test_a_direct_write_refused_after_part_of_it_went_out_writes_no_byte_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct write that takes whole blocks but not all (as Linux does past 2 GiB), then a refusal: the rest
    goes on through the page cache from where the disk stopped, not from the start again."""
    import errno

    real, calls = os.write, []

    def partial_then_refused(fd: int, data: memoryview) -> int:
        if _flags(fd) & os.O_DIRECT:
            calls.append(len(data))
            if len(calls) == 1:
                return real(fd, data[: len(data) // 2 // direct.ALIGN * direct.ALIGN])
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(direct.os, "write", partial_then_refused)
    seed = random.randrange(1 << 30)
    data = random.Random(seed).randbytes(2 * direct.BLOCK + 999)
    _write(tmp_path / "f", data, random.Random(seed))
    assert len(calls) == 2, calls
    assert (tmp_path / "f").read_bytes() == data, f"seed {seed}"
