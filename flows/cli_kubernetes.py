"""`rewind k8s manifest --run RUN --image IMAGE [...]`: a run's job as a JobSet manifest, YAML on stdout.

The job spec comes from ``--job-spec FILE`` or, without it, from the run's spec in the catalog. Nothing
is applied: ``kubectl apply -f -`` (or the official client) does that where a cluster is configured.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap, count


def cmd_manifest(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    import yaml

    from rewind.infra.launch.kubernetes import jobset_manifest
    from rewind.infra.launch.spec import JobSpec, load_file

    if args.job_spec:
        spec = load_file(args.job_spec)
    else:
        from rewind.infra.catalog import jobs

        spec = JobSpec.from_dict(jobs.get_spec(catalog(), args.run))
    manifest = jobset_manifest(
        spec,
        run=args.run,
        image=args.image,
        namespace=args.namespace,
        launch_id=args.launch_id,
        secret=args.secret,
        gpus_per_node=args.gpus_per_node,
        service_account=args.service_account,
        checkpoint_pvc=args.checkpoint_pvc,
        working_dir=args.workdir,
        env_from_secret=args.env_from_secret,
    )
    sys.stdout.write(yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True))
    return 0


def register(sub: Any, add: Add, wrap: Wrap) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes: a run's job as a JobSet manifest").add_subparsers(
        dest="k8s_command", required=True, metavar="ACTION"
    )
    mf = add(
        k8s,
        "manifest",
        wrap(cmd_manifest),
        "print the JobSet (jobset.x-k8s.io/v1alpha2) that runs the job, as YAML: one pod per node, "
        "secrets only as references to a Secret; nothing is applied",
    )
    mf.add_argument("--run", required=True, help="the run (names the JobSet, its labels and the rendezvous)")
    mf.add_argument("--image", required=True, help="the container image holding the job and Rewind")
    mf.add_argument(
        "--job-spec",
        metavar="FILE",
        help="the job spec (JSON or YAML); default: the run's spec in the catalog",
    )
    mf.add_argument("--namespace", default="default")
    mf.add_argument("--gpus-per-node", type=count, default=None, metavar="N", help="nvidia.com/gpu per pod")
    mf.add_argument(
        "--secret",
        metavar="NAME",
        help="the Secret holding REWIND_CATALOG_URL and the launch's variables (default: the JobSet's name)",
    )
    mf.add_argument("--service-account", metavar="NAME")
    mf.add_argument(
        "--checkpoint-pvc",
        metavar="CLAIM",
        help="a PersistentVolumeClaim mounted as the local checkpoint tier (ReadWriteMany for several nodes)",
    )
    mf.add_argument(
        "--launch-id", type=count, default=None, metavar="N", help="the launch (names the JobSet)"
    )
    mf.add_argument("--workdir", help="the container's working directory (default: the spec's cwd)")
    mf.add_argument(
        "--env-from-secret",
        action="store_true",
        help="every variable of the spec from the Secret, none by value",
    )
