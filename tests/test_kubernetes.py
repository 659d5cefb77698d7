"""The Kubernetes launcher on paper: JobSet manifests from job specs, checked against the published schemas.

No cluster is reached; nothing here is applied. What is checked, and against what:

- the whole JobSet against JobSet's own API, as Kubeflow Trainer ships it on PyPI
  (``kubeflow-trainer-api``: pydantic models generated from the JobSet and Kubernetes Go types):
  the manifest survives ``from_dict``/``to_dict`` unchanged, so no field is misspelt, misplaced or
  of the wrong type (a field the models do not know is dropped, and the comparison fails);
- the replicated Job, pod template included, against the Kubernetes API schema (``kubernetes-validate``:
  the OpenAPI schema of each Kubernetes release as JSON Schema, strict: no unknown field), for the
  Kubernetes releases JobSet v0.12.0 is tested on (1.32 to 1.34) and the newest it ships (1.37);
- the names, labels and DNS rules the API server and JobSet's admission webhook apply beyond the schema;
- and, where the JobSet CRD file is on this machine, the whole JobSet against the CRD's
  ``openAPIV3Schema`` (jsonschema, objects closed as the API server prunes them; CEL rules are not
  run: the CRD's only ones concern updates, startupPolicy/dependsOn and volume claim templates, none
  used here). The CRD validated against: kubernetes-sigs/jobset v0.12.0
  (commit f22e565ac3cc3265c7c45ef67ecffdc689af5d77), config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml.
  It is not in this repository: it is looked for at shared/k8s/jobset.x-k8s.io_jobsets.yaml (in the
  checkout or beside it) or at ``$REWIND_TEST_JOBSET_CRD``; without it that test is skipped.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rewind.infra.errors import ConfigError
from rewind.infra.launch import kubernetes as k8s
from rewind.infra.launch.spec import JobSpec, agent_command, load_file

ROOT = Path(__file__).resolve().parent.parent
CRD_NAME = "jobset.x-k8s.io_jobsets.yaml"
# The Kubernetes releases the Job and its pod template are checked against: those JobSet v0.12.0's
# end-to-end tests run on (its README: 1.32 to 1.34), and the newest kubernetes-validate ships.
KUBE_VERSIONS = ("1.32", "1.33", "1.34", "1.37")
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")

IMAGE = "registry.example/train:1.0"


def big_spec(**over: Any) -> JobSpec:
    """2 nodes x 8 GPUs."""
    fields: dict[str, Any] = {
        "command": ("python", "-m", "mypkg.train", "--config", "c.yaml"),
        "nnodes": 2,
        "nproc_per_node": 8,
        "env": {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "8"},
        "cwd": "/workspace",
        "launcher": "slurm",
    }
    return JobSpec(**{**fields, **over})


# -- the checks ------------------------------------------------------------------------------------


def crd_path() -> Path | None:
    candidates = [Path(p) for p in [os.environ.get("REWIND_TEST_JOBSET_CRD")] if p]
    candidates += [ROOT / "shared" / "k8s" / CRD_NAME, ROOT.parent / "shared" / "k8s" / CRD_NAME]
    return next((p for p in candidates if p.is_file()), None)


def closed(schema: Any) -> Any:
    """The CRD's schema as the API server applies it: an object with ``properties`` holds nothing else
    (unknown fields are pruned, or refused by ``kubectl``'s strict field validation)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(path: Path) -> Any:
    import jsonschema

    crd = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["group"] == "jobset.x-k8s.io" and crd["spec"]["names"]["kind"] == "JobSet"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return jsonschema.Draft7Validator(closed(version["schema"]["openAPIV3Schema"]))


def crd_errors(manifest: dict[str, Any]) -> list[str]:
    path = crd_path()
    assert path is not None
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in crd_validator(path).iter_errors(manifest)]


