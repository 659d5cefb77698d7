"""Off-site replication speed against plain boto3, on a real S3 server (SeaweedFS) on loopback.

    python -m bench.s3 [--gib 1.0] [--repeat 3]

Rewind's replication of a checkpoint (the local copy re-verified against the
catalog first, then sent, then proven on the server) vs ``boto3 upload_file`` of
the same bytes to the same server, in the same run (medians); and the time of a
quick verify of the off-site copy (server-side checksums and sizes, no download).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from boto3.s3.transfer import TransferConfig

from bench.run import HERE, Blob, machine
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.drills.servers import SeaweedS3
from rewind.infra.format import keyring
from rewind.infra.replication import replicate
from rewind.infra.tiers.s3 import S3Tier
from rewind.infra.tiers.transfer import check_remote


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--part-size-mib", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    return p


def measure(server: SeaweedS3, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` alternating rounds: boto3's upload_file of the data file, Rewind's replicate of the
    checkpoint, a quick verify of the off-site copy; medians."""
    client = server.client()
    client.create_bucket(Bucket="bench")
    torch.manual_seed(0)
    cat = Catalog(f"sqlite:///{work / 'c.db'}")
    ck = Checkpointer("s3bench", states={"model": Blob(args.gib)}, root=work / "ckpt", catalog=cat)
    ck.save(1)
    saved = ck.last_saved
    assert saved is not None
    row = lineage.get_checkpoint(cat, saved.checkpoint_id)
    cfg = TransferConfig(multipart_chunksize=args.part_size_mib << 20, max_concurrency=args.concurrency)
    ours, theirs, quick = [], [], []
    for i in range(args.repeat):
        t0 = time.perf_counter()
        client.upload_file(str(Path(saved.path) / "model.safetensors"), "bench", f"plain/{i}/model.safetensors",
                           Config=cfg)  # fmt: skip
        theirs.append(time.perf_counter() - t0)
        tier = S3Tier(
            f"s3://bench/rewind{i}", part_size=args.part_size_mib << 20, concurrency=args.concurrency
        )
        t0 = time.perf_counter()  # the whole path: source proven against the catalog, sent, proven there
        done = replicate(cat, row, tier, root=work / "ckpt")
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        report = check_remote(
            tier, done.key, str(row.manifest_digest), deep=False, keyring=keyring.from_env()
        )
        quick.append(time.perf_counter() - t0)
        if not report.ok:
            raise RuntimeError(f"off-site copy does not verify: {report.findings}")
    res: dict[str, Any] = {
        "machine": machine(),
        "bytes": saved.total_bytes,
        "boto3_upload_file_s": statistics.median(theirs),
        "rewind_replicate_s": statistics.median(ours),
        "quick_verify_s": statistics.median(quick),
    }
    res["replicate_throughput_ratio_vs_upload_file"] = res["boto3_upload_file_s"] / res["rewind_replicate_s"]
    return res


def report(res: dict[str, Any], repeat: int) -> None:
    gb = res["bytes"] / 1e9
    print(f"== replicate {gb:.2f} GB to SeaweedFS on loopback (median of {repeat}) ==")
    print(
        f"  boto3 upload_file   {res['boto3_upload_file_s']:7.2f} s  {gb / res['boto3_upload_file_s']:6.3f} GB/s"
    )
    print(
        f"  rewind replicate    {res['rewind_replicate_s']:7.2f} s  {gb / res['rewind_replicate_s']:6.3f} GB/s"
    )
    print(f"  throughput ratio    {res['replicate_throughput_ratio_vs_upload_file']:.2f}x of upload_file")
    print(f"  quick verify        {res['quick_verify_s']:.3f} s (server-side CRC32C and sizes, no download)")
    out = HERE / "results.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged["s3"] = res
    merged["replicate_ratio_vs_upload_file"] = res["replicate_throughput_ratio_vs_upload_file"]
    merged["offsite_quick_verify_s"] = res["quick_verify_s"]
    out.write_text(json.dumps(merged, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rewind-s3bench-", dir=HERE))
    server = SeaweedS3(work / "weed")
    server.start()
    try:
        os.environ.update(server.env)
        report(measure(server, work, args), args.repeat)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
