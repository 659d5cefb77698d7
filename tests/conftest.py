"""Shared fixtures: a real Postgres database per test session, and helpers that run
the example training job as a real subprocess."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

# Prefect reads its settings at import: give every test process a private, quiet Prefect home.
_PREFECT_HOME = tempfile.mkdtemp(prefix="rewind-prefect-")
for _k in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_API_KEY"):
    os.environ.pop(_k, None)
os.environ.update(
    {
        "PREFECT_HOME": _PREFECT_HOME,
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": os.path.join(_PREFECT_HOME, "results"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PREFECT_TASKS_DEFAULT_NO_CACHE": "true",
    }
)
# Two test workers on two cores, each starting jobs of up to four ranks with tiny models: one intra-op
# thread per process (as torchrun sets for its workers) instead of one per core, so the processes do
# not contend for the cores they share. Every job a test starts inherits it, references included.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The memory tier (on by default for a job supervised on this machine) is off for the tests that are not
# about it: their assertions name the tier a restore reads, and /dev/shm is shared by both workers. The
# memory tier's tests turn it on with a private directory (tests/test_memory_tier.py).
os.environ["REWIND_MEMORY_ROOT"] = "off"

ADMIN_URL = os.environ.get("REWIND_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _admin(sql: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test session (or REWIND_TEST_DATABASE_URL)."""
    given = os.environ.get("REWIND_TEST_DATABASE_URL")
    if given:
        yield given
        return
    yield from _database("rewind_test")


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """An empty Postgres database for one test (migration tests)."""
    yield from _database("rewind_mig")


def _database(prefix: str) -> Iterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}"')
    base = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    yield f"{base}/{name}"
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}".replace("[", "-").replace("]", "")


