"""Emulated clusters for benchmarks: network namespaces, a bridge, tbf-shaped veth links."""

from lpsync.cluster.rate import format_rate, parse_delay, parse_rate
from lpsync.cluster.testbed import SUBNET, Cluster, ClusterSpec, down, existing, run_in, up

__all__ = [
    "SUBNET",
    "Cluster",
    "ClusterSpec",
    "down",
    "existing",
    "format_rate",
    "parse_delay",
    "parse_rate",
    "run_in",
    "up",
]
