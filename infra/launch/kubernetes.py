"""The Kubernetes launcher, on paper: a job spec as a JobSet manifest (``jobset.x-k8s.io/v1alpha2``).

``jobset_manifest`` is a pure function: it reads no cluster, no catalog and no environment. What
it returns is what ``kubectl apply -f`` (or the official client's ``create_namespaced_custom_object``)
would be given: one replicated Job of ``spec.nnodes`` pods (an Indexed Job, completions = parallelism =
nnodes), each pod running its node's torchrun agent exactly as the local and Slurm launchers do
(``spec.agent_command``; with several nodes under the pod's memory agent, ``host_agent``, as on Slurm),
the rendezvous on pod 0's stable name behind the JobSet's headless service.

Rewind does the recovery, not Kubernetes: ``backoffLimit: 0``, ``restartPolicy: Never`` and JobSet's
``failurePolicy.maxRestarts: 0``, so a lost pod fails the JobSet once and stays failed.

Secrets never enter the manifest. The catalog URL, the launch's handoff (``REWIND_LAUNCH_ID``,
``REWIND_LAUNCH_TOKEN``, ``REWIND_LR_SCALE``, ``REWIND_GLOBAL_BATCH``, ``REWIND_LAYOUT``), the signing keys, every
``REWIND_*`` variable of the spec and every spec variable that looks secret (``redact``'s rules: a
secret-looking name, a URL with a password) reach the pods only as ``secretKeyRef``s into one Secret,
under the variable's own name as the key; the manifest's ``rewind/secret-keys`` annotation lists them.
The node index is the pod's Job completion index (``REWIND_NODE``, from the pod's annotation).

Checked on paper (tests/test_kubernetes.py): against JobSet's API models and the Kubernetes API schema,
and against the JobSet CRD's schema where that file is at hand; never applied to a cluster by Rewind.
"""

from __future__ import annotations

import hashlib
import re
import sys
from typing import Any

from rewind.infra import redact
from rewind.infra.catalog.lineage import check_run_name
from rewind.infra.errors import ConfigError
from rewind.infra.launch import host_agent
from rewind.infra.launch.spec import JobSpec, agent_command, process_command
from rewind.infra.training import progress

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KIND = "JobSet"
NODE_JOB = "node"  # the replicated Job's name, and the container's
RDZV_PORT = 29400
JOIN_S = (
    600.0  # how long pods' memory agents wait to meet: torchrun's rendezvous waits as long (pods start apart)
)
GPU_RESOURCE = "nvidia.com/gpu"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the pod annotation an Indexed Job sets
CHECKPOINT_MOUNT = "/rewind/checkpoints"
LABEL_RUN, LABEL_LAUNCH = "rewind/run", "rewind/launch"
ANNOTATION_RUN, ANNOTATION_SECRET, ANNOTATION_KEYS = "rewind/run", "rewind/secret", "rewind/secret-keys"
MANAGED_BY = "app.kubernetes.io/managed-by"

CATALOG_ENV = "REWIND_CATALOG_URL"
CHECKPOINT_ENV = "REWIND_CHECKPOINT_ROOT"
# From the Secret when it holds them (optional keys): what the supervisor hands a local or Slurm launch's
# processes (supervisor._handoff_env), where the local tier is, and the manifest signing keys.
OPTIONAL_SECRET_ENV = (
    progress.LAUNCH_ENV,
    progress.TOKEN_ENV,
    "REWIND_LR_SCALE",
    "REWIND_GLOBAL_BATCH",
    "REWIND_LAYOUT",
    CHECKPOINT_ENV,
    "REWIND_MANIFEST_KEY",
    "REWIND_MANIFEST_PREVIOUS_KEYS",
)

