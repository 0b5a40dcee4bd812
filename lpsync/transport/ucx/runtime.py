"""One process's UCX machinery: the progress thread (context, worker) and the listener.

A runtime outlives the endpoints made on it: a daemon keeps one for its whole life and
builds each generation of its peer mesh (a UcxEndpoint) on it, so rebuilding a mesh after
a peer is lost only makes connections — no new context, no listener rebound on the same
port, no UCX thread started or stopped while others run. Connections that arrive while no
endpoint is forming are closed at once; the dialling side retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lpsync.errors import UnavailableError
from lpsync.transport.ucx.progress import ProgressThread, keep_until_exit

log = logging.getLogger("lpsync.ucx")

# Measured on the emulated cluster (docs/multinode.md): TCP segments of 64 KiB out and
# 512 KiB in instead of UCX's 8 KiB/64 KiB cut the CPU per 375 KB message from ~300 us to
# ~150 us (a plain socket's cost); rendezvous by get_zcopy (the receiver pulls straight
# into its buffer) took LP broadcast on 8 nodes from 1.28-1.32x the wire limit to
# 1.20-1.21x, and ring allreduce on 2 nodes (both directions busy) from 2.09x to 1.07x.
_DEFAULT_CONFIG = (("TCP_TX_SEG_SIZE", "64k"), ("TCP_RX_SEG_SIZE", "512k"), ("RNDV_SCHEME", "get_zcopy"))

Acceptor = Callable[[Any], None]  # gets each accepted UCX endpoint, on the progress thread


@dataclass(frozen=True)
class RuntimeOptions:
    port: int  # the peer-plane port this process listens on
    tls: str | None = None  # UCX_TLS ("tcp" forces TCP); None: the environment / UCX default
    ucx_config: tuple[tuple[str, str], ...] = ()  # further UCX options, e.g. (("RNDV_THRESH", "64K"),)
    start_timeout: float = 30.0
    # A daemon's runtime: at close, the listener, worker and context are kept until the
    # process exits (progress.keep_until_exit) instead of destroyed while peers may dial.
    until_exit: bool = False


class UcxRuntime:
    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options
        # A daemon restarted after a crash must rebind its fixed port while old connections
        # sit in TIME_WAIT; ucxx exports UCX_MEMTYPE_CACHE, which this UCX no longer knows.
        config = {
            "TCP_CM_REUSEADDR": "y",
            "WARN_UNUSED_ENV_VARS": "n",
            **dict(_DEFAULT_CONFIG),
            **dict(options.ucx_config),
        }
        if options.tls is not None:
            config["TLS"] = options.tls
        self.progress = ProgressThread(config, f"lpsync-ucx:{options.port}", options.until_exit)
        self._lock = threading.Lock()
        self._acceptor: Acceptor | None = None
        self._listener: Any = None
        try:
            self._listener = self.progress.call(self._listen).result(options.start_timeout)
        except BaseException as error:
            self.progress.stop()
            if isinstance(error, self.progress.api.UCXError):
                raise UnavailableError(f"cannot listen on port {options.port}: {error}") from None
            raise

    def _listen(self) -> Any:
        return self.progress.api.UCXListener.create(
            self.progress.worker, self.options.port, self._on_connection, deliver_endpoint=True
        )

    def _on_connection(self, ep: Any, *_: Any) -> None:
        # On the progress thread. ep is a UCXEndpoint (error handling on) or None.
        with self._lock:
            acceptor = self._acceptor
        if ep is None:
            return
        if acceptor is None:
            log.debug("port %d: closed a connection: no mesh is forming", self.options.port)
            ep.close_blocking()
            return
        acceptor(ep)

    def set_acceptor(self, acceptor: Acceptor | None) -> None:
        """Route accepted connections to ``acceptor`` (the endpoint that is forming), or
        close them (None)."""
        with self._lock:
            if acceptor is not None and self._acceptor is not None:
                raise UnavailableError("another endpoint is already forming on this UCX runtime")
            self._acceptor = acceptor

    @property
    def alive(self) -> bool:
        return self.progress.alive

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening and stop the progress thread. Endpoints on it must be closed first."""
        if not self.progress.alive:
            return

        def unlisten() -> None:
            if self.options.until_exit:
                keep_until_exit(self._listener)
            self._listener = None

        # One deadline for both steps: a progress thread stuck inside a ucxx call would
        # otherwise cost the timeout twice.
        deadline = time.monotonic() + timeout
        try:
            self.progress.call(unlisten).result(timeout)
        except Exception as error:  # stopping anyway
            log.warning("port %d: closing the listener: %r", self.options.port, error)
        self.progress.stop(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> UcxRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
