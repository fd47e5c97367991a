"""Kubernetes' HorizontalPodAutoscaler, as the rehearsal's stand-in for KEDA and the HPA controller: it
reads the chart's ScaledObject (templates/autoscaling.yaml), asks the real Prometheus its query, and
scales the Deployment the object names, by the HPA's documented algorithm
(kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/, "Algorithm details" and
"Configurable scaling behavior"; pkg/controller/podautoscaler/horizontal.go):

- a `Value` metric: desired = ceil(current × value / target), nothing done while value / target is
  within the tolerance (0.1) of 1;
- stabilization: a scale-up takes the lowest recommendation of its window, a scale-down the highest of
  its window (from the ScaledObject's behavior; the HPA's defaults are 0 s and 300 s);
- the default rate policies: up by at most max(100 %, 4 pods) per 15 s, down by up to 100 % per 15 s;
- minReplicaCount <= desired <= maxReplicaCount.

What it leaves out: KEDA's activation (scaling to and from zero, which this chart never asks for), the
HPA's handling of pods not yet ready (a CPU-metric concern: this metric is the fleet's, not per pod), and
its missing-metric rules (the query never comes back empty). The rehearsal shortens the sync period and the
windows and says so where it does.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 0.1
POLICY_PERIOD = 15.0  # seconds: the default policies' periodSeconds
SCALE_UP_PERCENT, SCALE_UP_PODS = 100, 4


@dataclass
class Behavior:
    min_replicas: int
    max_replicas: int
    target: float
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0

    @classmethod
    def of(cls, scaled_object: dict[str, Any]) -> Behavior:
        """The sizing rules of a rendered KEDA ScaledObject (one prometheus trigger of type Value)."""
        spec = scaled_object["spec"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value", trigger
        behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
        return cls(int(spec.get("minReplicaCount", 1)), int(spec["maxReplicaCount"]),
                   float(trigger["metadata"]["threshold"]),
                   float(behavior.get("scaleUp", {}).get("stabilizationWindowSeconds", 0)),
                   float(behavior.get("scaleDown", {}).get("stabilizationWindowSeconds", 300)))


@dataclass
class Recommender:
    """The HPA's replica count for a metric value, with its memory of past recommendations and scale events."""

    behavior: Behavior
    recommendations: list[tuple[float, int]] = field(default_factory=list)  # (when, replicas)
    events: list[tuple[float, int]] = field(default_factory=list)  # (when, change) of scaling done

    def desired(self, current: int, value: float, now: float) -> int:
        b = self.behavior
        ratio = value / b.target
        raw = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(current * ratio)
        self.recommendations.append((now, raw))
        keep = max(b.scale_up_window, b.scale_down_window)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > now - keep]
        up = min([r for t, r in self.recommendations if t > now - b.scale_up_window] + [raw])
        down = max([r for t, r in self.recommendations if t > now - b.scale_down_window] + [raw])
        if current < up:
            stabilized = up
        elif current > down:
            stabilized = down
        else:
            stabilized = current
        return max(b.min_replicas, min(b.max_replicas, self._rate_limited(current, stabilized, now)))

    def _rate_limited(self, current: int, desired: int, now: float) -> int:
        self.events = [(t, c) for t, c in self.events if t > now - POLICY_PERIOD]
        if desired > current:
            at_start = current - sum(c for _, c in self.events if c > 0)  # replicas when the period began
            return min(desired, max(math.ceil(at_start * (1 + SCALE_UP_PERCENT / 100)), at_start + SCALE_UP_PODS))
        return desired  # down: 100 % per period, no limit

    def scaled(self, change: int, now: float) -> None:
        if change:
            self.events.append((now, change))


class Autoscaler:
    """Every `sync` seconds: the query's value from Prometheus, the Deployment's replicas, the HPA's
    recommendation; scales when it differs. `trajectory` keeps every step (for the results)."""

    def __init__(self, scaled_object: dict[str, Any], query: Callable[[str], float | None],
                 replicas: Callable[[], int], scale: Callable[[int], None], sync: float = 15.0,
                 behavior: Behavior | None = None) -> None:
        self.expr = scaled_object["spec"]["triggers"][0]["metadata"]["query"]
        self.recommender = Recommender(behavior or Behavior.of(scaled_object))
        self.query, self.replicas, self.scale, self.sync = query, replicas, scale, sync
        self.trajectory: list[dict[str, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self.started = time.monotonic()

    def start(self) -> Autoscaler:
        self._thread.start()
        return self

    def step(self) -> None:
        now = time.monotonic()
        value = self.query(self.expr)
        current = self.replicas()
        if value is None:  # KEDA reports an error; the HPA keeps the size
            self.trajectory.append({"seconds": round(now - self.started, 1), "replicas": current, "metric": None})
            return
        desired = self.recommender.desired(current, value, now)
        self.trajectory.append({"seconds": round(now - self.started, 1), "replicas": current,
                                "metric": round(value, 4), "desired": desired})
        if desired != current:
            self.scale(desired)
            self.recommender.scaled(desired - current, now)

    def _run(self) -> None:
        while not self._stop.wait(self.sync):
            self.step()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.sync + 30)
