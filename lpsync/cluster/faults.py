"""Link faults on the emulated cluster: cut a node off and bring it back.

Three ways to cut node ``i`` (its namespace untouched, its daemon and clients running):
  * ``down``: its switch port ``p{i}`` goes down, as if its cable were pulled (``eth0``
    loses carrier; nothing is reset, packets just stop);
  * ``drop``: both directions silently lose every packet;
  * ``drop-out``: only its uploads are lost (one direction): it still hears the others.

This kernel has neither netem nor the gact/police actions (``tc filter ... action
drop``), so loss is made with what it has: the tbf that shapes each direction is
replaced by one of 8 bit/s with a 1-byte bucket and a 1-byte queue, which drops every
packet (a frame never fits the bucket). ``restore`` puts the original shaping back.
"""

from __future__ import annotations

from lpsync.cluster import netns
from lpsync.cluster.testbed import ClusterSpec, _shape
from lpsync.errors import InvalidArgumentError

MODES = ("down", "drop", "drop-out")


def _blackhole(ns: str, dev: str) -> None:
    netns.tc(
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "handle",
        "1:",
        "tbf",
        "rate",
        "8bit",
        "burst",
        "1",
        "limit",
        "1",
        ns=ns,
    )


def _reshape(spec: ClusterSpec, ns: str, dev: str) -> None:
    netns.tc("qdisc", "del", "dev", dev, "root", ns=ns)
    _shape(spec, ns, dev)


def cut(spec: ClusterSpec, node: int, mode: str) -> None:
    """Cut ``node`` off the switch in one of MODES."""
    if mode not in MODES:
        raise InvalidArgumentError(f"fault mode {mode!r}: one of {', '.join(MODES)}")
    if not 0 <= node < spec.nodes:
        raise InvalidArgumentError(f"node {node} is not in this {spec.nodes}-node cluster")
    if mode == "down":
        netns.ip("link", "set", f"p{node}", "down", ns=spec.switch)
        return
    _blackhole(spec.namespace(node), "eth0")  # its uploads
    if mode == "drop":
        _blackhole(spec.switch, f"p{node}")  # its downloads


def restore(spec: ClusterSpec, node: int, mode: str) -> None:
    """Undo ``cut(spec, node, mode)``: the link as ``up`` made it."""
    if mode == "down":
        netns.ip("link", "set", f"p{node}", "up", ns=spec.switch)
        return
    _reshape(spec, spec.namespace(node), "eth0")
    if mode == "drop":
        _reshape(spec, spec.switch, f"p{node}")
