"""Prometheus metrics of DESIGN.md, in a registry of the daemon's own (no hidden globals).

Recorded once at the end of each collective (never per chunk), into plain counts of our
own (``_Collectives``): a bucket found by bisection and a few list and dict updates
under one lock, where prometheus_client's Histogram, Counter and Gauge cost about a dozen
Python calls per collective (docs/benchmarks.md at 623decd, 2026-12-06). A scrape reads
the counts as the histogram, counter and gauge families they stand for, so a scrape
sees every collective finished before it. Session and buffer changes are recorded at
once; per-job and per-session figures are read from the daemon's own tables when
Prometheus scrapes (``watch``), so they cost the collective path nothing.
Label cardinality stays bounded: ``size`` is one of a few size classes, ``job`` exists
only while the job is attached here, ``peer`` is one of the configured peers.
The deploy/ alert rules and dashboard use these names (tests/deploy checks them).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# 1-2.5-5 steps from 10 us to 1000 s: percentiles stay within a factor 2.5 of the truth
# from a small-message barrier to a slow multi-GiB allreduce over a congested link.
_BUCKETS = (*(float(f"{m}e{e}") for e in range(-5, 3) for m in (1, 2.5, 5)), 1000.0)
BUCKETS = _BUCKETS  # the native engine keeps its histograms over the same bounds

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


class _Collectives(Collector):
    """The finished collectives' series: ``lpsync_collective_seconds`` (a histogram by op,
    algorithm, dtype and size class), ``lpsync_collective_bytes`` (a counter by op) and
    ``lpsync_busbw_bytes_per_second`` (the latest, by op), kept as plain numbers."""

    _SECONDS_LABELS = ("op", "algorithm", "dtype", "size")
    # Bucket bounds as the exposition writes them (Histogram's own formatting).
    _LE = (*(floatToGoString(b) for b in _BUCKETS), "+Inf")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (op, algorithm, dtype, size) -> [count per bucket (the last: +Inf), sum of seconds]
        self._seconds: dict[tuple[str, str, str, str], list] = {}
        self._bytes: dict[str, int] = {}
        self._busbw: dict[str, float] = {}
        # Called first at each scrape: the native engine's counts join the series then.
        self.before_collect: Callable[[], None] | None = None

    def done_many(
        self, op: str, algorithm: str, dtype: str, nbytes: int, counts: list[int], total: float, factor: float
    ) -> None:
        """Collectives the native engine ran since the last call: its per-bucket counts
        (the bounds of BUCKETS, +Inf last) and their summed seconds."""
        key = (op, algorithm, dtype, _SIZE_NAMES[bisect.bisect_left(_SIZE_BOUNDS, nbytes)])
        calls = sum(counts)
        with self._lock:
            series = self._seconds.get(key)
            if series is None:
                series = self._seconds[key] = [[0] * (len(_BUCKETS) + 1), 0.0]
            for bucket, count in enumerate(counts):
                series[0][bucket] += count
            series[1] += total
            self._bytes[op] = self._bytes.get(op, 0) + nbytes * calls
            if total > 0 and nbytes:
                self._busbw[op] = nbytes * calls / total * factor

    def done(self, op: str, algorithm: str, dtype: str, nbytes: int, seconds: float, factor: float) -> None:
        key = (op, algorithm, dtype, _SIZE_NAMES[bisect.bisect_left(_SIZE_BOUNDS, nbytes)])
        bucket = bisect.bisect_left(_BUCKETS, seconds)  # the first bound >= seconds, as observe()
        with self._lock:
            series = self._seconds.get(key)
            if series is None:
                series = self._seconds[key] = [[0] * (len(_BUCKETS) + 1), 0.0]
            series[0][bucket] += 1
            series[1] += seconds
            self._bytes[op] = self._bytes.get(op, 0) + nbytes
            if seconds > 0 and nbytes:
                self._busbw[op] = nbytes / seconds * factor

    def collect(self):
        if self.before_collect is not None:
            self.before_collect()
        with self._lock:
            seconds = [(key, list(counts), total) for key, (counts, total) in self._seconds.items()]
            nbytes, busbw = dict(self._bytes), dict(self._busbw)
        histogram = HistogramMetricFamily(
            "lpsync_collective_seconds",
            "Collective time from last arrival to completion",
            labels=self._SECONDS_LABELS,
        )
        for key, counts, total in seconds:
            histogram.add_metric(
                list(key), list(zip(self._LE, itertools.accumulate(counts), strict=True)), total
            )
        counter = CounterMetricFamily(
            "lpsync_collective_bytes", "Bytes of collectives completed (nccl-tests size)", labels=["op"]
        )
        for op, value in nbytes.items():
            counter.add_metric([op], value)
        gauge = GaugeMetricFamily(
            "lpsync_busbw_bytes_per_second", "Bus bandwidth of the latest collective", labels=["op"]
        )
        for op, value in busbw.items():
            gauge.add_metric([op], value)
        return [histogram, counter, gauge]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._collectives = _Collectives()
        r.register(self._collectives)
        # A collective finished: (op, algorithm, dtype, nbytes, seconds, busbw factor), in
        # the series from the next scrape on. The counter's own method: no wrapper's call.
        self.collective_done = self._collectives.done
        self.collectives_done = self._collectives.done_many
        self.collective_errors = Counter(
            "lpsync_collective_errors", "Collectives that failed, by status code", ["op", "code"], registry=r
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

    def before_collect(self, sync: Callable[[], None]) -> None:
        """Call ``sync`` first at each scrape (the native engine's counts join then)."""
        self._collectives.before_collect = sync

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

    def collective_failed(self, op: str, code: str) -> None:
        self.collective_errors.labels(op, code).inc()