def jobset_model_diff(manifest: dict[str, Any]) -> dict[str, Any]:
    """What JobSet's models do not give back: empty when every field is known and of its type."""
    from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
    from pydantic import ValidationError

    try:
        back = JobsetV1alpha2JobSet.from_dict(manifest).to_dict()
    except ValidationError as e:  # a field of the wrong type
        return {"refused": str(e)}
    return {} if back == manifest else {"sent": manifest, "back": back}


def job_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The Job JobSet creates from the replicated job (``<jobset>-<replicated job>-<index>``)."""
    (rj,) = manifest["spec"]["replicatedJobs"]
    meta = {**rj["template"].get("metadata", {}), "name": f"{manifest['metadata']['name']}-{rj['name']}-0"}
    meta["namespace"] = manifest["metadata"]["namespace"]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": rj["template"]["spec"]}


def kube_errors(manifest: dict[str, Any]) -> list[str]:
    from kubernetes_validate import utils

    errors = []
    for version in KUBE_VERSIONS:
        try:
            utils.validate(job_of(manifest), version, strict=True)
        except utils.ValidationError as e:
            errors.append(f"{version}: {'.'.join(map(str, e.path))}: {e.message}")
    return errors


def api_rule_errors(manifest: dict[str, Any]) -> list[str]:
    """What the API server and JobSet's webhook check beyond the schema (names, labels, DNS)."""
    errors = []
    meta, spec = manifest["metadata"], manifest["spec"]
    name = meta["name"]
    (rj,) = spec["replicatedJobs"]
    job = rj["template"]["spec"]
    longest_pod = f"{name}-{rj['name']}-{rj['replicas'] - 1}-{job['completions'] - 1}-abcde"
    for what, value in [("name", name), ("job name", f"{name}-{rj['name']}-{rj['replicas'] - 1}"),
                        ("pod name", longest_pod), ("subdomain", spec["network"]["subdomain"])]:  # fmt: skip
        if len(value) > 63 or not DNS1035.fullmatch(value):
            errors.append(f"{what} {value!r} is no DNS-1035 label")
    if not DNS1123_SUBDOMAIN.fullmatch(meta["namespace"]) or len(meta["namespace"]) > 63:
        errors.append(f"namespace {meta['namespace']!r}")
    templates = [meta, rj["template"]["metadata"], job["template"]["metadata"]]
    for labels in [t.get("labels", {}) for t in templates]:
        for key, value in labels.items():
            prefix, _, label = key.rpartition("/")
            if (
                not LABEL_NAME.fullmatch(label)
                or len(label) > 63
                or (prefix and not DNS1123_SUBDOMAIN.fullmatch(prefix))
            ):
                errors.append(f"label key {key!r}")
            if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.fullmatch(value):
                errors.append(f"label {key}={value!r}")
    for key in meta.get("annotations", {}):
        prefix, _, label = key.rpartition("/")
        if not LABEL_NAME.fullmatch(label) or (prefix and not DNS1123_SUBDOMAIN.fullmatch(prefix)):
            errors.append(f"annotation key {key!r}")
    pod = job["template"]["spec"]
    for container in pod["containers"]:
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref and not re.fullmatch(r"[-._a-zA-Z0-9]+", ref["key"]):
                errors.append(f"secret key {ref['key']!r}")
    if job["parallelism"] * rj["replicas"] > 2**31 - 1:
        errors.append("replicas x parallelism")
    return errors


def assert_valid(manifest: dict[str, Any]) -> None:
    assert not jobset_model_diff(manifest), jobset_model_diff(manifest)
    assert not kube_errors(manifest), kube_errors(manifest)
    assert not api_rule_errors(manifest), api_rule_errors(manifest)
    if crd_path() is not None:
        assert not crd_errors(manifest), crd_errors(manifest)


