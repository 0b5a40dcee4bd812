"""Peer authentication: mutual HMAC-SHA256 challenge-response over a shared cluster secret.

Run on every peer connection before any data moves. The dialling side is the
client, the accepting side the server; each proves it knows the secret without
sending it, over nonces both sides draw fresh for this connection:

    client -> server   HELLO      magic, version, client rank, nonce_c
    server -> client   CHALLENGE  magic, version, server rank, nonce_s,
                                  mac_s = HMAC(secret, "server" | transcript)
    client -> server   PROOF      mac_c = HMAC(secret, "client" | transcript)
    server -> client   VERDICT    1 accepted / 0 refused

The transcript is both nonces and both ranks, so a proof is bound to this
connection and these two identities; the role label keeps a proof from being
reflected back at its sender. Comparisons are constant time (hmac.compare_digest).
The server answers VERDICT so the client learns of a refusal before it sends data.
Authentication proves membership only: the peer plane is not encrypted.

Messages have fixed sizes, so any byte pipe can carry them: the state machines
below do no I/O; ``client_handshake``/``server_handshake`` drive them over blocking
send/recv callables (the UCX transport's stream messages, ``*_socket``'s TCP socket).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lpsync.errors import CollectiveTimeoutError, ConfigError, UnauthenticatedError, UnavailableError

log = logging.getLogger("lpsync.auth")

SECRET_ENV = "LPSYNC_SECRET"
MAGIC = b"LPSA"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
_HELLO = struct.Struct("!4sBI32s")
_CHALLENGE = struct.Struct("!4sBI32s32s")
HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
PROOF_SIZE = MAC_BYTES
VERDICT_SIZE = 1
_ACCEPT, _REFUSE = b"\x01", b"\x00"
_LABEL = b"lpsync peer auth v1 "


def load_secret(path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The cluster secret: the file at ``path`` if given, else $LPSYNC_SECRET.

    Never from the command line (it would show in ps and shell history). Surrounding
    whitespace (a trailing newline) is stripped. Raises ConfigError when the secret is
    missing, unreadable or empty.
    """
    if path is not None:
        file = Path(path)
        try:
            data = file.read_bytes().strip()
            mode = file.stat().st_mode
        except OSError as error:
            raise ConfigError(
                f"cannot read the cluster secret file {str(path)!r}: {error.strerror}"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("cluster secret file %s is readable by group or others; chmod 600 it", path)
        if not data:
            raise ConfigError(f"the cluster secret file {str(path)!r} is empty")
        return data
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV)
    if value is None:
        raise ConfigError(
            f"no cluster secret: pass --secret-file PATH or set {SECRET_ENV} (the same secret on every node)"
        )
    data = value.strip().encode()
    if not data:
        raise ConfigError(f"{SECRET_ENV} is set but empty")
    return data