POD_NAME_MAX = 63  # JobSet's webhook: <jobset>-<job>-<job index>-<pod index>-<5 chars> is a DNS-1035 label
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def names(run: str, *, nnodes: int = 1, launch_id: int | None = None) -> tuple[str, str]:
    """The JobSet's name and the run's label value, both DNS-1035 labels derived from ``run``.

    Lower-cased, anything but letters and digits made ``-``, leading digits dropped, cut so that
    every pod name JobSet derives fits in 63 characters, then a hash of the exact run name (two
    runs that sanitise alike stay apart) and the launch id, if any.
    """
    if not isinstance(run, str):
        raise ConfigError("a Kubernetes manifest needs a run name")
    check_run_name(run)  # what the catalog would take: no control characters in a label or the rendezvous id
    slug = re.sub(r"^[^a-z]+", "", re.sub(r"[^a-z0-9]+", "-", run.lower()))
    digest = "-" + hashlib.sha256(run.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    launch = f"-{launch_id}" if launch_id is not None else ""
    room = POD_NAME_MAX - len(f"-{NODE_JOB}-0-{nnodes - 1}-abcde") - len(digest) - len(launch)
    if room < 1:
        raise ConfigError(f"{nnodes} nodes leave no room for a JobSet name within 63 characters")
    head = slug[:room].strip("-") or "run"
    return f"{head}{digest}{launch}", f"{head}{digest}"


def jobset_manifest(
    spec: JobSpec,
    *,
    run: str,
    image: str,
    namespace: str = "default",
    launch_id: int | None = None,
    secret: str | None = None,
    gpus_per_node: int | None = None,
    service_account: str | None = None,
    checkpoint_pvc: str | None = None,
    checkpoint_mount: str = CHECKPOINT_MOUNT,
    working_dir: str | None = None,
    env_from_secret: bool = False,
    rdzv_port: int = RDZV_PORT,
    cluster_domain: str = "cluster.local",
) -> dict[str, Any]:
    """The JobSet that runs ``spec`` for ``run`` in ``namespace`` from ``image``.

    ``secret``: the Secret the pods' Rewind variables come from (default: the JobSet's name).
    ``gpus_per_node``: ``nvidia.com/gpu`` requested (and limited) per pod. ``checkpoint_pvc``: a
    PersistentVolumeClaim (ReadWriteMany with more than one node) mounted at ``checkpoint_mount``,
    which becomes ``REWIND_CHECKPOINT_ROOT``. ``working_dir``: the container's (default: the spec's
    ``cwd``; ``""``: the image's). ``env_from_secret``: every spec variable by reference, none by value.
    Any launcher the spec names is fine: the job is the same wherever it runs.
    """
    _check_options(image=image, namespace=namespace, secret=secret, launch_id=launch_id,
                   gpus_per_node=gpus_per_node, service_account=service_account, checkpoint_pvc=checkpoint_pvc,
                   checkpoint_mount=checkpoint_mount, rdzv_port=rdzv_port, cluster_domain=cluster_domain)  # fmt: skip
    nodes = spec.nnodes if spec.distributed else 1
    name, run_label = names(run, nnodes=nodes, launch_id=launch_id)
    secret = name if secret is None else secret
    env, keys = _env(spec, secret=secret, checkpoint_mount=checkpoint_mount if checkpoint_pvc else None,
                     env_from_secret=env_from_secret)  # fmt: skip
    labels = {MANAGED_BY: "rewind", LABEL_RUN: run_label}
    if launch_id is not None:
        labels[LABEL_LAUNCH] = str(launch_id)
    command = _command(spec, run=run, name=name, namespace=namespace, launch_id=launch_id, rdzv_port=rdzv_port,
                       cluster_domain=cluster_domain)  # fmt: skip
    container: dict[str, Any] = {"name": NODE_JOB, "image": image, "command": command, "env": env}
    workdir = spec.cwd if working_dir is None else working_dir
    if workdir:
        container["workingDir"] = workdir
    if spec.distributed:
        container["ports"] = [{"name": "rdzv", "containerPort": rdzv_port, "protocol": "TCP"}]
    if spec.distributed and nodes > 1:  # the memory agents' store (for whoever writes a NetworkPolicy)
        container["ports"].append({"name": "agents", "containerPort": rdzv_port + 1, "protocol": "TCP"})
    pod = _pod(container, gpus_per_node=gpus_per_node, service_account=service_account,
               checkpoint_pvc=checkpoint_pvc, checkpoint_mount=checkpoint_mount)  # fmt: skip
    metadata = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "annotations": {ANNOTATION_RUN: run, ANNOTATION_SECRET: secret, ANNOTATION_KEYS: ",".join(keys)},
    }
    return _jobset(metadata, pod, nodes=nodes)


def _command(
    spec: JobSpec, *, run: str, name: str, namespace: str, launch_id: int | None, rdzv_port: int,
    cluster_domain: str,
) -> list[str]:  # fmt: skip
    """The container's command: every pod's torchrun agent meets on pod 0's stable name (under the pod's
    memory agent, ``host_agent``: the next port is its store), or the one process."""
    if not spec.distributed:
        return _in_image(process_command(spec), spec)
    host = (
        f"{name}-{NODE_JOB}-0-0.{name}.{namespace}.svc.{cluster_domain}"  # resolves on pod 0 from /etc/hosts
    )
    rdzv_id = run if launch_id is None else f"{run}-{launch_id}"
    torchrun = _in_image(agent_command(spec, endpoint=f"{host}:{rdzv_port}", rdzv_id=rdzv_id), spec)
    # under the pod's memory agent (its node: the pod's index), whose store is pod 0's, beside the rendezvous
    return host_agent.command(None, spec.nnodes, f"{host}:{rdzv_port + 1}", rdzv_id, torchrun, join_s=JOIN_S)


def _jobset(metadata: dict[str, Any], pod: dict[str, Any], *, nodes: int) -> dict[str, Any]:
    """One replicated job of ``nodes`` indexed pods, none restarted by Kubernetes (Rewind relaunches)."""
    labels = metadata["labels"]
    job = {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": 0,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "network": {
                "enableDNSHostnames": True,
                "subdomain": metadata["name"],
                "publishNotReadyAddresses": True,
            },
            "replicatedJobs": [
                {
                    "name": NODE_JOB,
                    "replicas": 1,
                    "template": {"metadata": {"labels": dict(labels)}, "spec": job},
                }
            ],
        },
    }


