"""Prometheus metrics of the active controller (``--ha-metrics-port``), through prometheus_client.

Counters and histograms follow the controller's own events (a fault, a recovery, a restart, a
checkpoint) as they are emitted; gauges (state, ranks alive, iteration) are set by the controller's
scan. A standby serves them from its takeover on, so a scrape target of every candidate host finds
the active one. prometheus_client is imported only when metrics are asked for.
"""
from __future__ import annotations

from typing import Any, Callable

from ...events import EventLog, get_logger
from ..policy.states import State

log = get_logger("control.metrics")
STATES = tuple(s.value for s in State)


class Metrics:
    def __init__(self, host: str, port: int, world: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
        r = self.registry = CollectorRegistry()
        self.state = Gauge("mindspeed_ha_state", "1 for the controller's current state", ["state"], registry=r)
        self.ranks_alive = Gauge("mindspeed_ha_ranks_alive", "ranks registered and alive", registry=r)
        self.ranks_expected = Gauge("mindspeed_ha_ranks_expected", "ranks of the job (world size)", registry=r)
        self.iteration = Gauge("mindspeed_ha_iteration", "the newest iteration a rank reported", registry=r)
        self.checkpoint = Gauge("mindspeed_ha_last_checkpoint_iteration",
                                "newest checkpointed iteration (periodic or dying gasp)", registry=r)
        self.faults = Counter("mindspeed_ha_faults", "faults by kind", ["kind"], registry=r)
        self.recoveries = Counter("mindspeed_ha_recoveries", "completed recoveries by strategy", ["strategy"], registry=r)
        self.restarts = Counter("mindspeed_ha_restarts", "workers restarted by their agents", registry=r)
        self.mttr = Histogram("mindspeed_ha_mttr_seconds", "fault to the failed step completed again",
                              buckets=(0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)
        self.lost_steps = Histogram("mindspeed_ha_lost_steps", "steps recomputed per recovery",
                                    buckets=(0, 1, 2, 5, 10, 50, 100, 1000), registry=r)
        self.ranks_expected.set(world)
        self._ckpt = -1
        self.checkpoint.set(-1)
        self.set_state("init")
        self.server, self._thread = start_http_server(port, addr=host, registry=r)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1.0 if s == state else 0.0)

    def seen(self, alive: int, iteration: int, checkpoint: int) -> None:
        self.ranks_alive.set(alive)
        self.iteration.set(iteration)
        self._checkpointed(checkpoint)

    def _checkpointed(self, iteration: int) -> None:
        if iteration > self._ckpt:
            self._ckpt = iteration
            self.checkpoint.set(iteration)

    def on_event(self, record: dict[str, Any]) -> None:
        """An event the controller emitted (EventLog listener)."""
        event = record.get("event")
        if event == "fault":
            self.faults.labels(kind=record.get("kind", "?")).inc()
        elif event == "recovered":
            self.recoveries.labels(strategy=record.get("strategy", "?")).inc()
            self.mttr.observe(float(record.get("mttr_s", 0.0)))
            self.lost_steps.observe(float(record.get("lost_steps", 0)))
        elif event == "restart":
            self.restarts.inc(len(record.get("ranks") or ()) + len(record.get("awaiting_node") or ()))
        elif event == "checkpoint" and record.get("iteration") is not None:
            self._checkpointed(int(record["iteration"]))
        elif event == "state":
            self.set_state(record.get("to", ""))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Served:
    """The active controller's metrics, once asked for (--ha-metrics-port): from the start, or from a
    standby's takeover. A port that cannot be served is said in the log and the events, never the end
    of the job."""

    def __init__(self, host: str, port: int | None, world: int, events: EventLog, state: Callable[[], str]):
        self.host, self.port, self.world, self.events, self.state = host, port, world, events, state
        self.metrics: Metrics | None = None

    def serve(self) -> None:
        if not self.port or self.metrics is not None:
            return
        try:
            self.metrics = Metrics(self.host, self.port, self.world)
        except OSError as e:  # metrics are for people: a taken port must not take the job down
            log.error("--ha-metrics-port %d on %s: cannot serve metrics (%s)", self.port, self.host, e)
            self.events.emit("metrics_failed", port=self.port, host=self.host, error=str(e))
            return
        self.metrics.set_state(self.state())
        self.events.listeners.append(self.metrics.on_event)

    def seen(self, alive: int, iteration: int, checkpoint: int) -> None:
        if self.metrics is not None:
            self.metrics.seen(alive, iteration, checkpoint)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
