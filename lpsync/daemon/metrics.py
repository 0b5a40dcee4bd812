"""Prometheus metrics of DESIGN.md, in a registry of the daemon's own (no hidden globals).

Recorded once at the end of each collective (never per chunk) and on session and
buffer changes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.collective_seconds = Histogram(
            "lpsync_collective_seconds", "Collective time from last arrival to completion",
            ["op", "algorithm", "dtype"], buckets=_BUCKETS, registry=r)
        self.collective_bytes = Counter(
            "lpsync_collective_bytes", "Bytes of collectives completed (nccl-tests size)",
            ["op"], registry=r)
        self.collective_errors = Counter(
            "lpsync_collective_errors", "Collectives that failed, by status code",
            ["op", "code"], registry=r)
        self.busbw = Gauge(
            "lpsync_busbw_bytes_per_second", "Bus bandwidth of the latest collective",
            ["op"], registry=r)
        self.sessions = Gauge("lpsync_sessions", "Attached sessions", registry=r)
        self.registered_bytes = Gauge(
            "lpsync_registered_bytes", "Bytes in allocated and registered buffers", registry=r)
        self.peers_connected = Gauge(
            "lpsync_peers_connected", "Peer daemons this one is connected to",
            registry=r)
        self.peer_link_bw = Gauge(
            "lpsync_peer_link_bytes_per_second", "Peer link bandwidth probed on connect",
            ["peer"], registry=r)
        self.device_registered_bytes = Gauge(
            "lpsync_device_registered_bytes", "Bytes of device buffers registered, per device",
            ["device"], registry=r)
        self._children: dict[tuple[str, str, str], tuple] = {}
        self._devices: list = []

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

    def collective_done(self, op: str, algorithm: str, dtype: str, nbytes: int, seconds: float,
                        busbw_factor: float) -> None:
        # labels() costs more than the observation: keep the children per label set.
        key = (op, algorithm, dtype)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.collective_seconds.labels(*key),
                                              self.collective_bytes.labels(op),
                                              self.busbw.labels(op))
        seconds_child, bytes_child, busbw_child = children
        seconds_child.observe(seconds)
        bytes_child.inc(nbytes)
        if seconds > 0 and nbytes:
            busbw_child.set(nbytes / seconds * busbw_factor)

    def collective_failed(self, op: str, code: str) -> None:
        self.collective_errors.labels(op, code).inc()
