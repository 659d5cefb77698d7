"""Storage tiers against real servers: one conformance suite for every tier, then S3 replication end to end."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rewind.infra.format.digest import hash_file
from rewind.infra.tiers.base import AlreadyExists, ObjectNotFound, TierAccessDenied
from rewind.infra.tiers.filesystem import FileTier
from rewind.infra.tiers.s3 import S3Tier
from tests.s3_support import BUCKET, big_checkpoint


@pytest.fixture(params=["filesystem", "s3"])
def tier(request, tmp_path):
    if request.param == "filesystem":
        return FileTier(str(tmp_path / "shared"))
    request.getfixturevalue("s3_env")
    return S3Tier(f"s3://{BUCKET}/conformance-{tmp_path.name}", part_size=5 << 20, concurrency=2)


def test_tier_conformance(tier, tmp_path):
    src = tmp_path / "blob"
    src.write_bytes(bytes(range(256)) * 50_000)  # 12.8 MB: multipart on S3 with 5 MiB parts
    crc = hash_file(src).crc32c
    tier.check()
    with pytest.raises(ObjectNotFound):
        tier.stat("run/step-1/blob")
    with pytest.raises(ObjectNotFound):
        tier.open("run/step-1/blob")
    assert tier.put("run/step-1/blob", src, crc32c=crc) == src.stat().st_size
    info = tier.stat("run/step-1/blob")
    assert info.size == src.stat().st_size and info.crc32c in (None, crc)
    with tier.open("run/step-1/blob") as f:
        assert f.read() == src.read_bytes()
    with pytest.raises(AlreadyExists):
        tier.put("run/step-1/blob", src, crc32c=crc)
    tier.put_bytes("run/step-1/manifest.json", b"{}", crc32c=hash_file_bytes(b"{}"))
    assert sorted(o.key for o in tier.list("run/step-1/")) == ["run/step-1/blob", "run/step-1/manifest.json"]
    tier.delete("run/step-1/blob")
    tier.delete("run/step-1/blob")  # deleting a missing key is fine
    assert [o.key for o in tier.list("run/")] == ["run/step-1/manifest.json"]


def hash_file_bytes(data: bytes) -> str:
    from rewind.infra.format.digest import hash_bytes

    return hash_bytes(data).crc32c


def test_s3_multipart_carries_the_manifest_crc(s3_env, tmp_path):
    """The server's own full-object CRC32C equals ours: an off-site copy is checkable without a download."""
    src = tmp_path / "big"
    src.write_bytes(bytes(range(251)) * 100_000)
    t = S3Tier(f"s3://{BUCKET}/crc", part_size=5 << 20)
    t.put("x", src, crc32c=hash_file(src).crc32c)
    assert t.stat("x").crc32c == hash_file(src).crc32c


# -- replication end to end ----------------------------------------------------------------


def test_s3_round_trip_checksums_and_deep_verify(s3_env, rewind_env, run_name, tmp_path, capsys):
    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.format import manifest as mf
    from rewind.infra.restore import plan
    from rewind.infra.tiers.transfer import copy_key

    saved = big_checkpoint(run_name, tmp_path / "ckpt")
    assert saved.total_bytes >= 256 << 20
    uri = f"s3://{BUCKET}/offsite"
    assert rewind(["replicate", run_name, "--to", uri, "--part-size-mib", "16", "--concurrency", "4"]) == 0
    manifest = mf.read(Path(saved.path))
    tier = S3Tier(uri)
    for e in manifest.files:  # the server's own checksums equal the manifest's
        info = tier.stat(f"{copy_key(run_name, 1)}/{e.path}")
        assert (info.size, info.crc32c) == (e.size, e.crc32c)
    capsys.readouterr()
    assert rewind(["ckpt", "verify", run_name, "--tier", "offsite"]) == 0
    assert rewind(["replicate", run_name, "--to", uri]) == 0  # idempotent: nothing left to send
    assert "nothing to replicate" in capsys.readouterr().out

    # Flip one byte of the stored optimizer object behind Rewind's back (no checksum sent).
    key = f"offsite/{copy_key(run_name, 1)}/optimizer.safetensors"
    client = s3_env.client()
    body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0x01
    client.delete_object(Bucket=BUCKET, Key=key)
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    assert rewind(["ckpt", "verify", run_name, "--tier", "offsite", "--deep"]) == 1
    assert "optimizer.safetensors: digest_mismatch" in capsys.readouterr().out
    cat = Catalog()
    (rep,) = [r for r in lineage.replicas_of(cat, saved.checkpoint_id) if r.tier == "offsite"]
    assert rep.status == "corrupt"
    p = plan.plan(cat, run_name, root=tmp_path / "ckpt", checkpoint_id=saved.checkpoint_id)
    assert [c.tier for c in p.candidates[0].copies] == ["local"]  # the damaged copy is never used again


