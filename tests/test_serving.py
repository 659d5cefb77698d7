"""Serving rollouts against real TorchServe and HAProxy on loopback, Postgres and a Prefect server.

The tests share one stack of two TorchServe instances (and run on one worker) but not an order: each starts from
whatever version is stable (the ``base`` fixture deploys lm@60 when nothing is), so
any one of them, or any order of them, passes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from rewind.examples.tiny_lm_model import accuracy, from_weights, scramble
from rewind.flows.cli import STOP_S
from rewind.infra.catalog import lineage
from rewind.infra.catalog import serving as sv
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills.traffic import Load
from rewind.infra.errors import ConfigError, NotFoundError, ServingUnavailable
from rewind.infra.restore.scrub import scrub
from tests.trainproc import REPO, run_to_end

MODEL = "tiny"
INSTANCES = 2
PROBES = str(REPO / "examples" / "tiny_lm_probes.jsonl")
FLAKY = str(REPO / "tests" / "serving_files" / "flaky_handler.py")
TURNS_BAD = str(REPO / "tests" / "serving_files" / "turns_bad_handler.py")
HANDLER_FILES = [str(REPO / "examples" / "tiny_lm_handler.py"), str(REPO / "examples" / "tiny_lm_model.py")]


def _accuracy(weights: dict[str, torch.Tensor]) -> float:
    return accuracy(from_weights(weights))


@pytest.fixture(scope="module")
def stack_env(pg_url, tmp_path_factory, prefect_api):
    """A trained run (verified at 60, 90, 120; 30 left unverified), a damaged copy, and a running stack."""
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.format import manifest as mf
    from rewind.infra.format import payload
    from rewind.infra.serving import stack

    home = tmp_path_factory.mktemp("serving")
    env = {
        "REWIND_HOME": str(home),
        "REWIND_CATALOG_URL": pg_url,
        "REWIND_CHECKPOINT_ROOT": str(home / "ckpt"),
        "REWIND_SERVING_HOME": str(home / "serving"),
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("REWIND_FAULT", raising=False)
        rc, out = run_to_end(
            "lm", home / "out", env=env, steps=120, every=30, extra=["--lr", "0.01", "--batch-size", "32"]
        )
        assert rc == 0, out.text
        cat = Catalog()
        for ck in lineage.checkpoints(cat, "lm"):
            if ck.step != 30:
                assert scrub(cat, ck, deep=True).ok
        # The same weights with the embedding rows shuffled: loads fine, answers wrong.
        (good,) = [c for c in lineage.checkpoints(cat, "lm", 90)]
        weights = payload.read_states(Path(good.path), mf.read(Path(good.path)))["model"]
        model = scramble(from_weights(weights))
        damaged = Checkpointer("lm-damaged", states={"model": model}, catalog=cat)
        damaged.save(90)
        damaged.close()
        (bad,) = lineage.checkpoints(cat, "lm-damaged", 90)
        assert scrub(cat, bad, deep=True).ok  # intact bytes: only the model is wrong
        # The premise of the quality gate: the canaries meant to pass answer far better than the damaged one.
        (later,) = [c for c in lineage.checkpoints(cat, "lm", 120)]
        good_q = min(
            _accuracy(weights),
            _accuracy(payload.read_states(Path(later.path), mf.read(Path(later.path)))["model"]),
        )
        bad_q = _accuracy(dict(model.state_dict()))
        assert good_q >= 0.2 and bad_q < good_q / 2, (good_q, bad_q)
        st = stack.start(instances=INSTANCES)  # every rollout below runs across both instances
        try:
            yield {"env": env, "cat": cat, "stack": st, "min_quality": round(good_q / 2, 3)}
        finally:
            stack.stop()


def _key(st) -> str:  # type: ignore[no-untyped-def]
    return json.loads(st.endpoints.key_file.read_text())["inference"]["key"]


def _traffic(st) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {v: s.weight for v, s in st.proxy(MODEL).stats().items()}


def _loaded(st) -> list[str]:  # type: ignore[no-untyped-def]
    from rewind.infra.serving.torchserve import TorchServe

    ts = TorchServe(st.endpoints)
    try:
        return sorted(str(v["modelVersion"]) for v in ts.describe(MODEL))
    finally:
        ts.close()


def _gates(stack_env, **kw):  # type: ignore[no-untyped-def]
    return {"max_error_rate": 0.05, "max_p95_latency_ms": 5000, "min_quality": stack_env["min_quality"],
            "probe_set": PROBES, "warm_s": 0.0, **kw}  # fmt: skip


@pytest.fixture
def base(stack_env) -> str:  # type: ignore[no-untyped-def]
    """The version serving all traffic as a test starts; the model's first deploy (lm@60) if none."""
    from rewind.flows.serving import deploy_model

    st, cat = stack_env["stack"], stack_env["cat"]
    if MODEL not in sv.models(cat) or sv.stable(cat, MODEL) is None:
        out = deploy_model(MODEL, "lm", 60, triggered_by="test", handler=HANDLER_FILES[0],
                           extra_files=HANDLER_FILES[1:])  # fmt: skip
        stack_env["first_deploy"] = (out, _traffic(st))
    stable = sv.stable(cat, MODEL)
    assert stable is not None and _traffic(st) == {stable.version: 100}
    return stable.version