def _pod(
    container: dict[str, Any],
    *,
    gpus_per_node: int | None,
    service_account: str | None,
    checkpoint_pvc: str | None,
    checkpoint_mount: str,
) -> dict[str, Any]:
    """The pod template around ``container``: its GPUs, service account and checkpoint volume."""
    if gpus_per_node:
        gpus = {GPU_RESOURCE: str(gpus_per_node)}
        container["resources"] = {"requests": dict(gpus), "limits": dict(gpus)}
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if service_account:
        pod["serviceAccountName"] = service_account
    if checkpoint_pvc:
        container["volumeMounts"] = [{"name": "checkpoints", "mountPath": checkpoint_mount}]
        pod["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_pvc}}]
    return pod


def _env(
    spec: JobSpec, *, secret: str, checkpoint_mount: str | None, env_from_secret: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """The container's variables, and the Secret's keys they name (required ones first)."""
    node = {"name": progress.NODE_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}  # fmt: skip
    env: list[dict[str, Any]] = [node]
    own = {progress.NODE_ENV} | ({CHECKPOINT_ENV} if checkpoint_mount else set())
    required = [CATALOG_ENV]
    for key, value in spec.env.items():
        if key in own or key == CATALOG_ENV:
            continue
        if env_from_secret or key.startswith("REWIND_") or _looks_secret(key, value):
            if not _SECRET_KEY.fullmatch(key):
                raise ConfigError(
                    f"job spec variable {key!r:.60} must come from a Secret, and is no Secret key"
                )
            required.append(key)
        else:
            env.append({"name": key, "value": value})
    if checkpoint_mount:
        env.append({"name": CHECKPOINT_ENV, "value": checkpoint_mount})
    optional = [k for k in OPTIONAL_SECRET_ENV if k not in own and k not in required]
    for key, is_optional in [(k, False) for k in required] + [(k, True) for k in optional]:
        ref: dict[str, Any] = {"name": secret, "key": key}
        if is_optional:
            ref["optional"] = True
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env, required + optional


def _looks_secret(key: str, value: str) -> bool:
    """What ``redact`` would hide in a record: a secret-looking name, or a URL's user:password."""
    return redact.argv([f"{key}={value}"]) != [f"{key}={value}"] or redact.text(value) != value


def _in_image(command: list[str], spec: JobSpec) -> list[str]:
    """``process_command`` makes a bare ``python`` this machine's interpreter; in the image it is the
    image's ``python`` again (first, and again after the ``--`` where the job's own command starts)."""
    bare = spec.command[0]
    if bare not in ("python", "python3"):
        return command
    starts = {0} | ({command.index("--") + 1} if "--" in command else set())
    return [bare if i in starts and arg == sys.executable else arg for i, arg in enumerate(command)]


def _check_options(
    *,
    image: str,
    namespace: str,
    secret: str | None,
    launch_id: int | None,
    gpus_per_node: int | None,
    service_account: str | None,
    checkpoint_pvc: str | None,
    checkpoint_mount: str,
    rdzv_port: int,
    cluster_domain: str,
) -> None:
    if not isinstance(image, str) or not image or any(c.isspace() or not c.isprintable() for c in image):
        raise ConfigError(
            f"a container image is a name without spaces, e.g. registry/train:1.0, not {image!r:.60}"
        )
    if not isinstance(namespace, str) or len(namespace) > 63 or not _LABEL.fullmatch(namespace):
        raise ConfigError(f"a namespace is a DNS-1123 label (a-z, 0-9, -; at most 63), not {namespace!r:.60}")
    for what, value in (("secret", secret), ("service account", service_account),
                        ("checkpoint PVC", checkpoint_pvc), ("cluster domain", cluster_domain)):  # fmt: skip
        if value is not None and (
            not isinstance(value, str) or len(value) > 253 or not _SUBDOMAIN.fullmatch(value)
        ):
            raise ConfigError(f"a {what} name is a DNS-1123 subdomain (a-z, 0-9, -, .), not {value!r:.60}")
    for what, number, low, high in (("launch id", launch_id, 0, 2**63 - 1),
                                    ("GPUs per node", gpus_per_node, 0, 2**31 - 1),
                                    ("rendezvous port", rdzv_port, 1, 65534)):  # fmt: skip
        if number is not None and (type(number) is not int or not low <= number <= high):
            raise ConfigError(f"{what} must be a whole number from {low} to {high}, not {number!r:.40}")
    if (
        not isinstance(checkpoint_mount, str)
        or not checkpoint_mount.startswith("/")
        or ":" in checkpoint_mount
    ):
        raise ConfigError(
            f"the checkpoint mount is an absolute path without ':', not {checkpoint_mount!r:.60}"
        )
