"""Finished collectives' figures are counted by the daemon's own collector (metrics.py):
a scrape sees every collective finished before it, exposed as prometheus_client's own
Histogram, Counter and Gauge would expose them, and none is lost across threads."""

from __future__ import annotations

import random
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lpsync.daemon.control.metrics import _BUCKETS, Metrics, size_class


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_scrape_sees_every_collective_finished_before_it() -> None:
    m = Metrics()
    m.collective_done("allreduce", "tree", "float32", 4, 0.002, 1.75)
    m.collective_done("allreduce", "tree", "float32", 4, 0.004, 1.75)
    m.collective_done("broadcast", "lp", "float32", 8 << 20, 0.5, 1.0)
    seen = _samples(m.registry)
    labels = (("algorithm", "tree"), ("dtype", "float32"), ("op", "allreduce"), ("size", "<=4KiB"))
    assert seen[("lpsync_collective_seconds_count", labels)] == 2
    assert abs(seen[("lpsync_collective_seconds_sum", labels)] - 0.006) < 1e-12
    assert seen[("lpsync_collective_seconds_bucket", (*labels[:2], ("le", "0.0025"), *labels[2:]))] == 1
    assert seen[("lpsync_collective_bytes_total", (("op", "allreduce"),))] == 8
    # The latest of each op's bus bandwidth.
    assert seen[("lpsync_busbw_bytes_per_second", (("op", "broadcast"),))] == (8 << 20) / 0.5
    assert seen[("lpsync_busbw_bytes_per_second", (("op", "allreduce"),))] == 4 / 0.004 * 1.75


def test_the_series_read_as_prometheus_clients_own_would() -> None:
    """The reference: the same figures observed by prometheus_client's Histogram, Counter
    and Gauge, bucket bounds included (times on a bound, 0 and past the last bound)."""
    m, reference = Metrics(), CollectorRegistry()
    seconds = Histogram(
        "lpsync_collective_seconds",
        "",
        ["op", "algorithm", "dtype", "size"],
        buckets=_BUCKETS,
        registry=reference,
    )
    nbytes = Counter("lpsync_collective_bytes", "", ["op"], registry=reference)
    busbw = Gauge("lpsync_busbw_bytes_per_second", "", ["op"], registry=reference)
    draw = random.Random(7)
    for _ in range(3000):
        op = draw.choice(("allreduce", "broadcast", "barrier"))
        algorithm = draw.choice(("lp", "ring", "tree"))
        size = draw.choice((0, 4, 5000, 1 << 20, 70 << 20, 5 << 30))
        took = draw.choice((0.0, 1e-5, 2.5e-5, 3e-5, 0.00123, 5.0, 1000.0, 2000.0, draw.random()))
        m.collective_done(op, algorithm, "float32", size, took, 1.75)
        seconds.labels(op, algorithm, "float32", size_class(size)).observe(took)
        nbytes.labels(op).inc(size)
        if took > 0 and size:
            busbw.labels(op).set(size / took * 1.75)
    series = ("lpsync_collective_seconds", "lpsync_collective_bytes", "lpsync_busbw")
    ours = {k: v for k, v in _samples(m.registry).items() if k[0].startswith(series)}
    assert len(ours) > 1000
    assert ours == _samples(reference)


def test_no_figure_is_lost_across_threads() -> None:
    m = Metrics()
    per_thread, threads = 1000, 4

    def finish() -> None:
        for _ in range(per_thread):
            m.collective_done("allreduce", "ring", "float32", 1 << 20, 0.01, 1.75)

    workers = [threading.Thread(target=finish) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    labels = (("algorithm", "ring"), ("dtype", "float32"), ("op", "allreduce"), ("size", "<=1MiB"))
    seen = _samples(m.registry)
    assert seen[("lpsync_collective_seconds_count", labels)] == per_thread * threads
    assert seen[("lpsync_collective_bytes_total", (("op", "allreduce"),))] == per_thread * threads * (1 << 20)
