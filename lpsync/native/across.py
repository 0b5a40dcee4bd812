"""A node's part of a collective across nodes, compiled into one flat program.

The general path runs a schedule (lpsync/algorithms) with one executor per participant
and a thread per message hand-off (lpsync/engine). Armed, the same schedule runs as one
program per node that the native engine executes on one thread (net.c): this module
turns the schedule's rows for the node's participants into the engine's steps.

- One order for every node. With several participants on a node, their rows are
  interleaved in the order of one deterministic walk over the whole schedule (every
  participant runs until it waits for a message not yet sent), which every node
  computes alike. Projected onto a node, that order never waits for a message that the
  walk sends later, so the nodes' programs cannot deadlock (sends never block in the
  engine).
- Channels are peer nodes (channel c carries the messages to and from node c). A
  channel's messages are numbered in the walk's order of their sends, on both sides.
- A GO round opens the program, a tree rooted at node 0 (engine.h): nothing is written
  unless every node runs this plan for this call; otherwise all take the general path.
- Buffers: 1 + 2i and 2 + 2i are the input and output views of the node's i-th
  participant (program.py's numbering); the scratch (buffer 0) holds each participant's
  TMP, then a landing range per message received from another node, then a staging
  range per message between two participants of this node (copied there at the send,
  taken at the receive: the sender may overwrite its span before the receiver runs).
- Spans are the schedule's elements times the item size; a copy onto itself (in place)
  is dropped, as the Python executor drops it.

The schedule stays the one source of truth: nothing here chooses an algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lpsync.algorithms.schedule import Buf, Kind, Schedule
from lpsync.errors import ScheduleError
from lpsync.native.program import (
    COMBINE,
    COPY,
    DIVIDE,
    DOWN_RECV,
    DOWN_SEND,
    GO,
    RECV,
    RECV_COMBINE,
    SEND,
    UP_RECV,
    UP_SEND,
    Program,
    Step,
)
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp

MAX_NODES = 64  # engine.h's LPN_MAX_CHANNELS: a channel per peer node
_ALIGN = 64  # scratch ranges start on a cache line (and so on any element)

_SEND, _RECV, _RECV_REDUCE, _COPY = (int(k) for k in Kind)


@dataclass(frozen=True)
class NodeProgram:
    """A node's program and the other nodes of the job (its channels: the GO round is
    with each of them, messages with the schedule's neighbours among them)."""

    program: Program
    peers: tuple[int, ...]


def walk(schedule: Schedule) -> np.ndarray:
    """Every row of ``schedule`` in one order that runs: each participant in turn runs
    its rows until it reaches a receive whose message is not yet sent."""
    kind, offsets = schedule.ops["kind"], schedule.offsets
    sender_of = np.full(schedule.num_ops, -1, np.int64)  # receive row -> its send row
    sender_of[schedule.recv_op] = schedule.send_op
    sent = np.zeros(schedule.num_ops, np.bool_)
    position = offsets[:-1].astype(np.int64).copy()
    ends = offsets[1:].astype(np.int64)
    order: list[int] = []
    while len(order) < schedule.num_ops:
        before = len(order)
        for rank in range(schedule.participants):
            row, end = int(position[rank]), int(ends[rank])
            while row < end:
                k = int(kind[row])
                if k in (_RECV, _RECV_REDUCE) and not sent[sender_of[row]]:
                    break
                if k == _SEND:
                    sent[row] = True
                order.append(row)
                row += 1
            position[rank] = row
        if len(order) == before:
            raise ScheduleError(f"{schedule.algorithm} {schedule.op}: the schedule waits on itself")
    return np.asarray(order, np.int64)


