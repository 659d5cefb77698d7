"""Damage to the newest checkpoint: reported precisely, never loaded, the run falls back and stays bit-exact."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rewind.flows.cli import main as rewind
from rewind.infra.format.manifest import MANIFEST_NAME
from tests.conftest import ADMIN_URL, _admin
from tests.trainproc import TrainProc, assert_same_weights

RUN = "damaged"


def flip_byte(d: Path) -> None:
    p = d / "optimizer.safetensors"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))


def truncate(d: Path) -> None:
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


def delete_file(d: Path) -> None:
    (d / "state.json").unlink()


def delete_manifest(d: Path) -> None:
    (d / MANIFEST_NAME).unlink()


def _edit_manifest(d: Path, edit) -> None:  # type: ignore[no-untyped-def]
    body = json.loads((d / MANIFEST_NAME).read_text())
    edit(body)
    (d / MANIFEST_NAME).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def escape_path(d: Path) -> None:
    (d.parent / "outside").write_bytes(b"x")
    _edit_manifest(
        d, lambda b: b["files"].append({"path": "../outside", "size": 1, "xxh3": "0", "crc32c": "AAAAAA=="})
    )


def wrong_size(d: Path) -> None:
    def edit(body: dict) -> None:
        body["files"][0]["size"] += 1

    _edit_manifest(d, edit)


# (damage, the finding `rewind ckpt verify --deep` must report: problem, path). An edited manifest
# is refused before anything in it is believed: it is not the one the catalog recorded.
CASES = {
    "flipped_byte": (flip_byte, "digest_mismatch", "optimizer.safetensors"),
    "truncated": (truncate, "size_mismatch", "model.safetensors"),
    "deleted_file": (delete_file, "missing", "state.json"),
    "deleted_manifest": (delete_manifest, "manifest", MANIFEST_NAME),
    "escaping_path": (escape_path, "manifest", MANIFEST_NAME),
    "wrong_size": (wrong_size, "manifest", MANIFEST_NAME),
}


def _db_url(name: str) -> str:
    return f"{ADMIN_URL.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://')}/{name}"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Iterator[tuple[Path, str]]:  # type: ignore[no-untyped-def]
    """A run trained to step 35 and stopped (checkpoints 10, 20, 30), once for the whole module: its
    directories (copied aside) and its Postgres catalog (a template database), which every case clones."""
    work = tmp_path_factory.mktemp("damaged") / "work"
    template = f"rewind_damaged_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{template}"')
    env = {
        "REWIND_HOME": str(work / "home"),
        "REWIND_CATALOG_URL": _db_url(template),
        "REWIND_CHECKPOINT_ROOT": str(work / "ckpt"),
        "REWIND_FAULT": "",
        "REWIND_MANIFEST_KEY": "",
    }
    first = TrainProc(RUN, work / "out", env=env, extra=["--stop-after", "35"])
    assert first.finish() and first.proc.returncode == 0, first.output.text
    assert first.output.last_step == 35
    pristine = work.parent / "pristine"
    shutil.copytree(work, pristine, symlinks=True)
    try:
        yield work, template
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{template}" WITH (FORCE)')


@pytest.fixture
def damaged_env(interrupted, monkeypatch) -> Iterator[dict[str, str]]:  # type: ignore[no-untyped-def]
    """This case's own copy of the interrupted run, at the paths the catalog recorded: the directories
    restored from the pristine copy, the catalog a fresh clone of the template database."""
    work, template = interrupted
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(work.parent / "pristine", work, symlinks=True)
    clone = f"{template}_{uuid.uuid4().hex[:6]}"
    _admin(f'CREATE DATABASE "{clone}" TEMPLATE "{template}"')
    env = {
        "REWIND_HOME": str(work / "home"),
        "REWIND_CATALOG_URL": _db_url(clone),
        "REWIND_CHECKPOINT_ROOT": str(work / "ckpt"),
        "OUT": str(work / "out"),
    }
    for k in ("REWIND_HOME", "REWIND_CATALOG_URL", "REWIND_CHECKPOINT_ROOT"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.delenv("REWIND_FAULT", raising=False)
    monkeypatch.delenv("REWIND_MANIFEST_KEY", raising=False)
    try:
        yield env
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{clone}" WITH (FORCE)')


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_newest_checkpoint(case, reference, damaged_env, capsys):
    damage, problem, path = CASES[case]
    ref_losses, ref_final = reference
    run_name, rewind_env = RUN, damaged_env
    out_dir = Path(damaged_env["OUT"])
    newest = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]) / run_name / "step-30"
    assert (newest / MANIFEST_NAME).exists()
    damage(newest)

    capsys.readouterr()
    assert rewind(["ckpt", "verify", run_name, "--deep", "--json"]) == 1
    report = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert [s for s, r in report.items() if not r["ok"]] == [30]
    findings = {(f["problem"], f["path"]) for f in report[30]["findings"]}
    assert (problem, path) in findings, findings
    if case in ("escaping_path", "wrong_size"):
        assert any("not the manifest the catalog recorded" in f["detail"] for f in report[30]["findings"])

    capsys.readouterr()
    assert rewind(["ckpt", "list", run_name, "--json"]) == 0
    status = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert status[30] == "corrupt" and status[20] in ("committed", "verified")

    second = TrainProc(run_name, out_dir)
    out = second.finish()
    assert second.proc.returncode == 0, out.text
    assert out.resumed_at == 20, out.text
    assert min(out.losses) == 21
    for step, loss in out.losses.items():
        assert loss == ref_losses[step]
    assert_same_weights(out_dir / "final.safetensors", ref_final)


def test_damage_found_at_restore_names_file_and_reason(reference, damaged_env):
    """Without a prior verify, restore itself refuses the damaged copy and says which file and why."""
    flip_byte(Path(damaged_env["REWIND_CHECKPOINT_ROOT"]) / RUN / "step-30")
    second = TrainProc(RUN, Path(damaged_env["OUT"]), extra=["--stop-after", "21"])
    out = second.finish()
    skipped = [line for line in out.text.splitlines() if "skipped step 30" in line]
    assert skipped and "optimizer.safetensors: digest_mismatch" in skipped[0], out.text
    assert out.resumed_at == 20
    assert out.losses[21] == reference[0][21]