def test_s3_outage_mid_replication_is_retried_and_resumed(
    s3, s3_env, prefect_api, rewind_env, run_name, tmp_path
):
    from prefect import flow

    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.tiers.transfer import copy_key
    from tests.prefect_support import wait_until

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=300)
    uri = f"s3://{BUCKET}/outage"
    manifest_key = f"outage/{copy_key(run_name, 1)}/manifest.json"
    observed: dict[str, object] = {}

    def saboteur() -> None:
        """Stop the S3 server once parts are on it, check no manifest exists, bring it back."""
        client = s3.client()

        def parts_uploaded():
            ups = client.list_multipart_uploads(Bucket=BUCKET, Prefix="outage/").get("Uploads", [])
            if not ups:
                return 0
            u = ups[0]
            return len(
                client.list_parts(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])
            )

        wait_until(lambda: parts_uploaded() >= 2, 120, "parts on the server", interval=0.05)
        s3.stop()  # a graceful stop: SeaweedFS keeps the parts it acknowledged
        s3.start()
        observed["manifest_after_outage"] = bool(
            client.list_objects_v2(Bucket=BUCKET, Prefix=manifest_key).get("Contents")
        )
        observed["parts_kept"] = parts_uploaded()

    thread = threading.Thread(target=saboteur)
    thread.start()

    @flow(name="replicate-under-outage")
    def under_outage() -> dict:
        from rewind.tasks.replicate import replicate_checkpoint as task

        # Retried every second for up to 2 minutes: the outage lasts as long as SeaweedFS takes to stop and
        # start again (seconds, longer on a loaded machine), and the task must outlast it whatever it takes.
        retrying = task.with_options(retries=120, retry_delay_seconds=1, retry_jitter_factor=None)
        return retrying(saved.checkpoint_id, uri, part_size_mib=8, concurrency=2)

    state = under_outage(return_state=True)
    thread.join(timeout=180)
    assert state.is_completed(), state.message
    result = state.result()
    assert observed["manifest_after_outage"] is False  # never a manifest for an incomplete copy
    assert 0 < result["bytes_sent"] < saved.total_bytes, (result, observed)  # only what was missing
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]})
        )
    (task_run,) = [t for t in runs if t.name.startswith("replicate-checkpoint")]
    assert task_run.run_count >= 2  # it failed during the outage and was retried
    reps = [r for r in lineage.replicas_of(Catalog(), saved.checkpoint_id) if r.tier == "offsite"]
    assert [r.status for r in reps] == ["verified"]


@pytest.mark.parametrize(
    "case",
    ["wrong_credentials", "missing_bucket", "unreachable_endpoint", "bad_bucket_name", "unknown_profile"],
)
def test_bad_targets_fail_clearly_and_record_nothing(
    case, s3_env, rewind_env, run_name, tmp_path, monkeypatch, capsys
):
    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog

    big_checkpoint(run_name, tmp_path / "ckpt", mb=1)
    uri = f"s3://{BUCKET}/bad"
    if case == "wrong_credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    elif case == "missing_bucket":
        uri = "s3://no-such-bucket/x"
    elif case == "bad_bucket_name":
        uri = "s3://b b/x"
    elif case == "unknown_profile":
        monkeypatch.setenv("AWS_PROFILE", f"no-such-profile-{run_name}")
    else:
        from rewind.infra.net import free_port

        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    capsys.readouterr()
    code = rewind(["replicate", run_name, "--to", uri])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    expected = {
        "wrong_credentials": "refused the credentials",
        "missing_bucket": "does not exist",
        "unreachable_endpoint": "unreachable",
        "bad_bucket_name": "is not a bucket name",
        "unknown_profile": "could not be found",
    }
    assert expected[case] in err
    if case in ("bad_bucket_name", "unknown_profile"):  # bad input, never retried as an outage would be
        assert code == 2, err
    assert "not-the-secret" not in err
    cat = Catalog()
    for ck in lineage.checkpoints(cat, run_name):
        assert all(r.tier == "local" for r in lineage.replicas_of(cat, ck.id))


