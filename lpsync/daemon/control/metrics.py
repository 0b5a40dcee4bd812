"""Prometheus metrics of DESIGN.md, in a registry of the daemon's own (no hidden globals).

Recorded once at the end of each collective (never per chunk), in batches: the
collective appends its figures to a queue, and every _BATCH of them, or a scrape, moves
them into the series (Prometheus's observe takes a lock per bucket it passes; a tight
loop over many costs less per collective than each on its own, on a cold cache). A
scrape always sees every collective finished before it. Session and buffer changes are
recorded at once; per-job and per-session figures are read from the daemon's own tables
when Prometheus scrapes (``watch``), so they cost the collective path nothing.
Label cardinality stays bounded: ``size`` is one of a few size classes, ``job`` exists
only while the job is attached here, ``peer`` is one of the configured peers.
The deploy/ alert rules and dashboard use these names (tests/deploy checks them).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# 1-2.5-5 steps from 10 us to 1000 s: percentiles stay within a factor 2.5 of the truth
# from a small-message barrier to a slow multi-GiB allreduce over a congested link.
_BUCKETS = (*(float(f"{m}e{e}") for e in range(-5, 3) for m in (1, 2.5, 5)), 1000.0)

_BATCH = 64  # finished collectives queued before their figures go into the series

# Message-size classes (nccl-tests bytes) of the latency histogram: powers of 16 from 4 KiB.
_SIZE_BOUNDS = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 4 << 30)
_SIZE_NAMES = ("<=4KiB", "<=64KiB", "<=1MiB", "<=16MiB", "<=256MiB", "<=4GiB", ">4GiB")


def size_class(nbytes: int) -> str:
    """The ``size`` label of a collective of ``nbytes`` bytes."""
    return _SIZE_NAMES[bisect.bisect_left(_SIZE_BOUNDS, nbytes)]


@dataclass(frozen=True)
class JobState:
    name: str
    pending: int  # collectives some local rank issued that have not completed
    last_progress: float  # unix time of the last completed collective (or of the attach)


class _TableCollector(Collector):
    """Series read from the daemon's tables at scrape time."""

    def __init__(
        self, jobs: Callable[[], Iterable[JobState]], session_bytes: Callable[[], Iterable[int]]
    ) -> None:
        self._jobs, self._session_bytes = jobs, session_bytes

    def collect(self):
        pending = GaugeMetricFamily(
            "lpsync_job_pending_collectives",
            "Collectives of the job waiting for ranks or running on this daemon",
            labels=["job_name"],
        )
        progress = GaugeMetricFamily(
            "lpsync_job_last_progress_timestamp_seconds",
            "Unix time the job last completed a collective here (its attach time before that)",
            labels=["job_name"],
        )
        for job in self._jobs():
            pending.add_metric([job.name], job.pending)
            progress.add_metric([job.name], job.last_progress)
        largest = GaugeMetricFamily(
            "lpsync_session_registered_bytes_max",
            "Bytes held in buffers by the session holding the most (limit: lpsync_session_bytes_limit)",
        )
        largest.add_metric([], max(self._session_bytes(), default=0))
        return [pending, progress, largest]


