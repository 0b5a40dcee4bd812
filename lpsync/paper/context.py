"""What one ``lpsync paper`` run needs everywhere: its options, where figures go, the
progress lines and the captions (what was run, where, when, the command line)."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIGURE_DIR = "paper"  # figures go to OUT/paper/, beside OUT/paper.md


@dataclass(frozen=True)
class PaperOptions:
    out: Path
    quick: bool  # simulation and local measurements only (no root)
    cluster: bool  # measure on the emulated cluster (root)
    nodes: tuple[int, ...]  # RQ1: node counts measured on the cluster
    link: str  # RQ2, RQ3: every node's NIC rate (tc's syntax)
    scaling_link: str  # RQ1's measured link (16 nodes on two cores need a slower one)
    scaling_bytes: int  # RQ1's measured message
    bandwidth_nodes: int  # RQ2, RQ3: nodes of the cluster
    sim_nodes: tuple[int, ...]  # RQ1: simulated participant counts
    sizes: tuple[int, ...]  # RQ2: message sizes
    models: tuple[str, ...]  # RQ3, RQ5
    procs: int  # local measurements: client processes
    epochs: int  # RQ4: epochs of the digits training
    demo_nodes: int  # RQ4: daemons ("nodes") of the training on this machine
    demo_per_node: int  # RQ4: trainers per daemon
    iters: int  # timed iterations per measured point
    transport: str  # the daemons' peer transport on the cluster
    command: str  # the command line, as the captions quote it


@dataclass(frozen=True)
class Figure:
    path: Path  # relative to the report's directory
    caption: str


@dataclass
class Section:
    key: str  # "RQ1"
    title: str
    question: str
    lines: list[str] = field(default_factory=list)  # markdown
    figures: list[Figure] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)  # where measurement and paper differ


def host() -> str:
    """This machine in a few words: name, cores, memory, OS, Python."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = f", {mem / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        memory = ""
    return (
        f"{socket.gethostname()} ({os.cpu_count()} cores{memory}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()})"
    )


class Run:
    """The run under way: options, start, step counter, figures written."""

    def __init__(self, options: PaperOptions, steps: int) -> None:
        self.options = options
        self.started = time.monotonic()
        self.when = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        self.host = host()
        self.steps = steps
        self.step = 0
        self.step_started = self.started
        self.durations: list[tuple[str, float]] = []
        self.figure_dir = options.out / FIGURE_DIR
        self.figure_dir.mkdir(parents=True, exist_ok=True)
        self.figure_count = 0
        self.results: dict[str, Any] = {}  # one section's measurements that another reads

    def begin(self, what: str) -> None:
        """One progress line per step, with the time so far."""
        self.end()
        self.step += 1
        self.step_started = time.monotonic()
        self.current = what
        progress(f"[{self.step}/{self.steps}] {what} ({self.elapsed():.0f} s so far)")

    def end(self) -> None:
        if self.step and len(self.durations) < self.step:
            self.durations.append((self.current, time.monotonic() - self.step_started))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def figure(self, name: str) -> tuple[Path, Path]:
        """(absolute path to write, path relative to the report) of figure ``name``.png."""
        self.figure_count += 1
        return self.figure_dir / f"{name}.png", Path(FIGURE_DIR) / f"{name}.png"

    def caption(self, number_what: str, where: str) -> str:
        """A figure's caption: what was run, where, when, and the command line."""
        return (
            f"{number_what} Where: {where}, on {self.host}. When: {self.when:%Y-%m-%d %H:%M} UTC. Command: "
            f"`{self.options.command}`."
        )

    def cluster_where(self, nodes: str, link: str) -> str:
        return (
            f"emulated cluster of {nodes} network namespaces, one tbf-shaped {link} full-duplex NIC per "
            f"node, one lpsync daemon per node (peer transport {self.options.transport}) and one client "
            f"rank per node"
        )


def progress(message: str) -> None:
    print(f"lpsync paper: {message}", file=sys.stderr, flush=True)
