"""`prefect.yaml` and `rewind serve` describe the same deployments."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from rewind.flows.deployments import FAILURE_EVENT, RECOVERABLE, build

REPO = Path(__file__).resolve().parents[1]


def test_prefect_yaml_matches_rewind_serve():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    served = {d.name: d for d in build()}
    declared = {d["name"]: d for d in spec["deployments"]}
    assert declared.keys() == served.keys()
    for name, d in declared.items():
        module, _, attr = d["entrypoint"].partition(":")
        flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), attr)
        assert flow.name == served[name].flow_name
    (trigger,) = declared["recover-training"]["triggers"]
    assert trigger["expect"] == [FAILURE_EVENT]
    assert served["recover-training"].triggers[0].expect == {FAILURE_EVENT}
    assert trigger["match"] == RECOVERABLE
    assert served["recover-training"].triggers[0].match.root == RECOVERABLE
    assert served["verify-checkpoints"].schedules and served["replicate-offsite"].paused
    assert served[
        "adopt-checkpoints"
    ].paused  # until REWIND_ADOPT_FROM and REWIND_ADOPT_RUN name what to watch
    assert served["run-drills"].schedules and served["run-drills"].paused  # weekly, opt in
    assert served["expire-conversations"].schedules and not served["expire-conversations"].paused
    (weekly,) = declared["run-drills"]["schedules"]
    assert weekly["interval"] == 7 * 24 * 3600 and weekly["active"] is False
