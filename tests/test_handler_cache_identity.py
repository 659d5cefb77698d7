"""The shipped chat handler names its KV blocks by the weights it serves.

Two versions of one model, exported from checkpoints with different weights, are loaded the way a
TorchServe worker loads them (the archive unpacked, its directory on ``sys.path``, TorchServe's own model
loader finding and initialising the handler class) on one node, sharing its block directory and the
catalog. A conversation begun on version 1 and continued on version 2 never uses version 1's blocks: the
answer is the one version 2's weights give from a cold cache. Version 2 restarted keeps its own blocks.
"""

from __future__ import annotations

import json
import random
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from rewind.examples.chat_lm import build_model
from rewind.infra.catalog import lineage, sessions
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.restore.scrub import scrub
from rewind.infra.serving import export
from rewind.infra.serving.conversation import Conversations
from rewind.infra.serving.kv_blocks import DiskBlocks, MemoryBlocks, TieredBlocks

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SEED = 20261201
MODULES = ("chat_lm_handler", "chat_lm")  # what the archive's directory on sys.path provides


@pytest.fixture
def versions(rewind_env, run_name, tmp_path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Versions 1 and 2 of ``chat``: archives of two verified checkpoints (different weights), unpacked."""
    pytest.importorskip("ts")
    cat = Catalog()
    out = {}
    for step, seed in ((1, 0), (2, 1)):
        saver = Checkpointer(run_name, states={"model": build_model(seed, layers=2, hidden=64)}, catalog=cat)
        saver.save(step)
        saver.close()
        (ck,) = lineage.checkpoints(cat, run_name, step)
        assert scrub(cat, ck, deep=True).ok
        art = export.export(cat, run=run_name, step=step, model="chat", version=str(step),
                            handler=REPO / "examples" / "chat_lm_handler.py",
                            extra_files=[REPO / "examples" / "chat_lm.py"], store=tmp_path / "store")  # fmt: skip
        with zipfile.ZipFile(art.archive) as z:
            z.extractall(tmp_path / f"model-{step}")
        out[str(step)] = tmp_path / f"model-{step}"
    return out


@pytest.fixture
def load(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """``load(model_dir)``: a handler as a TorchServe worker starts it (a fresh process's modules)."""
    from ts.model_loader import TsModelLoader

    monkeypatch.setenv("REWIND_KV_DIR", str(tmp_path / "node-kv"))  # the node's block tier, shared
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)

    def start(model_dir: Path) -> Any:
        for name in MODULES:
            sys.modules.pop(name, None)
        monkeypatch.syspath_prepend(str(model_dir))
        manifest = json.loads((model_dir / "MAR-INF" / "MANIFEST.json").read_text())
        service = TsModelLoader().load("chat", str(model_dir), manifest["model"]["handler"], None, 1)
        return service

    yield start
    for name in MODULES:
        sys.modules.pop(name, None)


def _say(service: Any, session: str, tokens: list[int], turn: int) -> dict[str, Any]:
    body = {"session_id": session, "tokens": tokens, "turn": turn, "max_new_tokens": 8}
    (reply,) = service._entry_point(
        [{"body": json.dumps(body).encode()}], service.context
    )  # what TorchServe calls
    return json.loads(reply)


def test_a_new_version_never_answers_from_the_old_versions_blocks(versions, load, tmp_path):
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (300, 24, 24)]
    session = f"talk-{rng.randrange(2**32):08x}"

    v1 = load(versions["1"])
    first = _say(v1, session, prompts[0], 1)
    assert first["version"] == "1" and first["source"] == "new"

    v2 = load(versions["2"])  # the rollout: same node, same block directory, same catalog
    got = _say(v2, session, prompts[1], 2)

    # a cold computation with version 2's own weights: the same history, no block to be had
    model = v2._entry_point.__self__.engine.model
    cold = Conversations(model, catalog=Catalog(), model_name="chat", instance="cold", model_id="cold",
                         blocks=TieredBlocks([MemoryBlocks(64 * MiB), DiskBlocks(tmp_path / "cold-kv", 64 * MiB)]))  # fmt: skip
    sessions.record_turn(Catalog(), f"{session}-cold", "chat", prompt=prompts[0], reply=first["tokens"],
                         blocks=[], history_len=0)  # fmt: skip
    expected = cold.turn(f"{session}-cold", prompts[1], max_new_tokens=8)
    assert expected.source == "recompute"
    assert (got["tokens"], got["source"], got["reused_tokens"]) == (expected.tokens, "recompute", 0), got
    assert got["refused_blocks"] == 0 and got["recomputed_tokens"] == 300 + 8 - 1

    restarted = load(versions["2"])  # version 2's instance restarted: its own blocks are still good
    again = _say(restarted, session, prompts[2], 3)
    reference = cold.turn(f"{session}-cold", prompts[2], max_new_tokens=8)
    assert again["source"] == "blocks (disk)" and again["recomputed_tokens"] == 0, again
    assert again["reused_tokens"] == 300 + 8 + 24 + 8 - 1 and again["tokens"] == reference.tokens
