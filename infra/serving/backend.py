"""The serving backend: loads versions, routes traffic, reports health. It decides nothing.

The rollout loop (steps, bake time, gates, failure limit) belongs to the Prefect
flow; a backend only does what it is told, as Argo Rollouts and Flagger split
the work. :class:`TorchServeBackend` is the first one: TorchServe loads the
versions and HAProxy splits the traffic between them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Protocol

from rewind.infra.errors import ConfigError, NotFoundError, RewindError, ServingUnavailable
from rewind.infra.serving.haproxy import Proxy, ServerStats
from rewind.infra.serving.stack import Stack
from rewind.infra.serving.torchserve import TorchServe, stage


@dataclass(frozen=True, slots=True)
class Health:
    loaded: bool
    ready_workers: int
    routed: bool  # the proxy has a server for it

    @property
    def ok(self) -> bool:
        return self.loaded and self.ready_workers > 0 and self.routed


@dataclass(frozen=True, slots=True)
class Prediction:
    status: int
    body: bytes
    version: str | None  # which version answered, when the endpoint says
    latency_s: float


class Backend(Protocol):
    def deploy(self, model: str, version: str, archive: str) -> None: ...
    def set_traffic(self, model: str, weights: dict[str, int]) -> None: ...
    def traffic(self, model: str) -> dict[str, int]: ...
    def counters(self, model: str) -> dict[str, ServerStats]: ...
    def health(self, model: str, version: str) -> Health: ...
    def predict(
        self, model: str, payload: bytes, version: str | None = None, *, timeout_s: float | None = None
    ) -> Prediction: ...
    def undeploy(self, model: str, version: str) -> None: ...
    def endpoint(self, model: str) -> str: ...


def check_weights(weights: dict[str, int]) -> None:
    if not weights or any(not 0 <= w <= 100 for w in weights.values()) or sum(weights.values()) != 100:
        raise ConfigError(f"traffic weights must be 0-100 and add up to 100, got {weights}")


class TorchServeBackend:
    """Every instance of the stack loads every version; the proxy's version weights apply across them."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.clients = [TorchServe(ep) for ep in stack.all]
        self._live: TorchServe | None = None

    def close(self) -> None:
        for client in self.clients:
            client.close()

    @property
    def ts(self) -> TorchServe:
        """The first instance that answers (instance 0 unless it is down): reads and direct probes go there."""
        if self._live is None:
            self._live = next((c for c in self.clients if c.ping()), self.clients[0])
        return self._live

    def _each(self) -> list[TorchServe]:
        """The instances up now; one that is down gets its versions from the supervisor when it is back."""
        up = [c for c in self.clients if c.ping()]
        if not up:
            raise ServingUnavailable(f"no TorchServe instance of the stack at {self.stack.directory} answers")
        return up

    def endpoint(self, model: str) -> str:
        return self.stack.proxy(model).url

    def _proxy(self, model: str) -> Proxy:
        proxy = self.stack.proxy(model)
        proxy.start([ep.inference.removeprefix("http://") for ep in self.stack.all], self.stack.keys())
        return proxy

    def loaded(self, model: str) -> list[str]:
        return [str(v["modelVersion"]) for v in self.ts.describe(model)]

    def deploy(self, model: str, version: str, archive: str) -> None:
        """Load the archive on every instance and give it a proxy server at weight 0; undone if any part fails."""
        fresh: list[TorchServe] = []
        try:
            for client in self._each():
                if version not in {str(v["modelVersion"]) for v in client.describe(model)}:
                    stage(self.stack.endpoints.model_store, client.endpoints, archive)
                    client.register(archive)
                    fresh.append(client)
            self._proxy(model).add(version, 0)
        except RewindError:
            for client in fresh:
                with contextlib.suppress(RewindError):
                    client.unregister(model, version)
            raise

    def set_traffic(self, model: str, weights: dict[str, int]) -> None:
        check_weights(weights)
        loaded = set(self.loaded(model))
        missing = [v for v in weights if v not in loaded]
        if missing:
            raise NotFoundError(f"{model} versions {missing} are not loaded in TorchServe")
        proxy = self._proxy(model)
        present = proxy.stats()
        for v in weights:
            if v not in present:
                proxy.add(v, 0)  # a restarted proxy: put the loaded versions back
        # The split is complete: a server the caller did not name gets no traffic.
        proxy.set_weights({**dict.fromkeys((v for v in present if v not in weights), 0), **weights})
        full = [v for v, w in weights.items() if w == 100]
        if full:
            for client in self._each():
                client.set_default(model, full[0])  # direct TorchServe clients follow too

    def traffic(self, model: str) -> dict[str, int]:
        return {v: s.weight for v, s in self.counters(model).items()}

    def counters(self, model: str) -> dict[str, ServerStats]:
        proxy = self.stack.proxy(model)
        return proxy.stats() if proxy.running() else {}

    def health(self, model: str, version: str) -> Health:
        """Loaded on every instance up now, with the ready workers of all of them."""
        loaded, ready = True, 0
        for client in self._each():
            rows = [v for v in client.describe(model) if str(v["modelVersion"]) == version]
            loaded = loaded and bool(rows)
            ready += sum(
                1 for w in (rows[0].get("workers", []) if rows else []) if w.get("status") == "READY"
            )
        return Health(loaded, ready, version in self.counters(model))

    def predict(
        self, model: str, payload: bytes, version: str | None = None, *, timeout_s: float | None = None
    ) -> Prediction:
        """One request; no answer within ``timeout_s`` is status 0, a failed request, not an exception."""
        started = time.perf_counter()
        try:
            r = self.ts.predict(model, version, payload, timeout_s=timeout_s)
        except ServingUnavailable:
            return Prediction(0, b"", version, time.perf_counter() - started)
        return Prediction(r.status_code, r.content, version, time.perf_counter() - started)

    def undeploy(self, model: str, version: str) -> None:
        """Drain and remove the version's proxy server, then unload it from TorchServe."""
        proxy = self.stack.proxy(model)
        if proxy.running():
            proxy.remove(version)
        for client in self._each():
            with contextlib.suppress(NotFoundError):  # already unloaded
                client.unregister(model, version)
