"""Storage tiers against real servers: one conformance suite for every tier, then S3 replication end to end."""

from __future__ import annotations

import pytest

from infra.digest import hash_file
from infra.tiers.base import AlreadyExists, ObjectNotFound
from infra.tiers.filesystem import FileTier
from infra.tiers.s3 import S3Tier
from tests.s3_support import SeaweedS3

pytestmark = pytest.mark.xdist_group("prefect")  # shares the worker (and CPU budget) with the flow tests
BUCKET = "rewind"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    return s3


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
    from infra.digest import hash_bytes

    return hash_bytes(data).crc32c


def test_s3_multipart_carries_the_manifest_crc(s3_env, tmp_path):
    """The server's own full-object CRC32C equals ours: an off-site copy is checkable without a download."""
    src = tmp_path / "big"
    src.write_bytes(bytes(range(251)) * 100_000)
    t = S3Tier(f"s3://{BUCKET}/crc", part_size=5 << 20)
    t.put("x", src, crc32c=hash_file(src).crc32c)
    assert t.stat("x").crc32c == hash_file(src).crc32c
