"""Health gates of a canary: error rate on real traffic, p95 latency and quality on a probe set.

Error rate counts the canary's answers at the proxy (real traffic) plus the
probes; latency and quality come from the probes, sent to the canary version
itself through TorchServe's versioned endpoint. A probe is one JSON line,
``{"input": "...", "expected": "..."}``; it is right when the endpoint's JSON
``output`` equals ``expected``. A window with no request at all fails: no
evidence is not a pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rewind.infra.errors import ConfigError
from rewind.infra.serving.backend import Backend
from rewind.infra.serving.haproxy import ServerStats


@dataclass(frozen=True, kw_only=True)
class Gates:
    max_error_rate: float = 0.05
    """Share of failed requests (5xx, refused connections) above which the canary fails."""
    max_p95_latency_ms: float = 1000.0
    """95th percentile of probe latency, in milliseconds."""
    min_quality: float | None = None
    """Share of probes answered right; None: no quality gate (then no probe set is needed)."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_error_rate <= 1:
            raise ConfigError(f"max_error_rate must be within 0-1, got {self.max_error_rate}")
        if self.max_p95_latency_ms <= 0:
            raise ConfigError("max_p95_latency_ms must be positive")
        if self.min_quality is not None and not 0 <= self.min_quality <= 1:
            raise ConfigError(f"min_quality must be within 0-1, got {self.min_quality}")


@dataclass(frozen=True, slots=True)
class Probe:
    input: str
    expected: str


@dataclass(frozen=True)
class Result:
    passed: bool
    requests: int
    errors: int
    error_rate: float | None
    p95_latency_ms: float | None
    quality: float | None
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def load_probes(path: Path) -> list[Probe]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"probe set {path}: {exc.strerror or exc}") from exc
    probes = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            probes.append(Probe(str(row["input"]), str(row["expected"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"probe set {path} line {n}: expected {{'input', 'expected'}} ({exc})") from exc
    if not probes:
        raise ConfigError(f"probe set {path} is empty")
    return probes


def p95(samples: list[float]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _output(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()
    return str(parsed.get("output")) if isinstance(parsed, dict) else str(parsed)


def evaluate(
    backend: Backend,
    model: str,
    version: str,
    gates: Gates,
    probes: list[Probe],
    *,
    traffic_before: ServerStats | None,
    traffic_after: ServerStats | None,
) -> Result:
    """Judge the canary over one window: the proxy counters' change plus one pass over the probes."""
    requests = errors = 0
    if traffic_after is not None:
        base = traffic_before or ServerStats(0, 0, 0, 0)
        requests += traffic_after.responses - base.responses
        errors += traffic_after.errors - base.errors
    latencies: list[float] = []
    right = 0
    # A probe slower than twice the latency limit fails whatever it answers; and once more requests
    # failed than the error budget of the whole window allows, the verdict is known: stop probing.
    timeout_s = max(1.0, 2 * gates.max_p95_latency_ms / 1000)
    budget = gates.max_error_rate * (requests + len(probes))
    for probe in probes:
        answer = backend.predict(model, probe.input.encode(), version, timeout_s=timeout_s)
        requests += 1
        if answer.status != 200:
            errors += 1
            if errors > budget:
                break
            continue
        latencies.append(answer.latency_s * 1000)
        right += _output(answer.body) == probe.expected
    error_rate = errors / requests if requests else None
    quality = right / len(probes) if probes else None  # probes skipped after the verdict count as wrong
    latency = p95(latencies)
    reasons = []
    if requests == 0:
        reasons.append("no requests reached the canary and no probes were sent")
    if error_rate is not None and error_rate > gates.max_error_rate:
        reasons.append(f"error rate {error_rate:.3f} > {gates.max_error_rate}")
    if latency is not None and latency > gates.max_p95_latency_ms:
        reasons.append(f"p95 latency {latency:.1f} ms > {gates.max_p95_latency_ms} ms")
    if gates.min_quality is not None:
        if quality is None:
            reasons.append("quality gate set but no probe set given")
        elif quality < gates.min_quality:
            reasons.append(f"quality {quality:.3f} < {gates.min_quality}")
    return Result(not reasons, requests, errors, error_rate, latency, quality, reasons)