def _mac(secret: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes, client: int, server: int) -> bytes:
    message = b"".join((_LABEL, role, nonce_c, nonce_s, struct.pack("!II", client, server)))
    return hmac.new(secret, message, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> None:
    if not secret:
        raise ConfigError("the cluster secret is empty")


@dataclass(frozen=True)
class AuthResult:
    peer_rank: int  # the rank the peer proved, bound into both MACs
    # A key both ends derive from this connection's transcript (never sent): the UCX
    # transport keys its per-connection message tags with it.
    session: bytes = field(default=b"", repr=False, compare=False)


class ClientHandshake:
    """The dialling side. hello() -> on_challenge() -> on_verdict()."""

    def __init__(self, secret: bytes, rank: int, expect_rank: int | None = None) -> None:
        _check_secret(secret)
        self._secret, self.rank, self.expect_rank = secret, rank, expect_rank
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._server_rank, self._server_nonce = -1, b""

    def hello(self) -> bytes:
        return _HELLO.pack(MAGIC, VERSION, self.rank, self._nonce)

    def on_challenge(self, message: bytes) -> bytes:
        """Check the server's proof; return ours. UnauthenticatedError if it is wrong."""
        if len(message) != CHALLENGE_SIZE:
            raise UnauthenticatedError("peer sent a malformed challenge")
        magic, version, server_rank, nonce_s, mac_s = _CHALLENGE.unpack(message)
        if magic != MAGIC or version != VERSION:
            raise UnauthenticatedError(f"peer speaks another protocol (magic {magic!r}, version {version})")
        if self.expect_rank is not None and server_rank != self.expect_rank:
            raise UnauthenticatedError(
                f"expected rank {self.expect_rank} at this address, the peer says it is rank {server_rank}"
            )
        want = _mac(self._secret, b"server", self._nonce, nonce_s, self.rank, server_rank)
        if not hmac.compare_digest(want, mac_s):
            raise UnauthenticatedError(
                f"peer rank {server_rank} failed to prove the cluster "
                "secret (a different secret on that node?)"
            )
        self._server_rank, self._server_nonce = server_rank, nonce_s
        return _mac(self._secret, b"client", self._nonce, nonce_s, self.rank, server_rank)

    def on_verdict(self, message: bytes) -> AuthResult:
        if message != _ACCEPT:
            raise UnauthenticatedError(
                f"peer rank {self._server_rank} refused rank {self.rank}: a different cluster "
                "secret, or it does not take this rank now (its log says which)"
            )
        return AuthResult(
            self._server_rank,
            _mac(self._secret, b"session", self._nonce, self._server_nonce, self.rank, self._server_rank),
        )


class ServerHandshake:
    """The accepting side. on_hello() -> on_proof()."""

    def __init__(self, secret: bytes, rank: int) -> None:
        _check_secret(secret)
        self._secret, self.rank = secret, rank
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._client_nonce = b""
        self.client_rank = -1

    def on_hello(self, message: bytes) -> bytes:
        if len(message) != HELLO_SIZE:
            raise UnauthenticatedError("peer sent a malformed hello")
        magic, version, client_rank, nonce_c = _HELLO.unpack(message)
        if magic != MAGIC or version != VERSION:
            raise UnauthenticatedError(f"peer speaks another protocol (magic {magic!r}, version {version})")
        self._client_nonce, self.client_rank = nonce_c, client_rank
        mac_s = _mac(self._secret, b"server", nonce_c, self._nonce, client_rank, self.rank)
        return _CHALLENGE.pack(MAGIC, VERSION, self.rank, self._nonce, mac_s)

    def on_proof(self, message: bytes) -> tuple[bytes, AuthResult | None]:
        """(the verdict to send, the result or None when refused)."""
        want = _mac(self._secret, b"client", self._client_nonce, self._nonce, self.client_rank, self.rank)
        if len(message) == PROOF_SIZE and hmac.compare_digest(want, message):
            session = _mac(
                self._secret, b"session", self._client_nonce, self._nonce, self.client_rank, self.rank
            )
            return _ACCEPT, AuthResult(self.client_rank, session)
        return _REFUSE, None


# A server's rule for which authenticated ranks it takes: None to admit, else the reason.
Admit = Callable[[int], "str | None"]


def _refuse_or_admit(
    verdict: bytes, result: AuthResult | None, client_rank: int, admit: Admit | None, where: str
) -> tuple[bytes, AuthResult | None]:
    if result is None:
        log.warning(
            "refused peer at %s claiming rank %d: wrong or missing cluster secret", where, client_rank
        )
        return verdict, None
    reason = admit(result.peer_rank) if admit is not None else None
    if reason is not None:
        log.warning("refused authenticated peer rank %d at %s: %s", result.peer_rank, where, reason)
        return _REFUSE, None
    return verdict, result


Send = Callable[[bytes], None]
Recv = Callable[[int], bytes]  # exactly that many bytes, or raise


def client_handshake(
    send: Send, recv: Recv, secret: bytes, rank: int, expect_rank: int | None = None
) -> AuthResult:
    """The dialling side over blocking ``send``/``recv`` (each bounded by the caller)."""
    hs = ClientHandshake(secret, rank, expect_rank)
    send(hs.hello())
    send(hs.on_challenge(recv(CHALLENGE_SIZE)))
    return hs.on_verdict(recv(VERDICT_SIZE))


def server_handshake(
    send: Send, recv: Recv, secret: bytes, rank: int, where: str = "?", admit: Admit | None = None
) -> AuthResult:
    """Authenticate a connecting peer; UnauthenticatedError (after logging) if it fails
    or ``admit`` turns its rank away."""
    hs = ServerHandshake(secret, rank)
    try:
        send(hs.on_hello(recv(HELLO_SIZE)))
        verdict, result = hs.on_proof(recv(PROOF_SIZE))
    except UnauthenticatedError as error:
        log.warning("refused peer at %s: %s", where, error)
        raise
    verdict, result = _refuse_or_admit(verdict, result, hs.client_rank, admit, where)
    send(verdict)
    if result is None:
        raise UnauthenticatedError(f"refused peer at {where} claiming rank {hs.client_rank}")
    return result


# Blocking sockets: the same exchange, every read bounded by the deadline.


def _recv_exact(
    sock: socket.socket, size: int, deadline: float, hangup: type[Exception] = UnauthenticatedError
) -> bytes:
    chunks, need = [], size
    while need:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeoutError("peer authentication timed out")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(need)
        except TimeoutError:
            raise CollectiveTimeoutError("peer authentication timed out") from None
        except OSError as error:
            raise UnavailableError(f"connection lost during authentication: {error}") from None
        if not chunk:
            raise hangup("peer closed the connection during authentication")
        chunks.append(chunk)
        need -= len(chunk)
    return b"".join(chunks)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise CollectiveTimeoutError("peer authentication timed out") from None
    except OSError as error:
        raise UnavailableError(f"connection lost during authentication: {error}") from None


def authenticate_client_socket(
    sock: socket.socket, secret: bytes, rank: int, timeout: float, expect_rank: int | None = None
) -> AuthResult:
    deadline = time.monotonic() + timeout
    # A server hanging up is no refusal (that comes as a verdict): a listener with no
    # mesh forming drops dials this way, and the dialling side retries.
    return client_handshake(
        lambda data: _send_all(sock, data, deadline),
        lambda size: _recv_exact(sock, size, deadline, UnavailableError),
        secret,
        rank,
        expect_rank,
    )


def authenticate_server_socket(
    sock: socket.socket, secret: bytes, rank: int, timeout: float, admit: Admit | None = None
) -> AuthResult:
    deadline = time.monotonic() + timeout
    return server_handshake(
        lambda data: _send_all(sock, data, deadline),
        lambda size: _recv_exact(sock, size, deadline),
        secret,
        rank,
        _peer_name(sock),
        admit,
    )


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except (OSError, ValueError):  # ValueError: a Unix socket's peer has no host:port
        return "?"
