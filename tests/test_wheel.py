"""The wheel works outside the repository: built from the tree's files, installed into a fresh
virtual environment, run from a directory whose own ``tasks.py``, ``flows/`` and ``infra/`` would
shadow a Rewind that installed those top-level names."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

DECOY = "raise SystemExit(\"the user's own {} was imported instead of Rewind's\")\n"

SAVE_AND_RESTORE = textwrap.dedent(
    """
    import torch
    from rewind import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ck = Checkpointer(run="wheel", states={"model": model, "optim": opt}, root="ckpts")
    ck.save(7)
    ck.close()

    fresh = torch.nn.Linear(8, 4)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.1)
    ck2 = Checkpointer(run="wheel", states={"model": fresh, "optim": opt2}, root="ckpts")
    got = ck2.restore_latest()
    assert got is not None and got.step == 7, got
    assert all(torch.equal(want[k], v) for k, v in fresh.state_dict().items())
    assert opt2.state_dict()["state"][0]["step"].item() == 1
    ck2.close()
    print("restored", got.step)
    """
)


def _tree_copy(dest: Path) -> None:
    """The files a clean clone has (tracked, plus new ones git does not ignore), symlinks kept."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src, dst = REPO / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


def _fresh_venv(where: Path) -> Path:
    """A new virtual environment holding only the wheel; the dependencies (torch, Prefect, ...) come
    (and pip) from this environment's site-packages as a plain path, whose ``.pth`` files (the
    editable install of the repository among them) are not processed."""
    venv.EnvBuilder(with_pip=False).create(where)
    py = where / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


@pytest.mark.timeout(240)
def test_the_wheel_installs_and_runs_from_a_directory_with_its_own_tasks_flows_and_infra(
    tmp_path: Path, fresh_pg_url: str
) -> None:
    src, dist, env_dir, work = (tmp_path / d for d in ("src", "dist", "venv", "work"))
    _tree_copy(src)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            ".",
        ],
        cwd=src,
        check=True,
        timeout=180,
    )
    (wheel,) = dist.glob("rewind-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"rewind"}
    assert "rewind/migrations/alembic.ini" in names
    assert "rewind/py.typed" in names  # a user's type checker reads the package's hints (PEP 561)
    assert any(n.startswith("rewind/migrations/versions/") for n in names)

    py = _fresh_venv(env_dir)
    # --ignore-installed: pip sees this environment's editable Rewind through deps.pth and would
    # otherwise uninstall it (from this environment) before installing the wheel.
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        check=True,
        timeout=120,
    )
    work.mkdir()
    (work / "tasks.py").write_text(DECOY.format("tasks.py"))
    for pkg in ("flows", "infra", "examples", "migrations"):
        (work / pkg).mkdir()
        (work / pkg / "__init__.py").write_text(DECOY.format(pkg + "/"))
    (work / "save_and_restore.py").write_text(SAVE_AND_RESTORE)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("REWIND_", "PYTHON"))},
        "REWIND_CATALOG_URL": fresh_pg_url,
        "REWIND_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    rewind = str(env_dir / "bin" / "rewind")

    def run(*argv: str) -> str:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
        return done.stdout

    where = run(str(py), "-c", "import rewind; print(rewind.__file__)")
    assert Path(where.strip()).is_relative_to(env_dir), where
    assert "at revision 0" in run(rewind, "db", "upgrade")
    assert "restored 7" in run(str(py), "save_and_restore.py")
    # `python -m` puts the directory with the decoys first on sys.path, as a user's shell does
    listing = run(str(py), "-m", "rewind.flows.cli", "ckpt", "list", "wheel")
    assert "7" in listing and "verified" in listing, listing
    assert "--checkpoint-every" in run(str(py), "-m", "rewind.examples.tiny_lm", "--help")  # the drills' job
