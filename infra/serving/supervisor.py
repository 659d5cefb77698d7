"""The serving stack's own watcher: it starts the TorchServe instances and restarts one that dies.

`rewind serving start` runs it in its own session (``python -m rewind.infra.serving.supervisor DIR``).
Each tick it reaps its instances; one that exited is taken out of every proxy's rotation, started
again on the same ports (so no proxy config changes), given every version its proxies route, and
put back. It also keeps the proxies' key maps in step with the instances' key files, and renews
an instance's inference key before TorchServe lets it expire. It uses no catalog and no Prefect:
restarting a server must not wait for either (docs/design.md, "Serving instances").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import stopping
from rewind.infra.errors import NotFoundError, Stopped
from rewind.infra.launch.process import stop_group
from rewind.infra.serving import stack, torchserve
from rewind.infra.serving.export import archive_name
from rewind.infra.serving.haproxy import Proxy
from rewind.infra.serving.torchserve import Endpoints, TorchServe

log = logging.getLogger("rewind.serving.supervisor")
TICK_S = 0.2
RECONCILE_S = 2.0  # how often every live instance is checked for a routed version it lacks
RENEW_BEFORE_S = 300.0  # renew an inference key this long before it expires
RESTARTS = "restarts.jsonl"


@dataclass
class Instance:
    index: int
    ep: Endpoints
    proc: subprocess.Popen[bytes]


def instance_dir(directory: Path, index: int) -> Path:
    return directory if index == 0 else directory / f"instance-{index}"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def reload_versions(ep: Endpoints, source: Path, proxies: list[Proxy]) -> list[str]:
    """Load on one instance every version the proxies route that it lacks; each model's default too."""
    client = TorchServe(ep)
    loaded_now: list[str] = []
    try:
        for proxy in proxies:
            model, routed = proxy.directory.name, proxy.stats()
            have = {str(v["modelVersion"]) for v in client.describe(model)}
            for version in sorted(set(routed) - have):
                try:
                    torchserve.stage(source, ep, archive_name(model, version))
                except NotFoundError as exc:  # not exported by Rewind: nothing to load it from
                    log.error("%s %s not loaded on %s: %s", model, version, ep.inference, exc)
                    continue
                client.register(archive_name(model, version))
                loaded_now.append(f"{model} {version}")
            top = max(routed.items(), key=lambda kv: kv[1].weight, default=None)
            if top is not None and top[1].weight > 0 and set(routed) - have:
                client.set_default(model, top[0])
    finally:
        client.close()
    return loaded_now


class Supervisor:
    def __init__(self, directory: Path, count: int, port: int | None) -> None:
        self.directory, self.count, self.port = directory, count, port
        self.instances: list[Instance] = []
        self.kept: dict[str, float] = {}  # keys clients may still hold, until they expire
        self.stop = threading.Event()
        self.next_reconcile = 0.0

    def _running_proxies(self) -> list[Proxy]:
        return [p for p in stack.load(self.directory).proxies() if p.running()]

    def _record(self) -> None:
        stack.write(self.directory, [i.ep for i in self.instances], [i.proc.pid for i in self.instances],
                    supervisor=os.getpid())  # fmt: skip

    def start_all(self) -> None:
        for i in range(self.count):  # each one known at once: a stop while starting stops every one
            ep, proc = torchserve.spawn(
                instance_dir(self.directory, i), inference_port=self.port if i == 0 else None
            )
            self.instances.append(Instance(i, ep, proc))
        for inst in self.instances:
            torchserve.wait_ready(inst.ep, inst.proc)
        self._record()

    def restart(self, inst: Instance) -> None:
        died_at = time.time()
        proxies = self._running_proxies()
        for proxy in proxies:
            proxy.set_instance(inst.index, False)  # out of the rotation before its health check notices
        stop_group(inst.proc.pid, timeout_s=5)  # its workers, if they outlived it
        ep, proc = torchserve.spawn(
            inst.ep.directory,
            inference_port=_port(inst.ep.inference),
            management_port=_port(inst.ep.management),
        )
        inst.ep, inst.proc = ep, proc
        torchserve.wait_ready(ep, proc)
        self._record()
        self.sync_keys()
        source = self.instances[0].ep.model_store
        reloaded = reload_versions(ep, source, proxies)
        for proxy in proxies:
            proxy.set_instance(inst.index, True)
        serving_at = time.time()
        row = {"instance": inst.index, "died_at": died_at, "serving_at": serving_at,
               "restart_s": round(serving_at - died_at, 3), "reloaded": reloaded}  # fmt: skip
        with open(self.directory / RESTARTS, "a") as out:
            out.write(json.dumps(row) + "\n")
        log.warning("instance %d restarted in %.1f s with %s", inst.index, row["restart_s"], reloaded)

    def sync_keys(self) -> None:
        now = time.time()
        for inst in self.instances:
            current = torchserve.inference_keys(inst.ep)
            if any(at - now < RENEW_BEFORE_S for at in current.values()):
                client = TorchServe(inst.ep, timeout_s=5)
                try:
                    client.rotate("inference")  # TorchServe rewrites the key file; the old key stays accepted
                finally:
                    client.close()
            self.kept.update(current)
        self.kept = {k: at for k, at in self.kept.items() if at > now}
        keys = stack.load(self.directory).keys(self.kept)
        for proxy in self._running_proxies():
            proxy.sync_keys(keys)

    def tick(self) -> None:
        for inst in self.instances:
            if inst.proc.poll() is not None and not self.stop.is_set():
                log.warning("instance %d exited with %s: restarting it", inst.index, inst.proc.returncode)
                self.restart(inst)
        self.sync_keys()
        if time.monotonic() >= self.next_reconcile:
            self.next_reconcile = time.monotonic() + RECONCILE_S
            self.reconcile()

    def reconcile(self) -> None:
        """A version deployed while an instance was down (or restarting) reaches it here."""
        proxies = self._running_proxies()
        for inst in self.instances:
            if inst.proc.poll() is None and proxies:
                loaded = reload_versions(inst.ep, self.instances[0].ep.model_store, proxies)
                if loaded:
                    log.warning("instance %d lacked %s: loaded", inst.index, loaded)

    def run(self) -> None:
        try:
            self.start_all()
            while not self.stop.wait(TICK_S):
                try:
                    self.tick()
                except Exception:  # one failed restart or proxy call: the instances stay up, try again
                    log.exception("supervisor tick failed")
        except Stopped:
            pass
        finally:
            for inst in self.instances:
                stop_group(inst.proc.pid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rewind.infra.serving.supervisor")
    p.add_argument("directory", type=Path)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--port", type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request every tick otherwise
    sup = Supervisor(args.directory, args.instances, args.port)

    def stop(*_: object) -> None:
        sup.stop.set()
        stopping.request()  # a start or restart in progress ends at its next wait

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sup.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
