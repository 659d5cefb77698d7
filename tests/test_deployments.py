"""`prefect.yaml` and `rewind serve` describe the same deployments: both come from one table."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import yaml

from rewind.flows.deployments import DEPLOYMENTS, FAILURE_EVENT, RECOVERABLE, build
from rewind.flows.prefect_yaml import render

REPO = Path(__file__).resolve().parents[1]


def test_prefect_yaml_is_written_from_the_table_rewind_serve_serves():
    assert (REPO / "prefect.yaml").read_text() == render(), (
        "prefect.yaml differs from the deployments table: python -m rewind.flows.prefect_yaml > prefect.yaml"
    )
    spec = yaml.safe_load(render())
    assert "{{ $" not in render()  # nothing per site: Prefect would leave an unset placeholder as text
    assert spec["pull"] == []  # the worker imports the flows from the installed package
    served = {d.name: d for d in build()}
    declared = {d["name"]: d for d in spec["deployments"]}
    assert list(declared) == [d.name for d in DEPLOYMENTS] and declared.keys() == served.keys()
    for name, d in declared.items():
        module, _, attr = d["entrypoint"].rpartition(".")
        flow = getattr(__import__(module, fromlist=[attr]), attr)
        assert flow.name == served[name].flow_name


def test_the_schedules_and_triggers_say_what_is_paused_until_configured(monkeypatch):
    for name in ("REWIND_OFFSITE_URI", "REWIND_SHARED_URI", "REWIND_ADOPT_FROM", "REWIND_DRILLS_SCHEDULED"):
        monkeypatch.delenv(name, raising=False)
    declared = {d["name"]: d for d in yaml.safe_load(render())["deployments"]}
    served = {d.name: d for d in build()}
    (trigger,) = declared["recover-training"]["triggers"]
    assert trigger["expect"] == [FAILURE_EVENT] and trigger["match"] == RECOVERABLE and trigger["enabled"]
    assert served["recover-training"].triggers[0].expect == {FAILURE_EVENT}
    assert served["recover-training"].triggers[0].match.root == RECOVERABLE
    assert served["verify-checkpoints"].schedules and not served["verify-checkpoints"].paused
    assert declared["verify-checkpoints"]["concurrency_limit"] == 1  # one scrub at a time, in both
    assert served["verify-checkpoints"].concurrency_limit == 1
    scrub = {d.name: d for d in build(scrub_every=timedelta(minutes=10))}["verify-checkpoints"]
    assert scrub.parameters == {"budget_s": 540.0}  # a scrub ends before the next is due
    # at the table's interval too, in both (a pool's scrub had the whole interval: scrubs ran back to back)
    assert served["verify-checkpoints"].parameters == {"budget_s": 0.9 * 6 * 3600}
    assert declared["verify-checkpoints"]["parameters"] == {"budget_s": 0.9 * 6 * 3600}
    # replicate-offsite: nothing to replicate to until a target is configured, in both
    assert served["replicate-offsite"].paused and not served["replicate-offsite"].triggers
    (verified,) = declared["replicate-offsite"]["triggers"]
    assert not verified["enabled"] and declared["replicate-offsite"]["schedules"][0]["active"] is False
    assert verified["parameters"] == {"run": "{{ event.payload.run }}"}  # the target: the worker's env
    assert served["adopt-checkpoints"].paused  # until REWIND_ADOPT_FROM and REWIND_ADOPT_RUN name it
    assert served["run-drills"].schedules and served["run-drills"].paused  # weekly, opt in
    assert served["expire-conversations"].schedules and not served["expire-conversations"].paused
    (weekly,) = declared["run-drills"]["schedules"]
    assert weekly["interval"] == 7 * 24 * 3600 and weekly["active"] is False
    monkeypatch.setenv("REWIND_OFFSITE_URI", "s3://bucket/prefix")
    replicate = {d.name: d for d in build()}["replicate-offsite"]
    assert not replicate.paused and replicate.parameters == {"target": "s3://bucket/prefix"}
    assert replicate.triggers[0].parameters == {"run": "{{ event.payload.run }}"}


def test_the_kubernetes_pool_template_and_variables_make_the_job_prefects_worker_submits(capsys):
    """docs/kubernetes-work-pool.json is Prefect's Kubernetes template plus the checkpoint volume; with the
    variables the docs show, Prefect's own worker code builds a Job with the image, env and volume."""
    import asyncio

    import jsonschema
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    from rewind.flows import prefect_yaml

    ours = json.loads((REPO / "docs" / "kubernetes-work-pool.json").read_text())
    given = REPO / "docs" / "kubernetes-job-variables.json"
    prefect_yaml.main(["--pool", "rewind-k8s", "--job-variables", str(given)])  # as the docs run it
    out = capsys.readouterr().out
    pools = {d["name"]: d["work_pool"] for d in yaml.safe_load(out)["deployments"]}
    assert {p["name"] for p in pools.values()} == {"rewind-k8s"}  # every deployment, not the default pool
    values = pools["protect-training"]["job_variables"]
    assert values == json.loads(given.read_text()) and all(
        p["job_variables"] == values for p in pools.values()
    )
    theirs = KubernetesWorker.get_default_base_job_template()
    for name, schema in theirs["variables"][
        "properties"
    ].items():  # every variable the worker knows, as it knows it
        assert ours["variables"]["properties"][name] == schema, name
    placeholders = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(ours["job_configuration"])))
    assert placeholders <= set(ours["variables"]["properties"]), placeholders - set(
        ours["variables"]["properties"]
    )
    jsonschema.validate(values, ours["variables"])
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(ours, values))
    pod = config.job_manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == values["image"] and config.namespace == values["namespace"]
    assert pod["serviceAccountName"] == values["service_account_name"]
    assert container["volumeMounts"] == [{"name": "checkpoints", "mountPath": values["checkpoint_mount"]}]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": values["checkpoint_claim"]}
    env = config.env if isinstance(config.env, dict) else {e["name"]: e.get("value") for e in config.env}
    assert {k: env[k] for k in values["env"]} == values["env"]
    for key in ("REWIND_CHECKPOINT_ROOT", "REWIND_SHARED_URI"):  # the roots lie on the mounted claim
        assert env[key].startswith(values["checkpoint_mount"] + "/"), key
    assert "password" not in json.dumps(values).lower()  # a credential belongs in a Secret, not here
