"""Prometheus metrics of the catalog, read when Prometheus scrapes (``rewind metrics serve``).

One scrape reads the catalog a fixed number of times whatever it holds: the overview ``rewind status``
computes (:func:`rewind.infra.catalog.overview.status`: newest checkpoints, copies per tier and their lag,
open incidents), incidents totalled by kind and drills by scenario. Nothing is cached between scrapes, so
every value is the catalog's at that moment. A catalog that cannot be read makes the scrape answer
``rewind_catalog_up 0`` (and nothing about runs) instead of failing: Prometheus keeps the target up and an
alert can say why. Scrapes are served one at a time: two scrapers do not read the catalog twice at once.

Series (units in the names; labels ``run``, ``tier``, ``kind``, ``scenario``, ``status``, ``outcome``):

- ``rewind_catalog_up``, ``rewind_catalog_read_seconds``
- ``rewind_checkpoint_age_seconds{run,status}`` and ``rewind_checkpoint_step{run,status}``: the newest
  ``verified`` checkpoint (the recovery point a restore would use) and the newest ``committed`` one
  (verified since or not: the newest one there is)
- ``rewind_checkpoint_save_stall_seconds{run}``: how long the newest checkpoint's save held training up
- ``rewind_verified_checkpoints{run}``, ``rewind_rpo_steps{run}``, ``rewind_rpo_seconds{run}`` (what
  dying now would cost, where the job reports progress)
- ``rewind_tier_bytes{run,tier}``, ``rewind_tier_copies{run,tier}``: live copies of verified checkpoints
- ``rewind_replication_lag_seconds{run,tier}``, ``rewind_replication_lag_steps{run,tier}``
- ``rewind_open_incidents{run,kind}``; ``rewind_incidents_total{kind}``, ``rewind_incident_rto_seconds{kind}``
  (a summary: ``_count`` and ``_sum`` of measured RTOs), ``rewind_incident_last_rto_seconds{kind}``
- ``rewind_drills_total{scenario,outcome}``, ``rewind_drill_verdict{scenario,outcome}`` (1 for the newest
  drill's outcome, 0 for the others), ``rewind_drill_rto_seconds{scenario}``,
  ``rewind_drill_last_timestamp_seconds{scenario}``

No URL, credential or path is exported: run, tier, kind and scenario names only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from rewind.infra.catalog import drills, incidents, overview
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.drills import OUTCOMES
from rewind.infra.catalog.models import aware

log = logging.getLogger(__name__)


class CatalogCollector(Collector):
    """Reads the catalog at each scrape; ``open_catalog`` is called until it succeeds, then kept."""

    def __init__(self, open_catalog: Callable[[], Catalog]) -> None:
        self._open = open_catalog
        self._cat: Catalog | None = None
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # registering must not read the catalog

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            start = time.monotonic()
            try:
                families = self._read()
                up = 1
            except Exception as exc:  # any failure to read: report it as a value, never as a failed scrape
                log.warning("catalog not readable: %s", _one_line(exc))
                families, up = [], 0
            yield _gauge("rewind_catalog_up", "1 if the catalog could be read at this scrape, else 0", up)
            yield _gauge(
                "rewind_catalog_read_seconds", "how long this scrape took to read the catalog",
                round(time.monotonic() - start, 6),
            )  # fmt: skip
            yield from families

    def _catalog(self) -> Catalog:
        if self._cat is None:
            self._cat = self._open()
        return self._cat

    def _read(self) -> list[Metric]:
        cat = self._catalog()
        now = datetime.now(UTC)
        got = overview.status(cat, now=now)
        kinds = incidents.totals_by_kind(cat)
        scenarios = drills.totals_by_scenario(cat)
        return [*_runs(got["runs"]), *_incidents(kinds, got["runs"]), *_drills(scenarios)]


def registry(open_catalog: Callable[[], Catalog]) -> CollectorRegistry:
    """A registry holding only the catalog's metrics (no process or Python runtime series)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CatalogCollector(open_catalog))
    return reg


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _runs(runs: list[dict[str, Any]]) -> list[Metric]:
    return _run_checkpoints(runs) + _run_tiers(runs)