@pytest.fixture
def rewind_env(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for Rewind processes: the session's Postgres catalog, a private checkpoint root."""
    env = {
        "REWIND_HOME": str(tmp_path / "home"),
        "REWIND_CATALOG_URL": pg_url,
        "REWIND_CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("REWIND_FAULT", raising=False)
    monkeypatch.delenv("REWIND_MANIFEST_KEY", raising=False)
    return env


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The uninterrupted 60-step run every resume is compared with (embedded SQLite catalog)."""
    from tests.trainproc import run_to_end

    home = tmp_path_factory.mktemp("reference")
    env = {
        "REWIND_HOME": str(home),
        "REWIND_CATALOG_URL": "",
        "REWIND_CHECKPOINT_ROOT": "",
        "REWIND_FAULT": "",
    }
    rc, out = run_to_end("reference", home / "out", env=env)
    assert rc == 0, out.text
    assert sorted(out.losses) == list(range(1, 61))
    return out.losses, home / "out" / "final.safetensors"


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect server (the test harness), started once per test process."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A real S3 server (SeaweedFS) on loopback ports, with the bucket ``rewind``; one per test module."""
    from tests.s3_support import BUCKET, SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop(timeout=5)  # `weed mini` sometimes ignores SIGTERM for 20 s; its data is the test's to drop


@pytest.fixture
def s3_env(s3, monkeypatch):  # type: ignore[no-untyped-def]
    """The S3 server's endpoint and credentials in this test's environment (AWS_*)."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    return s3


# The files that take longest, longest first (seconds on 2 busy cores, measured). xdist hands out whole
# files (--dist loadfile) in collection order (--no-loadscope-reorder, see pyproject.toml): started
# first, the long files no longer leave one worker running alone at the end. Others follow, in order.
SLOW_FILES_FIRST = [
    "test_flows.py",  # ~330
    "test_slurm.py",  # ~300 (three host faults on the session's one Slurm cluster)
    "test_serving.py",  # ~300
    "test_spread.py",  # ~250 (4 ranks on 2 disks, each test saving its own: saved again, killed, restored)
    "test_protect_any_job.py",  # ~215
    "test_sharded.py",  # ~205
    "test_resume.py",  # ~200
    "test_tiers.py",  # ~185
    "test_integrity_flows.py",  # ~165
    "test_integrity_tiers.py",  # ~150
    "test_host_agent.py",  # ~150 (2-host jobs whose hosts' memory agents meet, late or never)
    "test_elastic.py",  # ~130
    "test_corruption.py",  # ~130
    "test_hf_example.py",  # ~105
    "test_model_parallel.py",  # ~90 (DP2 x TP2 on 4 ranks recovered as TP2 x DP1; TP2 -> 1; PP2 -> 1)
    "test_lightning.py",  # ~90 (a reference run, a Lightning job killed under protect-training, recovered)
    "test_work_pool.py",  # ~100 (a rewind server, prefect deploy, a worker, a recovery, a browser)
    "test_drills.py",  # ~85-105 alone, loaded
    "test_catalog_rebuild.py",  # ~100
    "test_integrity.py",  # ~100
    "test_adopt.py",  # ~90
    "test_async_save.py",  # ~80
    "test_sharded_async.py",  # ~60
    "test_gc_kill.py",  # ~55 (4 gc kills ~20)
    "test_catalog_races.py",  # ~55
    "test_stateful_loader.py",  # ~60 (four 2-rank torchrun launches, two single-process jobs)
    "test_watch_beside.py",  # ~45
    "test_memory_tier.py",  # ~45 (a torchrun job killed, recovered from memory)
    "test_hf_trainer.py",  # ~35 (a Trainer job killed under protect-training, recovered)
    "test_walkthrough.py",  # ~45 (the docs' walk-through: rewind server, db upgrade, rewind serve, a job)
    "test_group_smoke.py",  # ~40
    "test_progress.py",  # ~40
    "test_incremental.py",  # ~20 alone, ~35 loaded
    "test_fresh_optimizer.py",  # ~35 (a 2-rank job saved before its first step, then resumed)
    "test_chunked_sharded.py",  # ~30
    "test_hostile_storage.py",  # ~30
    "test_conversation.py",  # ~25
]


# The heavier end-to-end set, run by `make test-e2e` (REWIND_TEST_E2E=1) and skipped by `make test`, saying
# so: each is a whole job, stack or service lifecycle that another test of `make test` covers in part
# (docs/testing.md names which). Node ids, or a file for all of its tests.
E2E = (
    "test_drills_services.py",  # ~175: the serving drills and storage-failover, each starting its own services
    "test_work_pool.py",  # ~145: prefect deploy --all, a worker, a protected run killed and recovered
    "test_flows.py::test_lost_rank_is_relaunched_on_fewer_ranks_automatically",  # ~90
    "test_stateful_loader.py::test_per_rank_loaders_under_torchrun_resume_bit_exact_on_as_many_ranks_only",  # ~90
    # the lab's host-lost fault (~145; `make test-host-drills` runs it too); its crash without a lost host stays
    "test_slurm.py::test_a_lost_host_comes_back_on_a_spare_host_without_losing_a_sample[host-lost]",
    "test_sharded.py::test_save_with_4_ranks_load_with_2_and_1[ddp]",  # ~60
    "test_elastic.py::test_lost_rank_relaunch_on_three_resumes_resharded",  # ~58
    # protect-training's kill and hang recoveries (its NaN rollback stays; a killed rank is recovered in
    # test_flows, test_lightning, test_hf_trainer, test_memory_tier; a hang in test_watch_beside)
    "test_protect_any_job.py::test_a_killed_rank_is_recovered_bit_exact",  # ~60 with its reference run
    "test_protect_any_job.py::test_a_hung_rank_is_detected_and_recovered",  # ~45
    # TP -> 1 and PP -> 1 (the TP2 x DP2 -> TP2 x DP1 recovery stays)
    "test_model_parallel.py::test_a_tp2_job_forced_onto_one_rank_changes_tp_and_reshards_exactly",  # ~28
    "test_model_parallel.py::test_a_pp2_job_resumes_as_pp1_exactly",  # ~27
    "test_group_smoke.py",  # ~48: a relaunch whose group fails its smoke test
    "test_drills.py::test_s3_outage_drill_against_a_job_spec",  # ~35 (test_tiers rides out an outage)
    "test_spread.py::test_with_a_disk_gone_and_no_other_copy_the_job_refuses_to_start_over",  # ~37
    "test_hf_example.py",  # ~24 (the Trainer callback's job stays: test_hf_trainer)
    "test_integrity_flows.py::test_node_loss_is_restored_from_the_shared_tier",  # ~17 (test_spread's stays)
    "test_recovery_reads_once.py::test_with_only_a_shared_copy_left_the_flow_reads_its_state_and_the_job_fetches_the_rest_once",  # ~14
    "test_watch_beside.py::test_a_failure_is_acted_on_while_a_checkpoint_is_being_verified[exit]",  # ~14
    "test_integrity_tiers.py::test_local_and_shared_tiers_lost_restore_from_s3",  # ~19 (test_tiers' stays)
    "test_serving.py::test_a_conversation_survives_the_instance_that_held_it",  # ~23 (test_conversation's)
    "test_serving.py::test_gate_failure_after_promotion_rolls_back_in_one_weight_change",  # ~14
    "test_sharded.py::test_save_with_4_ranks_load_with_2_and_1[fsdp2]",  # ~38 (TP2 x DP2 -> DP1 reshards)
    "test_spread.py::test_each_host_sends_its_share_to_the_shared_tier_and_a_lost_disks_files_come_from_there",
    "test_walkthrough.py",  # ~60: the docs' walk-through (server, credential, schedules) typed as printed
    "test_async_save.py::test_sigkill_during_background_persist",  # ~25 (test_sharded_async's rank kill stays)
    "test_flows.py::test_a_job_that_fails_to_start_is_an_incident_with_its_last_lines_and_not_recovered",
    "test_flows.py::test_restore_of_a_chosen_step_through_the_api",  # ~42
    "test_catalog_scale.py::test_a_run_past_postgres_parameter_limit_is_listed_for_a_scrub_read_and_rebuilt",
    # ~34: the same fresh optimizer's path as its variant with gradients already computed, which stays
    "test_fresh_optimizer.py::test_a_save_before_the_first_step_perturbs_neither_the_run_nor_its_resume",
    "test_spread.py::test_a_crash_of_every_rank_reads_each_hosts_files_from_its_own_memory[sync]",  # ~24
    # ~25 (a second live writer refused by name: test_engine.py; the race for the lease: test_catalog_races.py)
    "test_hf_trainer.py::test_a_second_trainer_job_of_the_same_run_is_refused_while_the_first_lives",
    # ~30: the old step restorable after a failed save of it again (the leaders' undo); the same outcome after
    # rank 0 is killed there (the restore's put-back) stays
    "test_spread.py::test_a_step_saved_again_that_fails_at_rank_0_leaves_every_disks_old_copy_restorable",
    # ~35-42: agents meeting after the ranks started (the agents' pass, and the ranks' own without one, stay)
    "test_host_agent.py::test_agents_that_meet_after_the_ranks_started_take_the_passes_over",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: the heavier end-to-end set (`make test-e2e`)")


def _e2e(item: pytest.Item) -> bool:
    node = f"{item.path.name}::{item.name}"
    return any(node == e or item.path.name == e for e in E2E)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = bool(os.environ.get("REWIND_TEST_E2E"))
    for item in items:
        if _e2e(item):
            item.add_marker(pytest.mark.e2e)
            if not chosen:
                item.add_marker(pytest.mark.skip(reason="in the heavier end-to-end set: `make test-e2e`"))
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(
        key=lambda item: rank.get(item.path.name, len(SLOW_FILES_FIRST))
    )  # stable: a file keeps its order


@pytest.fixture
def memory_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private memory tier on the machine's shared memory (/dev/shm), removed afterwards."""
    from rewind.infra.memory import place

    if not place.SHM.is_dir():
        pytest.skip("this machine has no /dev/shm")
    root = place.SHM / f"rewind-test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv(place.ROOT_ENV, str(root))
    monkeypatch.delenv(place.BUDGET_ENV, raising=False)
    yield root
    shutil.rmtree(root, ignore_errors=True)