def compile_node(
    schedule: Schedule,
    node_of: tuple[int, ...],
    node: int,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    reduction: Reduction | None,
) -> NodeProgram | None:
    """Node ``node``'s program of ``schedule`` over ``pairs`` (the (input, output) views of
    its participants, in rank order); None where the engine cannot run it (more nodes
    than channels)."""
    nodes = max(node_of) + 1
    if nodes > MAX_NODES:
        return None
    local = [r for r, n in enumerate(node_of) if n == node]
    if len(local) != len(pairs):
        raise ValueError(f"node {node} has {len(local)} participants, given {len(pairs)} buffer pairs")
    slot = {rank: i for i, rank in enumerate(local)}
    itemsize = pairs[0][0].dtype.itemsize if pairs else 1
    ops = schedule.ops
    order = walk(schedule)
    message_of = {}  # receive row -> message index (schedule.send_op / recv_op order)
    for m, row in enumerate(schedule.recv_op.tolist()):
        message_of[row] = m
    message_of_send = {row: m for m, row in enumerate(schedule.send_op.tolist())}

    # Scratch layout: TMP per participant, then landing and staging ranges.
    scratch = 0

    def reserve(nbytes: int) -> int:
        nonlocal scratch
        at = scratch
        scratch += -(-nbytes // _ALIGN) * _ALIGN
        return at

    tmp = {rank: reserve(schedule.tmp_elements * itemsize) for rank in local}
    numbers: dict[int, int] = {}  # message -> its number on its channel (send order)
    sends_on: dict[int, int] = {}
    for row in order.tolist():  # numbered by the walk's send order: alike on both nodes
        if int(ops["kind"][row]) != _SEND:
            continue
        sender, receiver = int(ops["rank"][row]), int(ops["peer"][row])
        a, b = node_of[sender], node_of[receiver]
        if a == b or node not in (a, b):
            continue
        pair = (a, b)
        m = message_of_send[row]
        numbers[m] = sends_on.get(pair[0] * nodes + pair[1], 0)
        sends_on[pair[0] * nodes + pair[1]] = numbers[m] + 1

    def where(rank: int, buf: int, lo: int) -> tuple[int, int]:
        if buf == Buf.TMP:
            return 0, tmp[rank] + lo * itemsize
        return 1 + 2 * slot[rank] + (0 if buf == Buf.IN else 1), lo * itemsize

    def address(rank: int, buf: int, lo: int) -> int:
        if buf == Buf.TMP:
            return -1 - lo  # the scratch never aliases a view
        view = pairs[slot[rank]][0 if buf == Buf.IN else 1]
        return int(view.__array_interface__["data"][0]) + lo * itemsize

    program = Program(reduction, itemsize, 0)
    steps = program.steps
    # The GO round, rooted at node 0 (engine.h): one that took the general path for this
    # call stops every armed node before it writes.
    others = [n for n in range(nodes) if n != node]
    if node == 0:
        steps.extend(Step(GO, 0, 0, a=1, b=n) for n in others)
    else:
        steps.append(Step(GO, 0, 0, a=0, b=0))
    staging: dict[int, int] = {}  # local message -> its staging offset
    landing: dict[int, int] = {}
    avg = reduction is not None and reduction.op is ReduceOp.AVG and reduction.participants > 1
    for row in order.tolist():
        rank = int(ops["rank"][row])
        if node_of[rank] != node:
            continue
        k, peer = int(ops["kind"][row]), int(ops["peer"][row])
        buf, lo, hi = int(ops["buf"][row]), int(ops["lo"][row]), int(ops["hi"][row])
        nbytes, elements = (hi - lo) * itemsize, hi - lo
        dst, dst_off = where(rank, buf, lo)
        if k == _COPY:
            src, src_lo = int(ops["src"][row]), int(ops["src_lo"][row])
            if address(rank, src, src_lo) != address(rank, buf, lo):
                a, a_off = where(rank, src, src_lo)
                steps.append(Step(COPY, dst, dst_off, a, a_off, n=nbytes))
            continue
        if k == _SEND:
            m = message_of_send[row]
            if node_of[peer] == node:  # to a participant of this node: staged
                staging[m] = reserve(nbytes)
                steps.append(Step(COPY, 0, staging[m], dst, dst_off, n=nbytes))
            else:
                steps.append(Step(SEND, 0, 0, dst, dst_off, node_of[peer], 0, nbytes, numbers[m]))
            continue
        m = message_of[row]
        remote = node_of[peer] != node
        if remote:
            landing[m] = reserve(nbytes)
        if k == _RECV:
            if remote:
                steps.append(Step(RECV, dst, dst_off, 0, 0, node_of[peer], landing[m], nbytes, numbers[m]))
            else:
                steps.append(Step(COPY, dst, dst_off, 0, staging[m], n=nbytes))
            continue
        # RECV_REDUCE: dst = src (op) message, then avg's division where final.
        if reduction is None:
            raise ScheduleError(f"{schedule.op} reduces but has no reduce op")
        a, a_off = where(rank, int(ops["src"][row]), int(ops["src_lo"][row]))
        if remote:
            steps.append(
                Step(RECV_COMBINE, dst, dst_off, a, a_off, node_of[peer], landing[m], elements, numbers[m])
            )
        else:
            steps.append(Step(COMBINE, dst, dst_off, a, a_off, 0, staging[m], elements))
        if avg and bool(ops["final"][row]):
            steps.append(Step(DIVIDE, dst, dst_off, n=elements))
    program.scratch = scratch
    return NodeProgram(program, tuple(others))


# The ops a small collective's star serves; gather and scatter ride the agreement too
# (small.py), and are armed as linear's schedule.
_REDUCING = frozenset({Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER})
STAR_OPS = frozenset({Collective.BROADCAST, Collective.ALLGATHER}) | _REDUCING


def star(
    op: Collective,
    count: int,
    root: int,
    node_of: tuple[int, ...],
    node: int,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    reduction: Reduction | None,
) -> NodeProgram | None:
    """Node ``node``'s program of a small collective as a star on the GO round, the
    native twin of its general path (collectives/small.py): each node folds its ranks'
    inputs into one part and sends it with its GO to node 0 (UP), which folds the parts in
    node order, finishes the result (avg's division) and sends it with its verdict (DOWN);
    every node then writes its ranks' outputs. Two messages per node a call, and nothing
    but the scratch written before the verdict. None where the op is not served."""
    nodes = max(node_of) + 1
    if op not in STAR_OPS or nodes > MAX_NODES or not pairs:
        return None
    itemsize = pairs[0][0].dtype.itemsize
    block = count * itemsize
    local = [r for r, n in enumerate(node_of) if n == node]
    ranks_of = [[r for r, n in enumerate(node_of) if n == m] for m in range(nodes)]

    def part_bytes(m: int) -> int:
        """What node ``m`` sends up."""
        if op is Collective.BROADCAST:
            return block if root in ranks_of[m] else 0
        if op is Collective.ALLGATHER:
            return block * len(ranks_of[m])
        return pairs[0][0].nbytes  # every node's inputs are alike (the agreement checked)

    result_bytes = (
        block * len(node_of) if op is Collective.ALLGATHER else max(part_bytes(m) for m in range(nodes))
    )
    program = Program(reduction, itemsize, 0)
    steps = program.steps
    scratch = 0

    def reserve(nbytes: int) -> int:
        nonlocal scratch
        at = scratch
        scratch += -(-nbytes // _ALIGN) * _ALIGN
        return at

    def inp(i: int) -> int:  # buffer numbers: program.py's
        return 1 + 2 * i

    def out(i: int) -> int:
        return 2 + 2 * i

    # This node's part, in the scratch (its ranks in rank order).
    part = reserve(part_bytes(node))
    if op is Collective.BROADCAST:
        if root in local:
            steps.append(Step(COPY, 0, part, inp(local.index(root)), 0, n=part_bytes(node)))
    elif op is Collective.ALLGATHER:
        for i in range(len(local)):
            steps.append(Step(COPY, 0, part + i * block, inp(i), 0, n=block))
    else:
        steps.append(Step(COPY, 0, part, inp(0), 0, n=part_bytes(node)))
        for i in range(1, len(local)):
            steps.append(Step(COMBINE, 0, part, 0, part, inp(i), 0, part_bytes(node) // itemsize))
    result = reserve(result_bytes)
    if node == 0:
        landing = {m: reserve(part_bytes(m)) for m in range(1, nodes)}
        for m in range(1, nodes):
            steps.append(Step(UP_RECV, 0, 0, b=m, b_off=landing[m], n=part_bytes(m)))
        where = {0: part, **landing}
        if op is Collective.BROADCAST:
            steps.append(Step(COPY, 0, result, 0, where[node_of[root]], n=result_bytes))
        elif op is Collective.ALLGATHER:  # each rank's block at its place
            for m in range(nodes):
                for j, rank in enumerate(ranks_of[m]):
                    steps.append(Step(COPY, 0, result + rank * block, 0, where[m] + j * block, n=block))
        else:
            elements = result_bytes // itemsize
            steps.append(Step(COPY, 0, result, 0, part, n=result_bytes))
            for m in range(1, nodes):
                steps.append(Step(COMBINE, 0, result, 0, result, 0, landing[m], elements))
            if reduction is not None and reduction.op is ReduceOp.AVG and reduction.participants > 1:
                steps.append(Step(DIVIDE, 0, result, n=elements))
        for m in range(1, nodes):
            wants = op is not Collective.REDUCE or root in ranks_of[m]
            steps.append(Step(DOWN_SEND, 0, 0, 0, result, m, 0, result_bytes if wants else 0))
    else:
        steps.append(Step(UP_SEND, 0, 0, 0, part, 0, 0, part_bytes(node)))
        wants = op is not Collective.REDUCE or root in local
        steps.append(Step(DOWN_RECV, 0, 0, b=0, b_off=result, n=result_bytes if wants else 0))
    # Every local rank's output from the result (small.py's write).
    for i, rank in enumerate(local):
        if op is Collective.REDUCE and rank != root:
            continue
        o = pairs[i][1]
        if op is Collective.REDUCE_SCATTER:  # its block
            steps.append(Step(COPY, out(i), 0, 0, result + rank * block, n=block))
        elif op is Collective.BROADCAST and rank == root and np.shares_memory(o, pairs[i][0]):
            continue  # in place, the root's buffer is the result already
        else:
            steps.append(Step(COPY, out(i), 0, 0, result, n=o.nbytes))
    program.scratch = scratch
    return NodeProgram(program, tuple(n for n in range(nodes) if n != node))