def _run_checkpoints(runs: list[dict[str, Any]]) -> list[Metric]:
    """Per run: its newest checkpoints' age and step, the last save's stall, verified checkpoints, RPO."""
    age = GaugeMetricFamily(
        "rewind_checkpoint_age_seconds",
        "age of the run's newest checkpoint: status=verified, the newest verified (the recovery point); "
        "status=committed, the newest committed, verified since or not",
        labels=["run", "status"],
    )
    step = GaugeMetricFamily(
        "rewind_checkpoint_step", "step of the same checkpoints as rewind_checkpoint_age_seconds",
        labels=["run", "status"],
    )  # fmt: skip
    stall = GaugeMetricFamily(
        "rewind_checkpoint_save_stall_seconds",
        "how long the save of the run's newest committed checkpoint held training up",
        labels=["run"],
    )
    verified = GaugeMetricFamily(
        "rewind_verified_checkpoints", "verified checkpoints the run has", labels=["run"]
    )
    rpo_steps = GaugeMetricFamily(
        "rewind_rpo_steps",
        "steps of training since the newest verified checkpoint, up to the newest step a rank reported",
        labels=["run"],
    )
    rpo_s = GaugeMetricFamily(
        "rewind_rpo_seconds", "seconds of training since the newest verified checkpoint", labels=["run"]
    )
    for r in runs:
        name = r["run"]
        newest = r["newest_unverified"] or r["newest_verified"]  # the newest committed, either status
        for status, c in (("verified", r["newest_verified"]), ("committed", newest)):
            if c is not None:
                age.add_metric([name, status], max(0.0, c["age_s"]))
                step.add_metric([name, status], c["step"])
        if newest is not None and newest.get("save_stall_s") is not None:
            stall.add_metric([name], newest["save_stall_s"])
        verified.add_metric([name], r["verified_checkpoints"])
        if r["rpo"]["steps"] is not None:
            rpo_steps.add_metric([name], r["rpo"]["steps"])
        if r["rpo"]["seconds"] is not None:
            rpo_s.add_metric([name], r["rpo"]["seconds"])
    return [age, step, stall, verified, rpo_steps, rpo_s]


def _run_tiers(runs: list[dict[str, Any]]) -> list[Metric]:
    """Per run and tier: bytes and copies held, replication lag in seconds and steps."""
    tier_bytes = GaugeMetricFamily(
        "rewind_tier_bytes", "bytes of live copies of the run's verified checkpoints on the tier",
        labels=["run", "tier"],
    )  # fmt: skip
    tier_copies = GaugeMetricFamily(
        "rewind_tier_copies", "live copies of the run's verified checkpoints on the tier",
        labels=["run", "tier"],
    )  # fmt: skip
    lag_s = GaugeMetricFamily(
        "rewind_replication_lag_seconds",
        "how far the tier's newest verified copy is behind the run's newest verified checkpoint, in seconds",
        labels=["run", "tier"],
    )
    lag_steps = GaugeMetricFamily(
        "rewind_replication_lag_steps", "the same lag, in steps", labels=["run", "tier"]
    )
    for r in runs:
        for tier, t in r["tiers"].items():
            tier_bytes.add_metric([r["run"], tier], t["bytes"])
            tier_copies.add_metric([r["run"], tier], t["copies"])
            if t["lag_s"] is not None:
                lag_s.add_metric([r["run"], tier], t["lag_s"])
            if t["lag_steps"] is not None:
                lag_steps.add_metric([r["run"], tier], t["lag_steps"])
    return [tier_bytes, tier_copies, lag_s, lag_steps]


def _incidents(kinds: list[incidents.KindTotals], runs: list[dict[str, Any]]) -> list[Metric]:
    opened = GaugeMetricFamily(
        "rewind_open_incidents", "incidents of the run not yet resolved", labels=["run", "kind"]
    )
    for r in runs:
        per_kind: dict[str, int] = {}
        for i in r["open_incidents"]:
            per_kind[i["kind"]] = per_kind.get(i["kind"], 0) + 1
        for kind, n in sorted(per_kind.items()):
            opened.add_metric([r["run"], kind], n)
    total = CounterMetricFamily("rewind_incidents", "incidents recorded, by kind", labels=["kind"])
    rto = SummaryMetricFamily(
        "rewind_incident_rto_seconds", "recovery time of the incidents with one measured", labels=["kind"]
    )
    last = GaugeMetricFamily(
        "rewind_incident_last_rto_seconds", "recovery time of the newest incident with one measured",
        labels=["kind"],
    )  # fmt: skip
    for k in kinds:
        total.add_metric([k.kind], k.incidents)
        rto.add_metric([k.kind], count_value=k.measured, sum_value=k.rto_sum_s)
        if k.last_rto_s is not None:
            last.add_metric([k.kind], k.last_rto_s)
    return [opened, total, rto, last]


def _drills(scenarios: list[drills.ScenarioTotals]) -> list[Metric]:
    total = CounterMetricFamily("rewind_drills", "drills run, by outcome", labels=["scenario", "outcome"])
    verdict = GaugeMetricFamily(
        "rewind_drill_verdict", "1 for the outcome of the scenario's newest drill, 0 for the others",
        labels=["scenario", "outcome"],
    )  # fmt: skip
    rto = GaugeMetricFamily(
        "rewind_drill_rto_seconds", "recovery time the scenario's newest drill measured", labels=["scenario"]
    )
    at = GaugeMetricFamily(
        "rewind_drill_last_timestamp_seconds", "when the scenario's newest drill ended (Unix time)",
        labels=["scenario"],
    )  # fmt: skip
    for d in scenarios:
        for outcome in OUTCOMES:
            total.add_metric([d.scenario, outcome], d.outcomes.get(outcome, 0))
            verdict.add_metric([d.scenario, outcome], 1 if d.last_outcome == outcome else 0)
        if d.last_rto_s is not None:
            rto.add_metric([d.scenario], d.last_rto_s)
        at.add_metric([d.scenario], aware(d.last_at).timestamp())
    return [total, verdict, rto, at]


def _one_line(exc: BaseException) -> str:
    """The error as one line, as the CLI says it (a catalog error names the catalog by its shown URL)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 500 else text[:497] + "..."