def pod_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def env_of(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (container,) = pod_of(manifest)["containers"]
    names = [v["name"] for v in container["env"]]
    assert len(names) == len(set(names)), names
    return {v["name"]: v for v in container["env"]}


# -- the manifests ---------------------------------------------------------------------------------


def test_two_nodes_of_eight_gpus() -> None:
    spec = big_spec()
    m = k8s.jobset_manifest(
        spec, run="llama-70b", image=IMAGE, namespace="train", gpus_per_node=8, launch_id=7
    )
    assert_valid(m)
    assert (m["apiVersion"], m["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name = m["metadata"]["name"]
    assert name.startswith("llama-70b-") and name.endswith("-7")
    assert m["spec"]["failurePolicy"] == {"maxRestarts": 0}  # Rewind recovers, not JobSet
    assert m["spec"]["network"]["subdomain"] == name and m["spec"]["network"]["enableDNSHostnames"] is True
    (rj,) = m["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["replicas"] == 1
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    pod = pod_of(m)
    assert pod["restartPolicy"] == "Never"  # not JobSet's default OnFailure: no restart in place
    (c,) = pod["containers"]
    assert c["image"] == IMAGE and c["workingDir"] == "/workspace"
    assert c["resources"] == {"requests": {"nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}}
    # Each pod runs its node's torchrun agent, as the local and Slurm launchers do, with the image's python,
    # under the pod's memory agent (as on Slurm; the pod's index is its node); the rendezvous is pod 0's name
    # behind the headless service (in /etc/hosts on pod 0 itself), the agents' store the next port there.
    host = f"{name}-node-0-0.{name}.train.svc.cluster.local"
    expected = agent_command(spec, endpoint=f"{host}:29400", rdzv_id="llama-70b-7")
    expected[0] = expected[expected.index("--") + 1] = "python"
    assert c["command"] == [
        "python", "-m", "rewind.infra.launch.host_agent", "--nodes=2", f"--store={host}:29401",
        "--scope=llama-70b-7", "--join-s=600", "--", *expected,
    ]  # fmt: skip
    assert c["ports"] == [{"name": "rdzv", "containerPort": 29400, "protocol": "TCP"},
                          {"name": "agents", "containerPort": 29401, "protocol": "TCP"}]  # fmt: skip
    env = env_of(m)
    assert env["REWIND_NODE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "WARN"}
    assert env["REWIND_CATALOG_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": name, "key": "REWIND_CATALOG_URL"}
    }
    for handed in (
        "REWIND_LAUNCH_ID",
        "REWIND_LAUNCH_TOKEN",
        "REWIND_LR_SCALE",
        "REWIND_GLOBAL_BATCH",
        "REWIND_LAYOUT",
    ):
        assert env[handed]["valueFrom"]["secretKeyRef"] == {"name": name, "key": handed, "optional": True}
    labels = m["metadata"]["labels"]
    assert labels["rewind/run"].startswith("llama-70b-") and labels["rewind/launch"] == "7"
    assert labels["app.kubernetes.io/managed-by"] == "rewind"
    assert pod_of(m) and rj["template"]["spec"]["template"]["metadata"]["labels"] == labels
    assert m["metadata"]["annotations"]["rewind/run"] == "llama-70b"


def test_one_node() -> None:
    single = JobSpec(command=("python", "train.py", "--steps", "10"))
    m = k8s.jobset_manifest(single, run="small", image=IMAGE)
    assert_valid(m)
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["completions"], job["parallelism"]) == (1, 1)
    (c,) = pod_of(m)["containers"]
    assert c["command"] == ["python", "train.py", "--steps", "10"]  # one process: no torchrun, as locally
    assert "ports" not in c and "resources" not in c and "workingDir" not in c
    assert m["metadata"]["namespace"] == "default"

    ranks = JobSpec(command=("/opt/venv/bin/python", "-m", "train"), nproc_per_node=8)
    m = k8s.jobset_manifest(ranks, run="small", image=IMAGE, gpus_per_node=8)
    assert_valid(m)
    (c,) = pod_of(m)["containers"]
    assert c["command"][:5] == [
        "/opt/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=8",
    ]
    assert c["command"][-3:] == ["/opt/venv/bin/python", "-m", "train"]


def test_every_option() -> None:
    m = k8s.jobset_manifest(
        big_spec(env={"REWIND_WRITE_LIMIT": "200MiB", "PLAIN": "1"}), run="opts", image=IMAGE,
        namespace="ml-team", launch_id=0, secret="rewind-catalog", gpus_per_node=4, service_account="trainer",
        checkpoint_pvc="ckpt-rwx", working_dir="", rdzv_port=29500, cluster_domain="k8s.internal",
    )  # fmt: skip
    assert_valid(m)
    pod = pod_of(m)
    (c,) = pod["containers"]
    assert pod["serviceAccountName"] == "trainer" and "workingDir" not in c
    assert pod["volumes"] == [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt-rwx"}}]
    assert c["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/rewind/checkpoints"}]
    env = env_of(m)
    assert env["REWIND_CHECKPOINT_ROOT"] == {"name": "REWIND_CHECKPOINT_ROOT", "value": "/rewind/checkpoints"}
    assert env["REWIND_WRITE_LIMIT"]["valueFrom"]["secretKeyRef"] == {
        "name": "rewind-catalog",
        "key": "REWIND_WRITE_LIMIT",
    }
    assert env["PLAIN"]["value"] == "1"
    assert ".ml-team.svc.k8s.internal:29500" in " ".join(c["command"])
    assert c["ports"][0]["containerPort"] == 29500
    keys = m["metadata"]["annotations"]["rewind/secret-keys"].split(",")
    assert keys[:2] == ["REWIND_CATALOG_URL", "REWIND_WRITE_LIMIT"] and "REWIND_CHECKPOINT_ROOT" not in keys

    everything = k8s.jobset_manifest(big_spec(), run="opts", image=IMAGE, env_from_secret=True)
    assert_valid(everything)
    assert all("value" not in v for v in env_of(everything).values())


@pytest.mark.parametrize(
    "run",
    [
        "My_Run.LLaMA-70B",
        "UPPER__lower..dots",
        "a" * 200,
        "名前",
        "123-starts-with-digits",
        "-x-",
        "a b\tc"[:3],
        "Ünïcødé_run",
    ],
)
@pytest.mark.parametrize("nnodes", [1, 2, 1000])
def test_names_from_any_run(run: str, nnodes: int) -> None:
    m = k8s.jobset_manifest(big_spec(nnodes=nnodes), run=run, image=IMAGE, launch_id=123456789)
    assert not api_rule_errors(m), api_rule_errors(m)
    assert not crd_path() or not crd_errors(m)
    assert m["metadata"]["annotations"]["rewind/run"] == run  # the exact name, where no rule limits it
    assert k8s.names(run, nnodes=nnodes) == k8s.names(run, nnodes=nnodes)  # the same run: the same names


def test_runs_that_sanitise_alike_stay_apart() -> None:
    runs = ["a_b", "a-b", "A-B", "a.b", "a" * 100 + "x", "a" * 100 + "y"]
    jobsets = {k8s.names(r)[0] for r in runs}
    assert len(jobsets) == len(runs)
    assert k8s.names("run", launch_id=1)[0] != k8s.names("run", launch_id=2)[0]
    assert k8s.names("run", launch_id=1)[1] == k8s.names("run", launch_id=2)[1]  # one run label


def test_full_pod_validation_for_long_names() -> None:
    m = k8s.jobset_manifest(big_spec(nnodes=64), run="Z" * 200, image=IMAGE, gpus_per_node=8, launch_id=2**62)
    assert_valid(m)


def test_no_secret_value_reaches_the_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {
        "REWIND_CATALOG_URL": "postgresql+psycopg://rewind:s3cr3t-catalog@db.internal/rewind",
        "REWIND_LAUNCH_TOKEN": "launch-token-9f8e7d",
        "REWIND_MANIFEST_KEY": "manifest-hmac-key-123",
    }
    for key, value in secrets.items():  # in the generating process's environment: never read
        monkeypatch.setenv(key, value)
    in_spec = {
        "HF_TOKEN": "hf_abcdefghijkl",
        "WANDB_API_KEY": "wandb-key-55",
        "DATA_URL": "s3://user:data-pass-77@minio.internal/bucket",
        "REWIND_MANIFEST_KEY": "spec-manifest-key-66",
        "REWIND_CATALOG_URL": "postgresql://u:spec-catalog-pw@db/x",
        "AWS_SECRET_ACCESS_KEY": "aws-sk-44",
    }
    spec = big_spec(env={**in_spec, "NCCL_DEBUG": "INFO"})
    m = k8s.jobset_manifest(spec, run="secretive", image=IMAGE, secret="run-secrets")
    assert_valid(m)
    text = yaml.safe_dump(m)
    for value in [*secrets.values(), *in_spec.values()]:
        assert value not in text
    values = [v["value"] for v in env_of(m).values() if "value" in v]
    assert values == ["INFO"]
    env = env_of(m)
    for key in in_spec:
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "run-secrets"
        assert env[key]["valueFrom"]["secretKeyRef"]["key"] == key
        assert "optional" not in env[key]["valueFrom"]["secretKeyRef"]  # named by the spec: must be there
    assert set(in_spec) <= set(m["metadata"]["annotations"]["rewind/secret-keys"].split(","))


def test_any_launcher_the_spec_names() -> None:
    with pytest.raises(ConfigError, match="launcher must be local or slurm"):
        JobSpec(command=("python", "t.py"), launcher="kubernetes")  # the supervisor cannot start one
    local = k8s.jobset_manifest(big_spec(launcher="local"), run="r", image=IMAGE)
    slurm = k8s.jobset_manifest(big_spec(launcher="slurm"), run="r", image=IMAGE)
    assert local == slurm  # the job is the same wherever it runs


def test_the_spec_rdzv_endpoint_is_not_used() -> None:
    m = k8s.jobset_manifest(big_spec(rdzv_endpoint="127.0.0.1:1234"), run="r", image=IMAGE)
    (c,) = pod_of(m)["containers"]
    assert not any("127.0.0.1" in a for a in c["command"])  # the supervisor's loopback, not the pods'


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"image": ""}, "container image"),
        ({"image": "img with space"}, "container image"),
        ({"namespace": "Bad_NS"}, "namespace"),
        ({"namespace": "x" * 64}, "namespace"),
        ({"secret": "UPPER"}, "secret name"),
        ({"service_account": "a/b"}, "service account"),
        ({"checkpoint_pvc": "-pvc"}, "checkpoint PVC"),
        ({"gpus_per_node": -1}, "GPUs per node"),
        ({"gpus_per_node": True}, "GPUs per node"),
        ({"launch_id": "3"}, "launch id"),
        ({"rdzv_port": 0}, "rendezvous port"),
        ({"rdzv_port": 65535}, "rendezvous port"),  # the next port is the memory agents' store
        ({"checkpoint_mount": "relative"}, "checkpoint mount"),
        ({"run": ""}, "run name"),
        ({"run": "a/b"}, "run name"),
        ({"run": "x\ny"}, "run name"),
    ],
)
def test_bad_input_is_a_config_error(option: dict[str, Any], says: str) -> None:
    kwargs: dict[str, Any] = {"run": "r", "image": IMAGE, **option}
    with pytest.raises(ConfigError, match=says):
        k8s.jobset_manifest(big_spec(), **kwargs)


# -- the checks catch what they are for ------------------------------------------------------------


def broken(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    bad = copy.deepcopy(manifest)
    if where == "jobset":  # a misspelt JobSet field
        bad["spec"]["replicatedJob"] = bad["spec"].pop("replicatedJobs")
    elif where == "job":  # a Job field of the wrong type
        bad["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] = "2"
    elif where == "pod":  # a misspelt field deep in the pod template
        env = pod_of(bad)["containers"][0]["env"][0]
        env["valuefrom"] = env.pop("valueFrom")
    return bad


@pytest.mark.parametrize("where", ["jobset", "job", "pod"])
def test_the_checks_catch_a_broken_manifest(where: str) -> None:
    m = broken(k8s.jobset_manifest(big_spec(), run="r", image=IMAGE), where)
    assert jobset_model_diff(m)
    if where != "jobset":
        assert kube_errors(m)
    if crd_path() is not None:
        assert crd_errors(m)
    long_name = k8s.jobset_manifest(big_spec(), run="r", image=IMAGE)
    long_name["metadata"]["name"] = long_name["spec"]["network"]["subdomain"] = "a" * 50
    assert api_rule_errors(long_name)  # its pod names would pass 63 characters


def test_the_jobset_crd_schema() -> None:
    if crd_path() is None:
        pytest.skip(f"no JobSet CRD here (shared/k8s/{CRD_NAME} or $REWIND_TEST_JOBSET_CRD)")
    for spec in (big_spec(), JobSpec(command=("python", "t.py"))):
        assert not crd_errors(
            k8s.jobset_manifest(spec, run="crd", image=IMAGE, gpus_per_node=1, checkpoint_pvc="c")
        )


# -- the command line ------------------------------------------------------------------------------


def rewind(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rewind.flows.cli", *args], cwd=ROOT, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_prints_the_manifest(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "command: [python, -m, mypkg.train]\nnnodes: 2\nnproc_per_node: 8\nenv: {NCCL_DEBUG: WARN}\n"
    )
    secret_url = "postgresql+psycopg://rewind:cli-s3cret@db/rewind"
    done = rewind("k8s", "manifest", "--run", "My_Run", "--image", IMAGE, "--job-spec", str(spec_file),
                  "--namespace", "ml", "--gpus-per-node", "8", "--secret", "rw", "--launch-id", "4",
                  env={"REWIND_CATALOG_URL": secret_url})  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    expected = k8s.jobset_manifest(
        load_file(spec_file),
        run="My_Run",
        image=IMAGE,
        namespace="ml",
        gpus_per_node=8,
        secret="rw",
        launch_id=4,
    )
    assert printed == expected
    assert "cli-s3cret" not in done.stdout + done.stderr
    assert_valid(printed)


def test_cli_takes_the_run_spec_from_the_catalog(tmp_path: Path) -> None:
    from rewind.infra.catalog import jobs
    from rewind.infra.catalog.db import Catalog

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    spec = big_spec()
    jobs.set_spec(Catalog(url), "recorded", spec.as_dict())
    done = rewind("k8s", "manifest", "--run", "recorded", "--image", IMAGE, env={"REWIND_CATALOG_URL": url})
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout) == k8s.jobset_manifest(spec, run="recorded", image=IMAGE)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--run", "r"], "required: --image"),
        (["--run", "r", "--image", IMAGE, "--job-spec", "{spec}", "--namespace", "Bad_NS"], "namespace"),
        (["--run", "r", "--image", IMAGE, "--job-spec", "{tmp}/missing.yaml"], "cannot read job spec"),
        (
            ["--run", "r", "--image", IMAGE, "--job-spec", "{spec}", "--gpus-per-node", "-1"],
            "--gpus-per-node",
        ),
        (["--run", "no-such-run", "--image", IMAGE], "no run named"),
        (["--run", "a/b", "--image", IMAGE, "--job-spec", "{spec}"], "run name"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], says: str, tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("command: [python, train.py]\n")
    fill = {"spec": str(spec_file), "tmp": str(tmp_path)}
    done = rewind("k8s", "manifest", *[a.format(**fill) for a in args],
                  env={"REWIND_CATALOG_URL": f"sqlite:///{tmp_path / 'c.db'}"})  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith("rewind: error:"), err
    assert says in err, err
    assert done.stdout == ""