class _Drain(Collector):
    """Registered first, so collected first at each scrape: queued figures go into the
    series before those are read."""

    def __init__(self, drain: Callable[[], None]) -> None:
        self._drain = drain

    def collect(self):
        self._drain()
        return []


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Finished collectives' figures not yet in the series (collective_done); deque:
        # appends and pops from any thread, nothing lost between them.
        self._queued: deque[tuple[str, str, str, int, float, float]] = deque()
        self._draining = threading.Lock()  # one drain at a time: the latest busbw wins
        self._children: dict[tuple[str, str, str, str], tuple] = {}
        r.register(_Drain(self.drain))
        self.collective_seconds = Histogram(
            "lpsync_collective_seconds",
            "Collective time from last arrival to completion",
            ["op", "algorithm", "dtype", "size"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.collective_bytes = Counter(
            "lpsync_collective_bytes", "Bytes of collectives completed (nccl-tests size)", ["op"], registry=r
        )
        self.collective_errors = Counter(
            "lpsync_collective_errors", "Collectives that failed, by status code", ["op", "code"], registry=r
        )
        self.busbw = Gauge(
            "lpsync_busbw_bytes_per_second", "Bus bandwidth of the latest collective", ["op"], registry=r
        )
        self.sessions = Gauge("lpsync_sessions", "Attached sessions", registry=r)
        self.registered_bytes = Gauge(
            "lpsync_registered_bytes", "Bytes in allocated and registered buffers", registry=r
        )
        self.session_bytes_limit = Gauge(
            "lpsync_session_bytes_limit", "Bytes one session may hold (--max-session-bytes)", registry=r
        )
        self.buffer_bytes_limit = Gauge(
            "lpsync_buffer_bytes_limit", "Largest single buffer (--max-buffer-bytes)", registry=r
        )
        self.peers_connected = Gauge(
            "lpsync_peers_connected", "Peer daemons this one is connected to", registry=r
        )
        self.peers_expected = Gauge(
            "lpsync_peers_expected", "Peer daemons this one is configured with (0: one node)", registry=r
        )
        self.peer_link_bw = Gauge(
            "lpsync_peer_link_bytes_per_second", "Peer link bandwidth probed on connect", ["peer"], registry=r
        )
        self.peer_heartbeats = Counter(
            "lpsync_peer_heartbeats", "Heartbeats received from each peer daemon", ["peer"], registry=r
        )
        self.peer_transport = Info(
            "lpsync_peer_transport", "The peer plane's transport and why it was chosen", registry=r
        )
        self.device_registered_bytes = Gauge(
            "lpsync_device_registered_bytes",
            "Bytes of device buffers registered, per device",
            ["device"],
            registry=r,
        )
        self._devices: list = []

    def watch(
        self, jobs: Callable[[], Iterable[JobState]], session_bytes: Callable[[], Iterable[int]]
    ) -> None:
        """Export the per-job and per-session series, read from these callables at scrape."""
        self.registry.register(_TableCollector(jobs, session_bytes))

    def describe_devices(self, kind: str, count: int) -> None:
        """The devices of this daemon (``kind``:0..count-1), shown at 0 bytes until used."""
        self._devices = [self.device_registered_bytes.labels(f"{kind}:{d}") for d in range(count)]
        for child in self._devices:
            child.set(0)

    def device_bytes(self, per_device: list[int]) -> None:
        for child, nbytes in zip(self._devices, per_device, strict=False):
            child.set(nbytes)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def collective_done(
        self, op: str, algorithm: str, dtype: str, nbytes: int, seconds: float, busbw_factor: float
    ) -> None:
        """A collective finished: queued, in the series by the next scrape."""
        queued = self._queued
        queued.append((op, algorithm, dtype, nbytes, seconds, busbw_factor))
        if len(queued) >= _BATCH:
            self.drain()

    def drain(self) -> None:
        """Move every queued collective's figures into the series."""
        with self._draining:
            queued, children_of = self._queued, self._children
            while queued:
                op, algorithm, dtype, nbytes, seconds, busbw_factor = queued.popleft()
                # labels() costs more than the observation: keep the children per label set.
                key = (op, algorithm, dtype, size_class(nbytes))
                children = children_of.get(key)
                if children is None:
                    children = children_of[key] = (
                        self.collective_seconds.labels(*key),
                        self.collective_bytes.labels(op),
                        self.busbw.labels(op),
                    )
                seconds_child, bytes_child, busbw_child = children
                seconds_child.observe(seconds)
                bytes_child.inc(nbytes)
                if seconds > 0 and nbytes:
                    busbw_child.set(nbytes / seconds * busbw_factor)

    def collective_failed(self, op: str, code: str) -> None:
        self.collective_errors.labels(op, code).inc()
