"""A large catalog built in a few bulk statements (``INSERT ... SELECT generate_series``), Postgres only.

The shape follows what Rewind writes over months of training, not random rows: runs of chained
checkpoints (``parent_id`` the previous step), the oldest fifth deleted by retention except every
50th (kept by ``keep_every``), one in 97 corrupt (every other one of those for its content), every
250th pinned, the newest two of every seventh run committed but not verified yet, every tenth run
rolled back once (a superseded branch of a twentieth of its length beside the live chain, and the
incidents that caused it), one aborted save per run; three files per checkpoint; copies on two or
three tiers (local and shared for all, off-site for every third step, its newest ten still pending)
whose statuses follow the checkpoint's; a live and an expired restore lease on the first run.

Used by ``bench/catalog_scale.py`` (100,000 checkpoints) and by ``tests/test_catalog_scale.py``
(a few thousand). Builds into an empty, migrated catalog.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text


@dataclass(frozen=True)
class Shape:
    runs: int = 100
    per_run: int = 1_000  # checkpoints on each run's live chain ...
    big_run_size: int = 0  # ... except run 1, when this is set
    every_step: int = 100  # steps between checkpoints

    def size(self, run: int) -> int:
        return self.big_run_size if run == 1 and self.big_run_size else self.per_run

    @property
    def chained(self) -> int:
        """Checkpoints on the live chains (forks and aborted saves come on top)."""
        return sum(self.size(r) for r in range(1, self.runs + 1))


def run_name(run: int) -> str:
    return f"synthetic-{run:05d}"


def fork_run(shape: Shape) -> int:
    """A run that was rolled back once (every tenth run; the first such)."""
    return min(10, shape.runs)


# One row per run: its size and where its checkpoint ids start (ids are assigned, so parents chain).
_SIZES = """
CREATE TEMP TABLE synthetic_size (run_id int PRIMARY KEY, n int, base bigint, fork int) ON COMMIT DROP
"""

_RUNS = """
INSERT INTO run (id, name, created_at)
SELECT run_id, 'synthetic-' || lpad(run_id::text, 5, '0'), now() - interval '60 days' + run_id * interval '1 hour'
FROM synthetic_size
"""

_CHAIN = """
INSERT INTO checkpoint (id, run_id, step, parent_id, status, status_reason, path, layout, total_bytes,
    manifest_digest, environment, metrics, pinned, save_stall_s, created_at, committed_at, verified_at,
    updated_at)
SELECT z.base + i, z.run_id, i * :every, CASE WHEN i > 1 THEN z.base + i - 1 END,
    CASE WHEN i <= z.n / 5 AND i % 50 <> 0 THEN 'deleted'
         WHEN i % 97 = 0 THEN 'corrupt'
         WHEN z.run_id % 7 = 4 AND i > z.n - 2 THEN 'committed'
         ELSE 'verified' END,
    CASE WHEN i <= z.n / 5 AND i % 50 <> 0 THEN 'retention policy'
         WHEN i % 194 = 0 THEN 'content: state does not load: shape mismatch in layer.3'
         WHEN i % 97 = 0 THEN 'no copy verifies: local: corrupt (model.safetensors: digest)'
         END,
    '/data/rewind/checkpoints/' || r.name || '/step-' || (i * :every),
    '{"world_size": 8, "format": "plain", "parts": ["model", "optimizer", "rng"]}',
    2147483648 + i, md5(z.run_id || ':' || i) || md5(i || ':' || z.run_id),
    json_build_object('hostname', 'node-' || (z.run_id % 16), 'pid', 1000 + z.run_id, 'python', '3.11.7',
        'torch', '2.13.0', 'writer', 'rewind.Checkpointer'),
    json_build_object('loss', round((3.0 / (1 + i * 0.01))::numeric, 5)),
    i % 250 = 0, 0.08 + (i % 7) * 0.001,
    r.created_at + i * interval '10 minutes', r.created_at + i * interval '10 minutes' + interval '4 s',
    CASE WHEN i > z.n / 5 AND i % 97 <> 0 THEN r.created_at + i * interval '10 minutes' + interval '30 s' END,
    r.created_at + i * interval '10 minutes' + interval '30 s'
FROM synthetic_size z JOIN run r ON r.id = z.run_id CROSS JOIN LATERAL generate_series(1, z.n) AS i
"""

# Every tenth run was rolled back from the middle: the abandoned branch, superseded, beside the live chain.
_FORKS = """
INSERT INTO checkpoint (run_id, step, parent_id, status, status_reason, path, layout, total_bytes,
    manifest_digest, environment, metrics, pinned, created_at, committed_at, verified_at, updated_at)
SELECT z.run_id, (z.n / 2 + j) * :every, z.base + z.n / 2, 'superseded', 'rolled back to step ' || (z.n / 2) * :every,
    '/data/rewind/checkpoints/' || r.name || '/.superseded/step-' || ((z.n / 2 + j) * :every),
    '{"world_size": 8, "format": "plain", "parts": ["model", "optimizer", "rng"]}', 2147483648 + j,
    md5('fork' || z.run_id || '-' || j) || md5(j || '-fork'), '{}', '{"loss": 9.9}', false,
    r.created_at + j * interval '1 minute', r.created_at + j * interval '1 minute', NULL,
    now() - interval '30 days'
