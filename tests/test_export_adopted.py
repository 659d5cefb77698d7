"""Exporting an adopted HF Trainer checkpoint (what `rewind serving deploy` does first): the archive carries
the checkpoint's own ``model.safetensors``, read through the restore path with every byte checked; the
user's directory is not written to, the checkpoint stays verified and restore still takes it. A loader
that expects Rewind's own files refuses an adopted checkpoint as the caller's mistake, condemning nothing."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewind.flows.cli import main as rewind
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_file
from rewind.infra.restore.foreign import verified_directory
from rewind.infra.serving import export
from tests.test_adopt import _trainer

REPO = Path(__file__).resolve().parents[1]
HANDLER = REPO / "examples" / "chat_lm_handler.py"
EXTRA = [REPO / "examples" / "chat_lm.py"]


def _snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry below ``directory`` (the directory itself too): size, mtime and, for files, the digest."""
    out = {".": (0, directory.stat().st_mtime_ns, "")}
    for p in sorted(directory.rglob("*")):
        st = p.stat()
        out[p.relative_to(directory).as_posix()] = (
            st.st_size if p.is_file() else 0,
            st.st_mtime_ns,
            hash_file(p, with_crc=False).xxh3 if p.is_file() else "",
        )
    return out


@pytest.fixture
def adopted(rewind_env, run_name, tmp_path, capsys) -> Path:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _trainer(tmp_path / "hf", stop_after=3).train()
    directory = tmp_path / "hf" / "checkpoint-3"
    capsys.readouterr()
    assert rewind(["adopt", str(directory), "--run", run_name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "hf-trainer"
    return directory


def _status(run: str) -> tuple[str, str | None]:
    (ck,) = lineage.checkpoints(Catalog(), run, 3)
    return ck.status, ck.status_reason


def test_an_adopted_hf_trainer_checkpoint_is_exported_and_stays_verified(adopted, run_name, tmp_path, capsys):
    cat = Catalog()
    assert _status(run_name)[0] == "verified"
    before = _snapshot(adopted)
    art = export.export(cat, run=run_name, step=3, model="hf", version="1", handler=HANDLER,
                        extra_files=EXTRA, store=tmp_path / "store")  # fmt: skip

    assert _snapshot(adopted) == before  # not a byte, a name or a time changed in the user's directory
    assert _status(run_name) == ("verified", None)
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(art.archive) as z:
        z.extractall(unpacked)
    shipped, own = load_file(str(unpacked / export.WEIGHTS)), load_file(str(adopted / "model.safetensors"))
    assert shipped.keys() == own.keys() and all(torch.equal(shipped[k], own[k]) for k in own)
    (ck,) = lineage.checkpoints(cat, run_name, 3)
    lineage_file = json.loads((unpacked / export.LINEAGE).read_text())
    assert lineage_file["manifest_digest"] == ck.manifest_digest == art.manifest_digest

    capsys.readouterr()  # restore still takes it, every byte checked
    assert rewind(["ckpt", "restore", run_name, "--step", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint_id"] == ck.id
    assert verified_directory(cat, run_name, step=3).directory == adopted
    assert _status(run_name) == ("verified", None) and _snapshot(adopted) == before


def test_a_loader_of_rewinds_own_files_refuses_an_adopted_checkpoint_and_condemns_nothing(
    adopted, run_name, tmp_path
):
    """A Checkpointer of the run (whose loader reads Rewind's state.json) is the caller's mistake: one line
    saying how such a checkpoint is loaded, and the checkpoint as verified as before."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rewind.infra.checkpoint.engine import Checkpointer

    config = LlamaConfig.from_pretrained(str(adopted))
    saver = Checkpointer(run_name, states={"model": LlamaForCausalLM(config)}, catalog=Catalog())
    try:
        with pytest.raises(ConfigError, match="adopted"):
            saver.restore_latest()
    finally:
        saver.close()
    assert _status(run_name) == ("verified", None)
    assert mf.read(adopted).writer["engine"] == "adopted:hf-trainer"
    assert verified_directory(Catalog(), run_name, step=3).step == 3


def test_weights_export_cannot_read_refuse_the_export_not_the_checkpoint(rewind_env, run_name, tmp_path):
    """An adopted safetensors directory whose model holds a dtype Rewind's reader lacks (F8_E8M0, newer than
    its table): the export is refused in one line; the checkpoint, whose every byte is the one adopted, stays
    verified."""
    import struct

    from rewind.infra.inventory.adopt import adopt

    directory = tmp_path / "weights" / "checkpoint-3"
    directory.mkdir(parents=True)
    header = json.dumps(
        {
            "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "ids": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [16, 20]},
        }
    ).encode()
    data = torch.ones(4).numpy().tobytes() + bytes(4)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    cat = Catalog()
    assert adopt(cat, directory, run=run_name).format == "safetensors"
    before = _snapshot(directory)
    with pytest.raises(ConfigError, match=r"cannot export model\.safetensors"):
        export.export(cat, run=run_name, step=3, model="w", version="1", handler=HANDLER,
                      extra_files=EXTRA, store=tmp_path / "store")  # fmt: skip
    assert _status(run_name) == ("verified", None)
    assert _snapshot(directory) == before and not list((tmp_path / "store").glob("*.mar"))
