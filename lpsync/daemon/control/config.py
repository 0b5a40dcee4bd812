"""Daemon configuration: flags > environment > TOML file > defaults.

Every setting has one name used in all three places: the flag ``--metrics-port``, the
variable ``LPSYNC_METRICS_PORT`` and the TOML key ``metrics_port`` (top level or
under ``[daemon]``).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lpsync.daemon.control.limits import MAX_TIMEOUT, Limits
from lpsync.daemon.peers.discovery import PeerSet, discover
from lpsync.errors import InvalidArgumentError
from lpsync.memory.devices import parse_devices
from lpsync.native import engine as native_engine
from lpsync.native import reason as native_reason
from lpsync.transport.backends import CHOICES as TRANSPORT_CHOICES
from lpsync.transport.backends import DEVICE_PATH_CHOICES
from lpsync.units import format_size
from lpsync_client import DEFAULT_SOCKET

NATIVE_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = DEFAULT_SOCKET  # Unix domain socket of the control plane (mode 0660)
    listen: str = ""  # HOST:PORT of an optional TCP listener; needs TLS and a token
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""  # the token clients send as "authorization: Bearer <token>"
    metrics_port: int = 0  # Prometheus exporter port; 0: off
    devices: str = "cpu:0"  # cpu | cuda:all | cuda:0,1 | emulated:N (lpsync.memory.devices)
    # Pinned host memory a multi-node device collective's boundary participant stages its
    # chunks through (collectives/hierarchy.py: a ring of 4 slots); nodes take the smallest.
    device_staging_bytes: int = 32 << 20
    timeout: float = 300.0  # default collective timeout (seconds) when a request has none
    # Request bounds (limits.py checks every request against them; docs/reliability.md).
    max_buffer_bytes: int = 1 << 34  # one Allocate/Register above this: RESOURCE_EXHAUSTED
    max_session_bytes: int = 1 << 35  # bytes one session may hold in buffers
    max_total_bytes: int = 1 << 36  # bytes all sessions of the daemon may hold together
    max_session_buffers: int = 1024  # buffers one session may hold
    max_world_size: int = 65536  # ranks of one job
    max_sessions: int = 1024  # sessions attached at once
    max_name_length: int = 256  # job and collective names (UTF-8 bytes)
    max_pending: int = 4096  # collectives of one job waiting for participants at once
    max_queued: int = 1024  # replies held for a Session stream whose client is not reading
    stream_grace: float = 30.0  # an attached session without a Session stream is dropped
    drain_seconds: float = 10.0  # SIGTERM waits this long for running collectives
    log_level: str = "INFO"
    workers: int = 4  # threads that run pipelined collectives off the gRPC event loop
    flight_recorder: int = 32  # finished collectives `lpsync status` keeps per job
    stall_seconds: float = 60.0  # a collective waiting this long logs who is missing
    trigger: bool = True  # offer the trigger socket <socket>.trigger (trigger.py)
    # The native steady-state path (lpsync/native): auto runs armed plans natively where
    # the engine is built; on refuses to start without it; off keeps every collective on
    # the Python path (the reference the tests compare against).
    native: str = "auto"
    # An inherited file descriptor whose end of file stops the daemon as SIGTERM does: the
    # launcher holds the write end (lpsync.daemon.launch), so its death stops the daemon.
    lifeline_fd: int = -1
    # Multi-node (peers/discovery.py, peers/plane.py). Exactly one peer source, or none (one node).
    node_rank: int = -1  # this daemon's index into the peer list; -1: derive it
    peers: str = ""  # every daemon's peer address H:P,... in node-rank order
    peers_dns: str = ""  # NAME:PORT: every address NAME resolves to
    peers_slurm: bool = False  # SLURM_JOB_NODELIST / SLURM_NODEID, on peer_port
    peer_port: int = 13337  # the peer port with --peers-slurm
    secret_file: str = ""  # the cluster secret; else LPSYNC_SECRET (never a flag value)
    heartbeat_interval: float = 1.0  # seconds between heartbeats to each peer
    heartbeat_timeout: float = 5.0  # a peer silent this long is declared gone
    # UCX_TLS of the UCX peer transport: auto lets UCX choose where the node has an RDMA
    # device, else tcp (lpsync.transport.backends.resolve_tls); "" lets UCX choose.
    ucx_tls: str = "auto"
    # The peer plane's transport: auto (UCX where an RDMA device exists, else TCP), ucx or
    # tcp (lpsync.transport.backends); every daemon of a cluster must end up on the same.
    peer_transport: str = "auto"
    # How device chunks cross the peer plane: auto (UCX's own when it is CUDA-aware, else
    # staged through pinned host memory), staged, or device (lpsync.transport.ucx.device_support).
    peer_device_path: str = "auto"
    # The agreement tree's fan-out (collectives/agreement.py): flat up to 8 nodes (2 hops),
    # then 8-nomial. On the 2-core emulated cluster binomial and flat cost the same (CPU
    # bound: the messages are the same 2(P-1)); where cores are plenty, fewer hops win. It
    # must be the same on every daemon: a node that waits on another parent hangs until
    # its timeout.
    agreement_radix: int = 8
    # The congestion control of the TCP peer transport's sockets (lpsync.transport.tcp.
    # congestion): auto asks for CUBIC, Linux's default, whatever the host's default is,
    # since BBR's ProbeRTT stalls a pipelined ring, and keeps the host's where this process
    # may not set it (a container without CAP_NET_ADMIN); "" keeps the host's.
    peer_tcp_congestion: str = "auto"

    def token(self) -> str:
        return Path(self.token_file).read_text().strip() if self.token_file else ""

    def validate(self) -> None:
        if self.listen and not (self.tls_cert and self.tls_key and self.token_file):
            raise InvalidArgumentError(
                "--listen needs --tls-cert, --tls-key and --token-file: the TCP listener "
                "never runs without TLS and a token"
            )
        parse_devices(self.devices)  # raises InvalidArgumentError naming what is wrong
        if not 0 < self.timeout <= MAX_TIMEOUT:
            raise InvalidArgumentError(f"timeout must be between 0 and {MAX_TIMEOUT:g} s, got {self.timeout}")
        self.limits().validate()
        if not 1 <= self.flight_recorder <= 100_000:
            raise InvalidArgumentError(
                f"flight_recorder must be 1..100000 collectives, got {self.flight_recorder}"
            )
        if not 0 < self.stall_seconds < float("inf"):
            raise InvalidArgumentError(
                f"stall_seconds must be a positive number of seconds, got {self.stall_seconds}"
            )
        if self.device_staging_bytes < 4096:
            raise InvalidArgumentError(
                f"device_staging_bytes must be at least 4096, got {self.device_staging_bytes}"
            )
        if self.lifeline_fd != -1:
            try:
                os.fstat(self.lifeline_fd)
            except OSError:
                raise InvalidArgumentError(
                    f"lifeline_fd {self.lifeline_fd} is not an open file descriptor of this process"
                ) from None
        if self.native not in NATIVE_CHOICES:
            raise InvalidArgumentError(
                f"native must be one of {', '.join(NATIVE_CHOICES)}, got {self.native!r}"
            )
        if self.native == "on" and native_engine() is None:
            raise InvalidArgumentError(f"--native on: {native_reason()}")
        if self.agreement_radix < 2:
            raise InvalidArgumentError(f"agreement_radix must be at least 2, got {self.agreement_radix}")
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise InvalidArgumentError("need 0 < heartbeat_interval < heartbeat_timeout")
        if self.peer_device_path not in DEVICE_PATH_CHOICES:
            raise InvalidArgumentError(
                f"peer_device_path must be one of {', '.join(DEVICE_PATH_CHOICES)}, "
                f"got {self.peer_device_path!r}"
            )
        if self.peer_transport not in TRANSPORT_CHOICES:
            raise InvalidArgumentError(
                f"peer_transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {self.peer_transport!r}"
            )

    def limits(self) -> Limits:
        return Limits(**{name: getattr(self, name) for name in Limits.__dataclass_fields__})

    def peer_set(self, environ: Mapping[str, str] | None = None) -> PeerSet | None:
        """Every daemon's peer address and this one's node rank; None: a single node."""
        return discover(
            self.peers,
            self.peers_dns,
            self.peers_slurm,
            self.node_rank,
            self.peer_port,
            os.environ if environ is None else environ,
        )


_FIELDS = {f.name: f for f in fields(DaemonConfig)}


def _coerce(name: str, value: object) -> object:
    kind = type(getattr(DaemonConfig, name))
    if kind is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise InvalidArgumentError(f"setting {name}: {value!r} is not a boolean")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"setting {name}: cannot read {value!r} as {kind.__name__}") from None


def load(
    flags: Mapping[str, object], environ: Mapping[str, str], config_file: str | None = None
) -> DaemonConfig:
    """Merge the sources; ``flags`` holds only the flags actually given (None = not given)."""
    values: dict[str, Any] = {}  # each coerced to its field's type (_coerce)
    if config_file:
        try:
            data = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise InvalidArgumentError(f"cannot read config {config_file}: {error}") from error
        table = {**{k: v for k, v in data.items() if not isinstance(v, dict)}, **data.get("daemon", {})}
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise InvalidArgumentError(f"{config_file}: unknown setting {key!r}")
            values[name] = _coerce(name, value)
    for name in _FIELDS:
        env = environ.get(f"LPSYNC_{name.upper()}")
        if env is not None and env != "":
            values[name] = _coerce(name, env)
    for name, value in flags.items():
        if name in _FIELDS and value is not None:
            values[name] = _coerce(name, value)
    config = DaemonConfig(**values)
    config.validate()
    return config


_LIMIT_FLAGS = (
    ("--max-world-size", "ranks of one job"),
    ("--max-sessions", "processes attached at once"),
    ("--max-buffer-bytes", "largest single buffer"),
    ("--max-session-bytes", "bytes one session may hold"),
    ("--max-total-bytes", "bytes all sessions together may hold"),
    ("--max-session-buffers", "buffers one session may hold"),
    ("--max-name-length", "UTF-8 bytes of a job or collective name"),
    ("--max-pending", "collectives of one job waiting for participants at once"),
    (
        "--max-queued",
        "replies held for a client that stops reading them; then the daemon stops reading its requests",
    ),
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The daemon's flags; defaults are None so that unset flags fall through to env/TOML."""
    add = parser.add_argument
    add("--config", help="TOML file (lowest precedence after defaults)")
    add("--socket", help=f"Unix socket path (env LPSYNC_SOCKET; default {DEFAULT_SOCKET})")
    add("--listen", help="HOST:PORT for a TCP listener (requires TLS and a token)")
    add("--tls-cert", help="PEM certificate chain for --listen")
    add("--tls-key", help="PEM private key for --listen")
    add("--token-file", help="file holding the bearer token clients must send")
    add("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    add(
        "--devices",
        help="cpu (host shared memory, default), cuda:all, cuda:0,1 (GPUs through "
        "cupy) or emulated:N[,slow=A-B+..][,host=A-B+..][,islands=K] "
        "(host-emulated devices for tests)",
    )
    add(
        "--device-staging-bytes",
        type=int,
        help="pinned host memory through which a multi-node collective on device buffers "
        "crosses to the peer plane, per node and job: a ring of 4 chunks "
        f"(default {DaemonConfig.device_staging_bytes})",
    )
    add(
        "--native",
        choices=NATIVE_CHOICES,
        help="the native steady-state path: a repeated single-node collective on host "
        "buffers up to 2 MiB (and a barrier) runs armed in compiled code, its clients "
        "ringing a shared-memory doorbell; auto (default): wherever the engine is built; "
        "on: refuse to start without it; off: every collective on the Python path",
    )
    add(
        "--timeout",
        type=float,
        help=f"default collective timeout in seconds (default {DaemonConfig.timeout:g})",
    )
    limits = parser.add_argument_group(
        "request limits",
        "Every request is checked against these before anything is sized "
        "from it; beyond them a call fails with INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming "
        "the field, the value and the limit (docs/reliability.md). Each is also LPSYNC_<NAME> "
        "in the environment and <name> in the TOML file (--max-sessions: LPSYNC_MAX_SESSIONS, "
        "max_sessions).",
    )
    for flag, what in _LIMIT_FLAGS:
        name = flag[2:].replace("-", "_")
        default = getattr(DaemonConfig, name)
        shown = format_size(default) if name.endswith("_bytes") else default
        limits.add_argument(flag, type=int, help=f"{what} (default {shown})")
    add("--log-level", help="DEBUG, INFO, WARNING, ERROR")
    add(
        "--flight-recorder",
        type=int,
        metavar="N",
        help=f"finished collectives `lpsync status` shows per job (default {DaemonConfig.flight_recorder})",
    )
    add(
        "--stall-seconds",
        type=float,
        metavar="S",
        help="warn (log and `lpsync status`) when a collective has waited S seconds for "
        f"missing ranks or nodes, before its timeout (default {DaemonConfig.stall_seconds:g})",
    )
    add(
        "--trigger",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="offer the trigger socket <socket>.trigger beside gRPC (default: on)",
    )
    add(
        "--node-rank",
        type=int,
        help="this daemon's index into the peer list (derived with --peers-dns/--peers-slurm)",
    )
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument(
        "--peers", help="every daemon's peer address H:P,... in node-rank order, this one's included"
    )
    peers.add_argument(
        "--peers-dns", help="NAME:PORT: the peers are every address NAME resolves to (a headless Service)"
    )
    peers.add_argument(
        "--peers-slurm",
        action="store_true",
        default=None,
        help="peers from SLURM_JOB_NODELIST, node rank from SLURM_NODEID",
    )
    add("--peer-port", type=int, help=f"peer port with --peers-slurm (default {DaemonConfig.peer_port})")
    add("--secret-file", help="file holding the cluster secret (else env LPSYNC_SECRET)")
    add(
        "--peer-transport",
        choices=TRANSPORT_CHOICES,
        help=f"the transport between daemons (default {DaemonConfig.peer_transport}): auto takes "
        "ucx where the node has an RDMA device (/sys/class/infiniband), else tcp (plain "
        "sockets, less CPU per message on Ethernet; docs/multinode.md). Every daemon of a "
        "cluster must end up on the same",
    )
    add(
        "--peer-device-path",
        choices=DEVICE_PATH_CHOICES,
        help=f"how device chunks cross the peer plane (default {DaemonConfig.peer_device_path}): "
        "auto stages chunks through pinned host memory (it will send device memory through "
        "UCX where UCX reports its cuda transports once that path has passed "
        "scripts/gpu_check.sh on a GPU; it has not yet); staged always stages; device sends "
        "device memory through UCX where UCX reports its cuda transports and refuses to "
        "start where UCX cannot (emulated devices allow it: their memory is host memory). "
        "`lpsync status` shows the choice and why",
    )
    add(
        "--heartbeat-timeout",
        type=float,
        help=f"seconds of silence before a peer daemon is declared gone "
        f"(default {DaemonConfig.heartbeat_timeout:g})",
    )
    add(
        "--heartbeat-interval",
        type=float,
        help=f"seconds between heartbeats to each peer (default {DaemonConfig.heartbeat_interval:g})",
    )
    add(
        "--ucx-tls",
        help=f"UCX_TLS of the UCX peer transport (default {DaemonConfig.ucx_tls!r}: UCX chooses where "
        "the node has an RDMA device, else tcp); empty lets UCX choose",
    )
    add(
        "--peer-tcp-congestion",
        help="TCP congestion control of the tcp peer transport's connections "
        f"(default {DaemonConfig.peer_tcp_congestion!r}: cubic where this process may set it, "
        "else the host's default; empty keeps the host's default; a name the host refuses "
        "stops the daemon). CUBIC whatever the host's default: under BBR a pipelined ring "
        "stalls in its ProbeRTT (docs/multinode.md)",
    )
    add(
        "--agreement-radix",
        type=int,
        help="fan-out of the cross-node agreement tree; the same on every daemon "
        f"(default {DaemonConfig.agreement_radix})",
    )
    add(
        "--lifeline-fd",
        type=int,
        help="an inherited file descriptor (a pipe's read end) whose end of file stops the "
        "daemon as SIGTERM does: a launcher holds the write end, so the daemon goes when the "
        "launcher does, however it ends (default: none)",
    )
    add(
        "--workers",
        type=int,
        help=f"threads that run pipelined collectives off the event loop (default {DaemonConfig.workers})",
    )
    add(
        "--drain-seconds",
        type=float,
        help=f"SIGTERM waits this long for running collectives (default {DaemonConfig.drain_seconds:g})",
    )
    add(
        "--stream-grace",
        type=float,
        help="seconds an attached session may go without its Session stream before it is dropped "
        f"(default {DaemonConfig.stream_grace:g})",
    )


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    flags = {name: getattr(args, name, None) for name in _FIELDS}
    return load(flags, os.environ if environ is None else environ, args.config)