FROM synthetic_size z JOIN run r ON r.id = z.run_id CROSS JOIN LATERAL generate_series(1, z.fork) AS j
WHERE z.fork > 0
"""

_ABORTED = """
INSERT INTO checkpoint (run_id, step, status, status_reason, path, layout, environment, metrics, pinned,
    created_at, updated_at)
SELECT z.run_id, z.n * :every + :every / 2, 'aborted', 'the writer died before the commit',
    '/data/rewind/checkpoints/' || r.name || '/step-' || (z.n * :every + :every / 2), '{}', '{}', '{}', false,
    now() - interval '10 days', now() - interval '10 days'
FROM synthetic_size z JOIN run r ON r.id = z.run_id
"""

_FILES = """
INSERT INTO checkpoint_file (checkpoint_id, path, size, xxh3, crc32c)
SELECT c.id, f.path, f.size, substr(md5(c.id || f.path), 1, 32), substr(md5(f.path || c.id), 1, 8)
FROM checkpoint c CROSS JOIN (VALUES ('model.safetensors', 1073741824), ('optimizer.safetensors', 1073741824),
    ('state.json', 4096)) AS f(path, size)
WHERE c.manifest_digest IS NOT NULL
"""

# Copies follow their checkpoint: gone with a deleted one, corrupt or missing for a corrupt one.
_COPIES = """
INSERT INTO replica (checkpoint_id, tier, uri, key, status, detail, bytes, created_at, verified_at, checked_at)
SELECT c.id, t.tier,
    CASE t.tier WHEN 'local' THEN c.path WHEN 'shared' THEN '/mnt/shared/rewind' ELSE 's3://rewind-offsite/prod' END,
    CASE WHEN t.tier = 'local' THEN NULL ELSE r.name || '/step-' || c.step END,
    CASE WHEN c.status = 'deleted' THEN 'deleted'
         WHEN c.status = 'corrupt' THEN CASE t.tier WHEN 'local' THEN 'corrupt' ELSE 'missing' END
         WHEN t.tier = 'offsite' AND c.step > z.n * :every - 10 * :every THEN 'pending'
         WHEN c.status = 'committed' THEN 'pending'
         ELSE 'verified' END,
    CASE WHEN c.status = 'corrupt' THEN 'digest mismatch' END,
    c.total_bytes, c.created_at, c.verified_at, c.updated_at
FROM checkpoint c JOIN run r ON r.id = c.run_id JOIN synthetic_size z ON z.run_id = c.run_id
CROSS JOIN (VALUES ('local'), ('shared'), ('offsite')) AS t(tier)
WHERE c.manifest_digest IS NOT NULL AND (t.tier <> 'offsite' OR c.step % (3 * :every) = 0)
"""

_INCIDENTS = """
INSERT INTO incident (run_id, kind, detected_at, reason, decision, restored_checkpoint_id, details, resolved_at,
    detection_s, rto_s, origin)
SELECT z.run_id, (ARRAY['crash', 'hang', 'nan'])[k], r.created_at + k * interval '1 day',
    'synthetic incident ' || k, 'restore', z.base + z.n / 2, '{}',
    CASE WHEN k < 3 THEN r.created_at + k * interval '1 day' + interval '90 s' END, 2.5, 61.0,
    'synthetic:' || z.run_id || ':' || k
FROM synthetic_size z JOIN run r ON r.id = z.run_id CROSS JOIN generate_series(1, 3) AS k
WHERE z.run_id % 5 = 0
"""

_LEASES = """
INSERT INTO restore_lease (checkpoint_id, holder, taken_at, expires_at)
SELECT z.base + z.n - k, 'node-1:4242', now() - interval '1 hour',
    CASE WHEN k = 5 THEN now() + interval '5 hours' ELSE now() - interval '1 minute' END
FROM synthetic_size z CROSS JOIN generate_series(5, 9) AS k WHERE z.run_id = 1
"""

_SEQUENCES = """
SELECT setval(pg_get_serial_sequence(:table, 'id'), (SELECT coalesce(max(id), 1) FROM {table}))
"""


def build(conn: Connection, shape: Shape) -> dict[str, int]:
    """Fill an empty catalog with ``shape``; returns row counts per table."""
    conn.execute(text(_SIZES))
    base, rows = 0, []
    for r in range(1, shape.runs + 1):
        n = shape.size(r)
        rows.append({"run_id": r, "n": n, "base": base, "fork": n // 20 if r % 10 == 0 else 0})
        base += n
    conn.execute(text("INSERT INTO synthetic_size VALUES (:run_id, :n, :base, :fork)"), rows)
    conn.execute(text(_RUNS))
    conn.execute(text(_SEQUENCES.format(table="run")), {"table": "run"})
    conn.execute(text(_CHAIN), {"every": shape.every_step})
    conn.execute(text(_SEQUENCES.format(table="checkpoint")), {"table": "checkpoint"})
    for sql in (_FORKS, _ABORTED, _FILES, _COPIES, _INCIDENTS, _LEASES):
        conn.execute(text(sql), {"every": shape.every_step})
    counts = {}
    for table in ("run", "checkpoint", "checkpoint_file", "replica", "incident", "restore_lease"):
        counts[table] = int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
        conn.execute(text(f"ANALYZE {table}"))
    return counts
