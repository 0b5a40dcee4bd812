"""Finished collectives' figures go into the Prometheus series in batches (metrics.py):
a scrape sees every collective finished before it, and a daemon nobody scrapes holds
at most a batch of them."""

from __future__ import annotations

import threading

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lpsync.daemon.control import metrics as metrics_module
from lpsync.daemon.control.metrics import Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_scrape_sees_every_collective_finished_before_it() -> None:
    m = Metrics()
    m.collective_done("allreduce", "tree", "float32", 4, 0.002, 1.75)
    m.collective_done("allreduce", "tree", "float32", 4, 0.004, 1.75)
    m.collective_done("broadcast", "lp", "float32", 8 << 20, 0.5, 1.0)
    seen = _samples(m)
    labels = (("algorithm", "tree"), ("dtype", "float32"), ("op", "allreduce"), ("size", "<=4KiB"))
    assert seen[("lpsync_collective_seconds_count", labels)] == 2
    assert abs(seen[("lpsync_collective_seconds_sum", labels)] - 0.006) < 1e-12
    assert seen[("lpsync_collective_bytes_total", (("op", "allreduce"),))] == 8
    # The latest of each op's bus bandwidth, as before the queue.
    assert seen[("lpsync_busbw_bytes_per_second", (("op", "broadcast"),))] == (8 << 20) / 0.5
    assert seen[("lpsync_busbw_bytes_per_second", (("op", "allreduce"),))] == 4 / 0.004 * 1.75


def test_unscraped_figures_stay_within_a_batch_and_none_is_lost_across_threads() -> None:
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
    assert len(m._queued) < metrics_module._BATCH + threads  # drained as they came
    labels = (("algorithm", "ring"), ("dtype", "float32"), ("op", "allreduce"), ("size", "<=1MiB"))
    assert _samples(m)[("lpsync_collective_seconds_count", labels)] == per_thread * threads