def test_local_tier_lost_restore_from_offsite_is_bit_exact(
    reference, s3_env, rewind_env, run_name, tmp_path, capsys
):
    import shutil

    from rewind.flows.cli import main as rewind
    from tests.trainproc import TrainProc, assert_same_weights

    first = TrainProc(run_name, tmp_path / "out", extra=["--stop-after", "35"])
    first.finish()
    assert first.proc.returncode == 0
    assert rewind(["replicate", run_name, "--to", f"s3://{BUCKET}/dr"]) == 0
    shutil.rmtree(rewind_env["REWIND_CHECKPOINT_ROOT"])  # the training machine's disk is gone
    second = TrainProc(run_name, tmp_path / "out")
    out = second.finish()
    assert second.proc.returncode == 0, out.text
    assert out.resumed_at == 30, out.text
    assert all(reference[0][s] == loss for s, loss in out.losses.items())
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference[1])


def test_retention_keeps_last_every_and_pinned_on_every_tier(s3_env, rewind_env, run_name, tmp_path, capsys):
    import json

    import torch

    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer

    model = torch.nn.Linear(16, 16)
    ck = Checkpointer(run_name, states={"model": model}, root=tmp_path / "ckpt", catalog=Catalog())
    for step in range(1, 13):
        ck.save(step)
    shared, offsite = str(tmp_path / "shared"), f"s3://{BUCKET}/retention"
    assert rewind(["replicate", run_name, "--to", shared]) == 0
    assert rewind(["replicate", run_name, "--to", offsite]) == 0
    assert rewind(["ckpt", "pin", run_name, "2"]) == 0
    client = s3_env.client()

    def cut_short(step: int) -> str:  # an upload a push started under the copy and never finished
        prefix = f"retention/{run_name}/step-{step}/"
        up = client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}big.bin")["UploadId"]
        client.upload_part(
            Bucket=BUCKET, Key=f"{prefix}big.bin", UploadId=up, PartNumber=1, Body=b"x" * (5 << 20)
        )
        return prefix

    doomed, kept = cut_short(1), cut_short(12)
    capsys.readouterr()
    assert rewind(["gc", run_name, "--keep-last", "3", "--keep-every", "5", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert sorted(r["step"] for r in dry["remove"]) == [1, 3, 4, 6, 7, 8, 9]
    assert len(list((tmp_path / "ckpt" / run_name).glob("step-*"))) == 12  # a dry run removes nothing
    assert rewind(["gc", run_name, "--keep-last", "3", "--keep-every", "5", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    expected = [2, 5, 10, 11, 12]
    assert sorted(done["keep"]) == expected and done["freed_bytes"] > 0
    local = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt" / run_name).glob("step-*"))
    on_shared = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "shared" / run_name).glob("step-*"))
    on_s3 = sorted({int(o.key.split("/")[1].split("-")[1]) for o in S3Tier(offsite).list(f"{run_name}/")})
    assert local == on_shared == on_s3 == expected
    statuses = {c.step: c.status for c in lineage.checkpoints(Catalog(), run_name)}
    assert sorted(s for s, st in statuses.items() if st != "deleted") == expected
    assert {u["tier"] for u in done["usage"]} == {"local", "shared", "offsite"}
    pending = {
        p: client.list_multipart_uploads(Bucket=BUCKET, Prefix=p).get("Uploads", []) for p in (doomed, kept)
    }
    assert not pending[doomed], (
        "a deleted copy's unfinished upload is aborted (S3 bills its parts until then)"
    )
    assert len(pending[kept]) == 1  # a kept copy's is not Rewind's to let go here


@pytest.mark.parametrize("size_gib", [1, 625, 626, 5000])
def test_a_multipart_upload_never_needs_more_parts_than_s3_allows(size_gib):
    """A file over 10,000 parts of the configured size (625 GiB at 64 MiB) gets larger parts, whole MiB,
    the same on every try (a resumed upload keeps the parts it sent)."""
    from rewind.infra.tiers.s3_multipart import MAX_PARTS, MiB, part_size

    size = size_gib * 1024 * MiB + 1
    step = part_size(size, 64 * MiB)
    assert step >= 64 * MiB and step % MiB == 0 and -(-size // step) <= MAX_PARTS
    assert step == part_size(size, 64 * MiB)
    if size_gib <= 1:
        assert step == 64 * MiB


def test_a_call_the_server_does_not_implement_is_bad_input_not_an_outage():
    """501 NotImplemented (a server without, say, object lock) is never retried as a transient error is."""
    from botocore.exceptions import ClientError

    from rewind.infra.tiers.base import TierConfigError
    from rewind.infra.tiers.s3_errors import tier_error

    response = {
        "Error": {"Code": "NotImplemented", "Message": "no"},
        "ResponseMetadata": {"HTTPStatusCode": 501},
    }
    got = tier_error(ClientError(response, "PutObject"), "b", "http://127.0.0.1:1", "k")  # type: ignore[arg-type]
    assert isinstance(got, TierConfigError) and "does not implement" in str(got)


def test_an_archived_object_is_said_to_be_archived_not_a_refusal_of_the_credentials():
    """S3 answers a GET of an object a lifecycle rule moved to an archive class (Glacier, Deep Archive) 403
    InvalidObjectState: the restore's error says it is archived and what to do, and the copy is unreadable
    for now (never corrupt), not 'S3 refused the credentials'."""
    from botocore.exceptions import ClientError

    from rewind.infra.tiers.base import UNREADABLE_ERRORS, TierConfigError
    from rewind.infra.tiers.s3_errors import tier_error

    response = {
        "Error": {
            "Code": "InvalidObjectState",
            "Message": "The operation is not valid for the object's storage class",
        },
        "ResponseMetadata": {"HTTPStatusCode": 403},
    }
    got = tier_error(ClientError(response, "GetObject"), "b", "http://127.0.0.1:1", "k")  # type: ignore[arg-type]
    assert isinstance(got, TierConfigError) and isinstance(got, UNREADABLE_ERRORS)
    assert "archived" in str(got) and "RestoreObject" in str(got) and "credentials" not in str(got)


def test_a_part_size_no_server_takes_is_refused_in_one_line():
    """S3 takes parts of 5 MiB to 5 GiB: a part size outside is bad input at once, not a failure per upload."""
    from rewind.infra.tiers.base import TierConfigError

    for size in (4 << 20, (5 << 30) + 1):
        with pytest.raises(TierConfigError, match="at least 5 MiB and at most 5 GiB"):
            S3Tier(f"s3://{BUCKET}/p", part_size=size, client=object())


def test_a_server_keeping_no_checksums_has_copies_read_back_not_taken_on_their_size(
    s3_env, rewind_env, run_name, tmp_path, monkeypatch, capsys
):
    """Behind a server that keeps no CRC32C (a real proxy dropping them from every answer), a copy an earlier
    push left whose object was damaged behind Rewind's back (same size) is read back and passed over, never
    registered verified on its sizes; the copy made instead (multipart included) is read back as placed."""
    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.format import manifest as mf
    from rewind.infra.tiers import transfer
    from tests.s3_support import ChecksumlessS3

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=8)
    raw = (Path(saved.path) / mf.MANIFEST_NAME).read_bytes()
    prefix = f"no-crc-{run_name}"
    uri, key = f"s3://{BUCKET}/{prefix}", transfer.copy_key(run_name, 1)
    transfer.push(Path(saved.path), raw, S3Tier(uri), key)  # an earlier push left a whole copy here
    victim = f"{prefix}/{key}/optimizer.safetensors"
    client = s3_env.client()
    body = bytearray(client.get_object(Bucket=BUCKET, Key=victim)["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.delete_object(Bucket=BUCKET, Key=victim)
    client.put_object(Bucket=BUCKET, Key=victim, Body=bytes(body))  # damaged, same size, no checksum
    proxy = ChecksumlessS3(s3_env.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        assert rewind(["replicate", run_name, "--to", uri, "--part-size-mib", "5"]) == 0
        (rep,) = [r for r in lineage.replicas_of(Catalog(), saved.checkpoint_id) if r.tier == "offsite"]
        assert rep.key != key and rep.status == "verified"
        capsys.readouterr()
        assert rewind(["ckpt", "verify", run_name, "--tier", "offsite", "--deep"]) == 0
        assert S3Tier(uri).stat(f"{rep.key}/optimizer.safetensors").size > 5 << 20  # sent in parts
    finally:
        proxy.close()


@pytest.mark.parametrize(
    "refuses",
    [{"checksum", "if-none-match"}, {"checksum"}, {"if-none-match"}],
    ids=["checksums-and-conditions", "checksums", "conditions"],
)
def test_a_server_refusing_checksums_or_conditions_as_unsupported_still_gets_verified_copies(
    s3_env, rewind_env, run_name, tmp_path, monkeypatch, refuses
):
    """Behind a server that answers 501 NotImplemented to a write carrying a checksum, or ``If-None-Match``,
    or either (a real proxy saying so in front of the test's S3 server), replication still lands a copy,
    multipart included, every byte as saved; only what the server refused is left out, and it is not sent
    to it again (the next checkpoint's push meets no refusal); an object is still never overwritten."""
    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.format import digest
    from rewind.infra.format import manifest as mf
    from rewind.infra.tiers import s3
    from tests.s3_support import ChecksumlessS3

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=8)
    uri = f"s3://{BUCKET}/strict-{run_name}"
    keeps = "checksum" not in refuses  # a server refusing only the condition keeps its checksums
    proxy = ChecksumlessS3(s3_env.endpoint, refuses=frozenset(refuses), keeps_checksums=keeps)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        assert rewind(["replicate", run_name, "--to", uri, "--part-size-mib", "5"]) == 0
        (rep,) = [r for r in lineage.replicas_of(Catalog(), saved.checkpoint_id) if r.tier == "offsite"]
        assert rep.status == "verified"
        first = proxy.refused  # the first files in flight at once were each refused before the tier knew
        assert first > 0
        other = f"{run_name}-b"
        big_checkpoint(other, tmp_path / "ckpt-b", mb=8)
        assert rewind(["replicate", other, "--to", uri, "--part-size-mib", "5"]) == 0
        assert proxy.refused == first  # what the server refused is not sent again
        files = mf.read(Path(saved.path)).files
        tier = S3Tier(uri)
        for e in files:  # every object holds its file's bytes (read back through the proxy)
            with tier.open(f"{rep.key}/{e.path}") as body:
                assert digest.hash_bytes(body.read()).xxh3 == e.xxh3, e.path
        assert any(e.size > 5 << 20 for e in files)  # one went up in parts
        with pytest.raises(AlreadyExists):
            tier.put_bytes(f"{rep.key}/{mf.MANIFEST_NAME}", b"{}", crc32c=digest.hash_bytes(b"{}").crc32c)
        want = {"if-none-match"} & refuses | ({"checksum", "full-object"} if "checksum" in refuses else set())
        assert tier.refused == want
        assert tier.checksums is keeps  # what it keeps vouches for an upload; nothing else is read back
    finally:
        s3._REFUSED.pop(proxy.endpoint, None)  # a later proxy on the same port is another server
        proxy.close()


def test_a_server_refusing_to_show_checksums_on_a_head_still_gets_verified_copies(
    s3_env, rewind_env, run_name, tmp_path, monkeypatch
):
    """A server that answers a HEAD asking for the object's checksum (``x-amz-checksum-mode: ENABLED``) 400,
    without a body, as it answers any header it does not know (a real proxy in front of the test's S3):
    the HEAD is asked again without it, the mode not asked for again by the process, and what the push
    places is read back to be verified; the copy lands verified. Before: every HEAD failed as a
    configuration error, so nothing could be replicated or verified there."""
    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.tiers import s3
    from tests.s3_support import ChecksumlessS3

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=8)
    uri = f"s3://{BUCKET}/modeless-{run_name}"
    proxy = ChecksumlessS3(s3_env.endpoint, refuses=frozenset({"checksum-mode"}), keeps_checksums=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        assert rewind(["replicate", run_name, "--to", uri, "--part-size-mib", "5"]) == 0
        (rep,) = [r for r in lineage.replicas_of(Catalog(), saved.checkpoint_id) if r.tier == "offsite"]
        assert rep.status == "verified"
        first = proxy.refused
        assert first > 0
        assert rewind(["ckpt", "verify", run_name, "--tier", "offsite"]) == 0
        assert proxy.refused == first  # not asked for again
        tier = S3Tier(uri)
        assert tier.refused == {"checksum-mode"} and not tier.checksums
    finally:
        s3._REFUSED.pop(proxy.endpoint, None)  # a later proxy on the same port is another server
        proxy.close()


def test_credentials_that_may_not_list_the_bucket_are_told_what_they_lack(
    s3_env, rewind_env, run_name, tmp_path, monkeypatch, capsys
):
    """AWS refuses the bucket's HEAD, and answers 403 for an object that is not there, to credentials without
    s3:ListBucket, which Rewind needs (it checks the bucket, and looks before it writes): a push with such
    credentials fails in one line that says what they may lack, not only that S3 refused them; so does a
    look at an object that is not there (a real proxy answering as AWS does, in front of the test's S3)."""
    from rewind.flows.cli import main as rewind
    from tests.s3_support import ChecksumlessS3

    big_checkpoint(run_name, tmp_path / "ckpt", mb=1)
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, unlisted=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        assert rewind(["replicate", run_name, "--to", f"s3://{BUCKET}/unlisted-{run_name}"]) != 0
        tier = S3Tier(f"s3://{BUCKET}/unlisted-{run_name}")
        with pytest.raises(TierAccessDenied, match="s3:ListBucket"):
            tier.stat("absent")  # a HEAD
        with pytest.raises(TierAccessDenied, match="s3:ListBucket"):
            tier.open("absent").read()  # a GET
    finally:
        proxy.close()
    said = capsys.readouterr()
    lines = [x for x in (said.out + said.err).splitlines() if "s3:ListBucket" in x]
    assert lines and "refused the credentials" in lines[0], said.out + said.err


@pytest.mark.parametrize("held", [1, 3], ids=["refused-at-a-part", "refused-at-completion"])
def test_an_unfinished_upload_begun_without_checksums_is_sent_afresh_not_left_failing(
    s3_env, run_name, tmp_path, monkeypatch, held
):
    """A push cut short in a process that sent no checksums (its server once refused them) leaves an upload
    in parts begun without; a later process sending checksums cannot go on with it (AWS refuses a checksum
    at the next part, or, every part held, at the completion, as the real proxy here does in front of the
    test's S3): it is aborted and the file sent afresh, with its checksums, landing whole, instead of
    failing every push until the copy is deleted."""
    import random

    from rewind.infra.format import digest
    from rewind.infra.tiers import s3_multipart
    from tests.s3_support import ChecksumlessS3

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    data = random.Random(seed).randbytes(11 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, strict=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        tier = S3Tier(f"s3://{BUCKET}/afresh-{run_name}", part_size=5 << 20)
        k = tier._key("big.bin")
        begun = tier._client.create_multipart_upload(Bucket=BUCKET, Key=k)["UploadId"]
        for n in range(1, held + 1):
            piece = data[(n - 1) * (5 << 20) : n * (5 << 20)]
            tier._client.upload_part(Bucket=BUCKET, Key=k, UploadId=begun, PartNumber=n, Body=piece)
        assert tier.put("big.bin", src, crc32c=digest.hash_bytes(data).crc32c) == len(data)  # all afresh
        assert tier.refused == set() and tier.checksums  # sent with its checksums, not bare
        with tier.open("big.bin") as body:
            assert digest.hash_bytes(body.read()).xxh3 == digest.hash_bytes(data).xxh3
        assert s3_multipart.uploads(tier, k) == ()  # the one begun bare aborted, none left behind
    finally:
        proxy.close()


@pytest.mark.parametrize("completed", [False, True], ids=["aborted-meanwhile", "completed-meanwhile"])
def test_an_unfinished_upload_that_went_meanwhile_is_no_error(
    s3_env, run_name, tmp_path, monkeypatch, completed
):
    """Two senders of one copy (a scheduled push beside the job's own) may resume the same unfinished upload;
    when the other completed or aborted it before this one looked at its parts (the server's 404
    NoSuchUpload, answered at that moment by a real proxy in front of the test's S3), this one sends the
    file afresh, or, the object being there, says so (its caller holds it to its file): never that
    something 'does not exist'."""
    import random

    from rewind.infra.format import digest
    from tests.s3_support import ChecksumlessS3

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    data = random.Random(seed).randbytes(11 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, loses="parts")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        tier = S3Tier(f"s3://{BUCKET}/went-{run_name}", part_size=5 << 20)
        k = tier._key("big.bin")
        tier._client.create_multipart_upload(
            Bucket=BUCKET, Key=k, ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT"
        )
        crc = digest.hash_bytes(data).crc32c
        if completed:  # the other sender's object
            tier._client.put_object(Bucket=BUCKET, Key=k, Body=data, ChecksumCRC32C=crc)
            with pytest.raises(AlreadyExists):
                tier.put("big.bin", src, crc32c=crc)
        else:
            assert tier.put("big.bin", src, crc32c=crc) == len(data)
        assert proxy.to_lose == 0  # the upload was looked at, and had gone
        with tier.open("big.bin") as body:
            assert digest.hash_bytes(body.read()).xxh3 == digest.hash_bytes(data).xxh3
    finally:
        proxy.close()


def _random_file(tmp_path: Path, mib: int) -> tuple[Path, bytes]:
    """A file of ``mib`` MiB of seeded random bytes (the seed printed)."""
    import random

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    data = random.Random(seed).randbytes(mib << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    return src, data


def test_a_server_keeping_only_its_parts_checksums_still_gets_files_sent_in_parts(
    s3_env, run_name, tmp_path, monkeypatch
):
    """MinIO from its checksums (2023) to its full-object ones (2025) takes each part with its CRC32C, but
    answers a completion naming the whole file's CRC32C 400 XAmzContentChecksumMismatch: it holds that to a
    checksum of its parts' checksums (a real proxy answering so, in front of the test's S3). The upload is
    aborted and the file sent bare, then read back, landing whole; the next file goes bare at once (the
    refusal met once a process); no upload is left behind. Before: every file larger than one part failed
    to replicate there, as a configuration error, at every try."""
    from rewind.infra.format import digest
    from rewind.infra.tiers import s3, s3_multipart
    from rewind.infra.tiers.base import CompletionRefused
    from tests.s3_support import ChecksumlessS3

    src, data = _random_file(tmp_path, 11)
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, composite=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        tier = S3Tier(f"s3://{BUCKET}/composite-{run_name}", part_size=5 << 20)
        crc = digest.hash_bytes(data).crc32c
        with pytest.raises(CompletionRefused):  # a file that is not what its CRC32C names: its own fault
            tier.put("other.bin", src, crc32c=digest.hash_bytes(b"other").crc32c)
        assert tier.refused == set() and proxy.refused == 1  # so the server is not taken to refuse anything
        proxy.refused = 0
        assert tier.put("big.bin", src, crc32c=crc) == len(data)
        assert proxy.refused == 1 and tier.refused == {"full-object"}
        assert tier.put("again.bin", src, crc32c=crc) == len(data)
        assert proxy.refused == 1  # not asked again
        for key in ("big.bin", "again.bin"):
            with tier.open(key) as body:
                assert digest.hash_bytes(body.read()).xxh3 == digest.hash_bytes(data).xxh3, key
        left = s3_multipart.uploads(tier, tier._key(""))
        assert [u["Key"] for u in left] == [tier._key("other.bin")]  # only the refused file's, to be resumed
    finally:
        s3._REFUSED.pop(proxy.endpoint, None)  # a later proxy on the same port is another server
        proxy.close()


def test_a_large_object_read_survives_a_connection_reset_mid_range(s3_env, run_name, tmp_path, monkeypatch):
    """A restore from S3 reads a large object as ranges; a connection reset halfway through a range's body
    (botocore retries a request only until its answer's headers came) costs that range again, not the
    restore (a real proxy cutting three ranges short, in front of the test's S3: the first, the first asked
    for again, and a later one): every byte arrives, as stored. Before: the read failed, and the task's
    retry began the whole checkpoint again."""
    from rewind.infra.format import digest
    from tests.s3_support import ChecksumlessS3

    src, data = _random_file(tmp_path, 17)
    S3Tier(f"s3://{BUCKET}/cut-{run_name}").put("big.bin", src, crc32c=digest.hash_bytes(data).crc32c)
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, cuts=3)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        tier = S3Tier(f"s3://{BUCKET}/cut-{run_name}", part_size=5 << 20, concurrency=2)
        with tier.open("big.bin") as body:
            got = body.read()
        assert proxy.cuts == 0  # both cuts were made
        assert digest.hash_bytes(got).xxh3 == digest.hash_bytes(data).xxh3
    finally:
        proxy.close()


def test_deleting_a_key_already_gone_is_no_error_where_the_server_answers_404(s3_env, run_name, monkeypatch):
    """gc deletes a copy's manifest first; cut short after that, its next run deletes the manifest again.
    GCS's XML API answers a DELETE of a missing key 404 NoSuchKey (S3 204): a real proxy answering so,
    in front of the test's S3. The delete is no error, as the tier interface says, so the copy can still
    be let go; a key that is there is deleted."""
    from rewind.infra.format import digest
    from tests.s3_support import ChecksumlessS3

    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, missing_delete=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        tier = S3Tier(f"s3://{BUCKET}/gcs-{run_name}")
        with pytest.raises(ObjectNotFound):  # the proxy does answer 404 for a key that is not there
            tier._call("delete_object", tier._key("manifest.json"), Key=tier._key("manifest.json"))
        tier.delete("manifest.json")
        tier.put_bytes("there.bin", b"x", crc32c=digest.hash_bytes(b"x").crc32c)
        tier.delete("there.bin")
        with pytest.raises(ObjectNotFound):
            tier.stat("there.bin")
    finally:
        proxy.close()


def test_a_copy_that_finds_its_target_placed_meanwhile_is_no_error(s3_env, run_name, tmp_path, monkeypatch):
    """A push copies unchanged files from an earlier copy on the same bucket (CopyObject, If-None-Match);
    when the copy's target is there by the time it lands (another sender of the copy came first, or the
    retry of a copy whose answer was lost finds its own: 412, answered once by a real proxy in front of the
    test's S3), the object is held to its file and kept: the push lands every file. Before: the push
    failed, not retried (AlreadyExists is no transient error)."""
    from rewind.infra.format import digest
    from rewind.infra.format import manifest as mf
    from rewind.infra.tiers import transfer
    from tests.s3_support import ChecksumlessS3

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=8)
    raw = (Path(saved.path) / mf.MANIFEST_NAME).read_bytes()
    uri = f"s3://{BUCKET}/copied-{run_name}"
    transfer.push(Path(saved.path), raw, S3Tier(uri), "first")
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, loses="copy")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        tier = S3Tier(uri)
        reuse = [transfer.Reuse("first", digest.manifest_digest(raw))]
        done = transfer.push(Path(saved.path), raw, tier, "second", reuse=reuse)
        assert proxy.to_lose == 0  # one copy found its target placed
        files = mf.parse(raw).files
        assert done.sent == 0 and done.files_reused == len(files)
        for e in files:
            with tier.open(f"second/{e.path}") as body:
                assert digest.hash_bytes(body.read()).xxh3 == e.xxh3, e.path
    finally:
        proxy.close()


def test_a_completion_whose_answer_was_lost_is_no_error(s3_env, rewind_env, run_name, tmp_path, monkeypatch):
    """A completion that succeeded but whose answer was lost is retried and finds its upload gone (404
    NoSuchUpload, answered by a real proxy in front of the test's S3 after passing the completion on): the
    push finds the object in place, holds it to its file, and the copy is verified; before, the push failed
    saying the object 'does not exist'."""
    from rewind.flows.cli import main as rewind
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.format import manifest as mf
    from tests.s3_support import ChecksumlessS3

    saved = big_checkpoint(run_name, tmp_path / "ckpt", mb=8)
    assert any(e.size > 5 << 20 for e in mf.read(Path(saved.path)).files)  # one goes up in parts
    proxy = ChecksumlessS3(s3_env.endpoint, keeps_checksums=True, loses="completion")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        uri = f"s3://{BUCKET}/lost-{run_name}"
        assert rewind(["replicate", run_name, "--to", uri, "--part-size-mib", "5"]) == 0
        assert proxy.to_lose == 0
    finally:
        proxy.close()
    (rep,) = [r for r in lineage.replicas_of(Catalog(), saved.checkpoint_id) if r.tier == "offsite"]
    assert rep.status == "verified"
