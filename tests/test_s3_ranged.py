"""Large S3 objects are read as ranges in flight, in order, and never as a mix of two objects."""

from __future__ import annotations

import os

import pytest

from rewind.infra.format.digest import hash_bytes
from rewind.infra.tiers.base import TierUnavailable
from rewind.infra.tiers.s3 import S3Tier
from tests.s3_support import BUCKET

PART = 5 << 20


@pytest.mark.parametrize("size", [0, 1, PART, PART + 1, 3 * PART + 12345])
def test_an_object_reads_back_whole_in_any_read_size(s3_env, tmp_path, size):
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"seed {seed}")
    data = (seed.to_bytes(4, "big") * (size // 4 + 1))[:size]
    src = tmp_path / "blob"
    src.write_bytes(data)
    tier = S3Tier(f"s3://{BUCKET}/ranged-{tmp_path.name}", part_size=PART, concurrency=3)
    tier.put("blob", src, crc32c=hash_bytes(data).crc32c)
    with tier.open("blob") as f:
        assert f.read() == data
    with tier.open("blob") as f:
        got = bytearray()
        while piece := f.read(1 << 20 | 7):  # reads that straddle the ranges
            got += piece
    assert bytes(got) == data


def test_an_object_replaced_mid_read_is_an_error_not_a_mix(s3_env, tmp_path):
    tier = S3Tier(f"s3://{BUCKET}/ranged-swap-{tmp_path.name}", part_size=PART, concurrency=1)
    a = b"a" * (4 * PART)
    src = tmp_path / "a"
    src.write_bytes(a)
    tier.put("blob", src, crc32c=hash_bytes(a).crc32c)
    with tier.open("blob") as f:
        assert f.read(PART) == a[:PART]  # the first range, and one request ahead
        client = s3_env.client()
        client.put_object(Bucket=BUCKET, Key=f"ranged-swap-{tmp_path.name}/blob", Body=b"b" * (4 * PART))
        with pytest.raises(TierUnavailable, match="changed while it was being read"):
            while f.read(PART):
                pass