def test_first_deploy_takes_all_traffic(stack_env, base):
    out, traffic = stack_env["first_deploy"]
    assert out["version"] == "1" and out["stable"] == "1"
    assert traffic == {"1": 100}
    st = stack_env["stack"]
    with Load(st.proxy(MODEL).url + f"/predictions/{MODEL}", _key(st), workers=2) as load:
        _wait(lambda: load.count() >= 20, "20 answers")
    assert not load.failed and {s.version for s in load.samples} == {base}


def test_an_instance_killed_under_load_fails_no_request_and_comes_back(stack_env, base, capsys):
    """SIGKILL one TorchServe instance (its whole process group) while 4 clients send requests through the
    proxy: the proxy retries what the dead instance dropped on the other one, so no request fails; the
    supervisor starts it again on the same ports with every version, and it answers requests again."""
    import os
    import random
    import signal

    from rewind.infra.serving import stack
    from rewind.infra.serving.torchserve import TorchServe

    st = stack_env["stack"]
    seed = int(os.environ.get("REWIND_TEST_SEED") or random.SystemRandom().randrange(2**31))
    rng = random.Random(seed)
    victim, at = rng.randrange(INSTANCES), rng.randrange(10, 40)  # which instance, after how many answers
    print(f"\nseed {seed}: killing instance {victim} after {at} answers (REWIND_TEST_SEED={seed} replays it)")
    with Load(st.proxy(MODEL).url + f"/predictions/{MODEL}", _key(st), workers=4) as load:
        _wait(
            lambda: load.count() >= at and {s.instance for s in load.samples} == {"0", "1"}, "both instances"
        )
        killed_at = time.time()
        os.killpg(stack.load(st.directory).pids[victim], signal.SIGKILL)
        back = _wait(
            lambda: next(
                (s for s in load.samples if s.instance == str(victim) and s.started > killed_at), None
            ),
            f"instance {victim} answering again",
        )
        settle = load.count()
        _wait(lambda: load.count() >= settle + 20, "20 more answers")
    back_s = back.ended - killed_at
    print(f"instance {victim} back and answering {back_s:.2f} s after SIGKILL; {len(load.samples)} requests, "
          f"{len(load.failed)} failed")  # fmt: skip
    stats = st.proxy(MODEL).command("show stat")  # retries and redispatches per instance, for a failure
    if load.failed:  # each section's retries and redispatches, and the last requests with their flags
        print(stats, st.proxy(MODEL).command("show events buf"), sep="\n")
    assert load.failed == [], load.failed[:5]
    assert back_s < 30
    assert {s.version for s in load.samples} == {base}
    revived = TorchServe(stack.load(st.directory).all[victim])
    try:
        assert sorted(str(v["modelVersion"]) for v in revived.describe(MODEL)) == _loaded(st) == [base]
    finally:
        revived.close()
    from rewind.flows.cli import main

    with capsys.disabled():  # the seed and the measured times stay in the test's output
        print(capsys.readouterr().out, end="")
    assert main(["serving", "status", MODEL, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["instances"] == {"0": "UP", "1": "UP"} and [v["healthy"] for v in status["versions"]] == [
        True
    ]


def test_a_version_an_instance_lacks_is_loaded_there_by_the_supervisor(stack_env, base):
    """What a deploy while an instance was down leaves behind (a routed version one instance lacks) is
    repaired by the supervisor within a bounded wait, with no request through the proxy."""
    from rewind.infra.serving.torchserve import TorchServe

    st = stack_env["stack"]
    last = TorchServe(st.all[-1])
    try:
        last.unregister(MODEL, base)
        _wait(
            lambda: [str(v["modelVersion"]) for v in last.describe(MODEL)] == [base], "the version back", 30
        )
    finally:
        last.close()


def test_rotated_keys_are_picked_up_from_the_key_file(stack_env, base):
    """TorchServe answers InvalidKeyException to an old key; the client re-reads the key file and goes on."""
    import httpx

    from rewind.infra.serving.torchserve import TorchServe

    st = stack_env["stack"]
    client = TorchServe(st.endpoints)
    try:
        assert client.ping()  # keys read and cached
        old = _key(st)
        api_key = json.loads(st.endpoints.key_file.read_text())["API"]["key"]
        r = httpx.get(f"{st.endpoints.management}/token", params={"type": "inference"},
                      headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip
        assert r.status_code == 200 and _key(st) != old
        assert client.predict(MODEL, base, b"the model lea").status_code == 200
    finally:
        client.close()
    # Through the proxy too, where every instance has its own key: the new key is accepted at the serving
    # supervisor's next tick (0.2 s apart; one that reconciles the instances on a loaded 2-core machine
    # took more than 5 s once).
    url, new = st.proxy(MODEL).url + f"/predictions/{MODEL}", {"Authorization": f"Bearer {_key(st)}"}
    _wait(lambda: httpx.post(url, content=b"the model lea", headers=new).status_code == 200, "new key", 30)


def test_flaky_version_is_rolled_back_by_the_error_rate_gate(stack_env, base):
    from rewind.flows.serving import rollout_model

    st = stack_env["stack"]
    with Load(st.proxy(MODEL).url + f"/predictions/{MODEL}", _key(st), workers=2):
        out = rollout_model(MODEL, "lm", 90, traffic_steps=[50, 100], bake_s=2.0, version="flaky",
                            handler=FLAKY, extra_files=HANDLER_FILES, triggered_by="test", **_gates(stack_env))  # fmt: skip
    assert out["state"] == "rolled_back" and "error rate" in out["reason"], out
    assert _traffic(st) == {base: 100}
    assert _loaded(st) == [base]
    assert sv.get_version(stack_env["cat"], MODEL, "flaky").state == "rolled_back"
    _assert_event("rewind.rollout.rolled_back", out["rollout_id"])


def test_damaged_weights_are_rolled_back_by_the_quality_gate(stack_env, base):
    from rewind.flows.serving import rollout_model

    st = stack_env["stack"]
    out = rollout_model(MODEL, "lm-damaged", 90, traffic_steps=[50, 100], bake_s=1.0, triggered_by="test",
                        **_gates(stack_env))  # fmt: skip
    assert out["state"] == "rolled_back" and "quality" in out["reason"], out
    assert "error rate" not in out["reason"]  # it answered every request, just wrongly
    assert _traffic(st) == {base: 100} and _loaded(st) == [base]


def test_manual_rollback_under_load_fails_no_request(stack_env, base):
    """A rollback in the middle of a canary: one weight change, measured from the flow's decision."""
    import threading

    from rewind.flows.serving import rollback_model, rollout_model

    st, cat = stack_env["stack"], stack_env["cat"]
    result: dict = {}
    canary = threading.Thread(
        target=lambda: result.update(rollout_model(MODEL, "lm", 90, traffic_steps=[50, 100], bake_s=6.0,
                                                   checks_per_step=3, triggered_by="test", **_gates(stack_env))),
        daemon=True,
    )  # fmt: skip
    with Load(st.proxy(MODEL).url + f"/predictions/{MODEL}", _key(st), workers=4) as load:
        canary.start()
        new = _wait(
            lambda: next((v for v, w in _traffic(st).items() if v != base and w == 50), None), "50% canary"
        )
        _wait(lambda: sum(s.version == new for s in load.samples) >= 10, "canary answers")
        out = rollback_model(MODEL, reason="operator saw bad outputs", triggered_by="test")
        settle = load.count()
        _wait(lambda: load.count() >= settle + 40, "40 answers after the rollback")
    canary.join(timeout=60)
    if canary.is_alive():
        import sys
        import traceback

        stack = "".join(traceback.format_stack(sys._current_frames()[canary.ident]))
        pytest.fail(f"the interrupted rollout is still running after 60 s:\n{stack}")
    assert result["state"] == "interrupted"
    decided = out["decided_at"]
    late = [s for s in load.samples if s.version == new and s.started > decided]
    on_old_after = max((s.started for s in late), default=decided) - decided
    print(f"\nrollback: weights switched {out['switch_s'] * 1000:.1f} ms after the decision; last request to "
          f"{new} started {on_old_after * 1000:.1f} ms after it; {len(load.samples)} requests, "
          f"{len(load.failed)} failed")  # fmt: skip
    assert load.failed == []
    assert on_old_after < 1.0 and out["switch_s"] < 1.0
    assert all(s.version == base for s in load.samples if s.started > decided + on_old_after)
    assert _traffic(st) == {base: 100} and _loaded(st) == [base]
    assert sv.get_version(cat, MODEL, new).state == "rolled_back"


def test_a_rollout_stopped_by_sigterm_gives_the_traffic_back_and_exits(stack_env, base, prefect_api):
    """`rewind serving rollout` killed politely mid-canary: the stable version gets all traffic back, the
    canary is unloaded, the rollout is closed, and the process exits with 143 (its own deadline is the CLI's
    STOP_S; the test's wait on it is bounded a little beyond that)."""
    import os
    import signal
    import subprocess
    import sys

    st, cat = stack_env["stack"], stack_env["cat"]
    argv = [str(Path(sys.executable).parent / "rewind"), "serving", "rollout", MODEL, "--run", "lm", "--step",
            "90", "--steps", "50,100", "--bake", "300", "--max-p95-ms", "5000"]  # fmt: skip
    env = {**os.environ, **stack_env["env"], "PREFECT_API_URL": prefect_api}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        new = _wait(
            lambda: (
                proc.poll() is not None
                or next((v for v, w in _traffic(st).items() if v != base and w == 50), None)
            ),
            "the CLI's rollout to reach a 50% canary",
            timeout=180,
        )
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            _, err = proc.communicate(timeout=STOP_S + 5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rollout still running {STOP_S + 5:g} s after SIGTERM") from None
        print(f"\nrollout stopped {time.monotonic() - sent:.2f} s after SIGTERM (deadline {STOP_S:g} s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1] == "rewind: stopped by SIGTERM", err[-3000:]
    assert "worker thread" not in err, err[-3000:]  # Prefect's timeout warning: nothing a user can act on
    assert _traffic(st) == {base: 100} and _loaded(st) == [base]
    (rollout,) = [r for r in sv.rollouts(cat, MODEL) if r.to_version == new]
    assert rollout.state == "failed" and "rollout stopped: Stopped: stopped by SIGTERM" in (
        rollout.reason or ""
    ), rollout.reason
    assert sv.get_version(cat, MODEL, new).state == "rolled_back"


def test_good_version_is_promoted_and_the_old_one_unloaded(stack_env, base):
    from rewind.flows.serving import rollout_model

    st = stack_env["stack"]
    with Load(st.proxy(MODEL).url + f"/predictions/{MODEL}", _key(st), workers=2) as load:
        out = rollout_model(MODEL, "lm", 120, traffic_steps=[10, 50, 100], bake_s=1.0, triggered_by="test",
                            **_gates(stack_env))  # fmt: skip
    assert out["state"] == "promoted", out
    new = out["version"]
    assert _traffic(st) == {new: 100} and _loaded(st) == [new]
    assert sv.get_version(stack_env["cat"], MODEL, base).state == "retired"
    assert not load.failed
    steps = sv.steps_of(stack_env["cat"], out["rollout_id"])
    assert [s.weights for s in steps if s.action == "set_traffic"] == [
        {new: 10, base: 90},
        {new: 50, base: 50},
        {new: 100, base: 0},
    ]
    assert [s.passed for s in steps if s.action == "gate"] == [True, True, True]


def test_gate_failure_after_promotion_rolls_back_in_one_weight_change(stack_env, base):
    """The old version stays warm after promotion while the gates keep watching: going bad then is one
    weight change back, with no request failed."""
    import threading
    import uuid

    from rewind.flows.serving import rollout_model

    st, cat = stack_env["stack"], stack_env["cat"]
    new = f"late{uuid.uuid4().hex[:6]}"
    flags = [ep.directory / "tmp" / f"rewind-turns-bad-{new}" for ep in st.all]  # each instance's TMPDIR
    result: dict = {}
    rollout = threading.Thread(
        target=lambda: result.update(rollout_model(MODEL, "lm", 120, traffic_steps=[100], bake_s=1.0, version=new,
                                                   handler=TURNS_BAD, extra_files=HANDLER_FILES, triggered_by="test",
                                                   **_gates(stack_env, warm_s=60.0))),
        daemon=True,
    )  # fmt: skip
    try:
        with Load(st.proxy(MODEL).url + f"/predictions/{MODEL}", _key(st), workers=2) as load:
            rollout.start()
            _wait(lambda: sv.stable(cat, MODEL).version == new, "the promotion")
            assert _traffic(st) == {new: 100, base: 0}  # promoted, and the old version still loaded
            for flag in flags:
                flag.touch()  # the new version goes bad, on every instance
            rollout.join(timeout=120)
            assert not rollout.is_alive(), "the rollout did not end within the warm window"
    finally:
        for flag in flags:
            flag.unlink(missing_ok=True)
    assert result["state"] == "rolled_back" and result["reason"].startswith("post-promotion"), result
    assert "quality" in result["reason"]
    steps = sv.steps_of(cat, result["rollout_id"])
    after = steps[[s.action for s in steps].index("promote") + 1 :]
    assert [s.weights for s in after if s.weights] == [{base: 100, new: 0}]  # one weight change, no reload
    assert load.failed == []
    assert _traffic(st) == {base: 100} and _loaded(st) == [base]
    _assert_event("rewind.rollout.rolled_back", result["rollout_id"])


def test_history_traces_every_version_to_its_checkpoint(stack_env, base, capsys):
    from rewind.flows.cli import main
    from rewind.flows.serving import rollout_model

    cat = stack_env["cat"]
    out = rollout_model(MODEL, "lm-damaged", 90, traffic_steps=[100], bake_s=0.5, triggered_by="test",
                        **_gates(stack_env))  # fmt: skip
    assert out["state"] == "rolled_back", out
    assert main(["serving", "history", MODEL, "--json"]) == 0
    history = json.loads(capsys.readouterr().out)
    for v in history["versions"]:
        (ck,) = [c for c in lineage.checkpoints(cat, v["run"], v["step"]) if c.status == "verified"]
        assert v["manifest_digest"] == ck.manifest_digest
    by_version = {v["version"]: v for v in history["versions"]}
    assert (by_version["1"]["run"], by_version["1"]["step"]) == ("lm", 60) and by_version["1"]["promoted_at"]
    assert (by_version[out["version"]]["run"], by_version[out["version"]]["step"]) == ("lm-damaged", 90)
    assert by_version[out["version"]]["promoted_at"] is None
    first, last = history["rollouts"][0], history["rollouts"][-1]
    assert (first["kind"], first["state"], first["to"]) == ("deploy", "promoted", "1")
    assert (last["kind"], last["state"], last["to"]) == ("rollout", "rolled_back", out["version"])
    # Retention keeps what serving points at (the stable version's checkpoint), whatever the policy says.
    from rewind.infra import retention

    plan = retention.plan(cat, "lm", retention.Policy(keep_last=1))  # the policy alone keeps only 120
    # lm@60 serves (or, once retired, is the rollback target); lm@90 only ever failed its gates.
    assert by_version[base]["step"] in plan.keep and 60 in plan.keep and 90 not in plan.keep


def test_bad_input_fails_clearly_and_deploys_nothing(stack_env, base, tmp_path, monkeypatch, capsys):
    from rewind.flows.cli import main
    from rewind.flows.serving import deploy_model, rollout_model

    cat = stack_env["cat"]
    before = len(sv.versions(cat, MODEL))
    store = stack_env["stack"].endpoints.model_store
    archives = sorted(store.glob("*.mar"))

    assert main(["serving", "rollout", "nope", "--run", "lm", "--step", "90"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "rewind: error: unknown model 'nope': nothing was ever deployed under that name"
    with pytest.raises(ConfigError, match=r"model 'fresh' has no handler yet"):  # nothing to reuse
        deploy_model("fresh", "lm", 90)
    with pytest.raises(ConfigError, match=r"lm@30 is committed, not verified"):
        rollout_model(MODEL, "lm", 30, bake_s=1.0, **_gates(stack_env))
    with pytest.raises(NotFoundError, match="no checkpoint at step 45"):
        rollout_model(MODEL, "lm", 45, bake_s=1.0, **_gates(stack_env))

    # TorchServe down: a stack description whose server is gone.
    dead = tmp_path / "dead"
    dead.mkdir()
    (dead / "stack.json").write_text(json.dumps({"inference": "http://127.0.0.1:9", "management": "http://127.0.0.1:9",
                                                 "directory": str(dead)}))  # fmt: skip
    (dead / "key_file.json").write_text(json.dumps({"inference": {"key": "x"}, "management": {"key": "y"}}))
    monkeypatch.setenv("REWIND_SERVING_HOME", str(dead))
    with pytest.raises(ServingUnavailable, match="does not answer /ping"):
        deploy_model(MODEL, "lm", 90)
    assert len(sv.versions(cat, MODEL)) == before and sorted(store.glob("*.mar")) == archives
    assert not list(dead.glob("**/*.mar"))


def _wait(probe, what: str, timeout: float = 60):  # type: ignore[no-untyped-def]
    from tests.prefect_support import wait_until

    return wait_until(probe, timeout, what, interval=0.05)


def _assert_event(name: str, rollout_id: int) -> None:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    from tests.prefect_support import wait_until

    with get_client(sync_client=True) as client:

        def found():  # type: ignore[no-untyped-def]
            page = client.read_events(EventFilter(event=EventNameFilter(name=[name])), limit=50)
            return [e for e in page.events if e.payload.get("rollout_id") == rollout_id]

        (event,) = wait_until(found, 30, name)
    assert event.resource.id == f"rewind.model.{MODEL}"


def test_a_conversation_survives_the_instance_that_held_it(stack_env):
    """A 2,000-token conversation sticks to one instance; that instance is SIGKILLed; the next turn is answered
    by the other one from the KV blocks on the node's tier (every block checked against the digest the
    catalog recorded), with the reply the same conversation gets when nothing fails."""
    import os
    import random
    import signal

    import httpx

    from rewind.examples.chat_lm import build_model
    from rewind.flows.serving import deploy_model
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.serving import stack

    st, cat = stack_env["stack"], stack_env["cat"]
    if "chat" not in sv.models(cat):
        saver = Checkpointer("chat", states={"model": build_model(seed=0)}, catalog=cat)
        saver.save(1)
        saver.close()
        (ck,) = lineage.checkpoints(cat, "chat", 1)
        assert scrub(cat, ck, deep=True).ok
        deploy_model("chat", "chat", 1, triggered_by="test", handler=str(REPO / "examples" / "chat_lm_handler.py"),
                     extra_files=[str(REPO / "examples" / "chat_lm.py")])  # fmt: skip
    seed = int(os.environ.get("REWIND_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"\nseed {seed} (REWIND_TEST_SEED={seed} replays it)")
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (2000, 24, 24)]
    url, headers = st.proxy("chat").url + "/predictions/chat", {"Authorization": f"Bearer {_key(st)}"}

    def say(client: httpx.Client, session: str, n: int) -> tuple[dict, str]:
        body = {"session_id": f"{session}-{seed}", "tokens": prompts[n - 1], "turn": n, "max_new_tokens": 16}
        r = client.post(url, json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json(), r.headers["x-rewind-instance"]

    with httpx.Client(timeout=120) as client:
        answered = [say(client, "talk", n) for n in (1, 2)]
        holder = answered[0][1]
        assert answered[1][1] == holder and answered[1][0]["source"] == "process"  # stuck to its instance
        os.killpg(stack.load(st.directory).pids[int(holder)], signal.SIGKILL)
        taken_over, by = say(client, "talk", 3)
        reference = [say(client, "reference", n)[0] for n in (1, 2, 3)]  # the same turns, nothing killed
    assert by != holder
    assert taken_over["source"] == "blocks (disk)" and taken_over["recomputed_tokens"] == 0, taken_over
    assert taken_over["reused_tokens"] >= 2000 + 24 + 16
    assert taken_over["tokens"] == reference[2]["tokens"]  # the reply an uninterrupted conversation gets
    print(f"turn 3 on instance {by} after instance {holder} died: first token in {taken_over['ttft_ms']} ms "
          f"({taken_over['reused_tokens']} tokens of context from the node's KV blocks)")  # fmt: skip
