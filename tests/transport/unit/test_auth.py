"""Peer authentication: the handshake over real TCP sockets, the client in its own
process; secrets from file and environment."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lpsync.errors import ConfigError, UnauthenticatedError
from lpsync.transport import auth

# fork: the client needs nothing but this module, and spawning costs seconds here.
FORK = multiprocessing.get_context("fork")
SECRET = b"the cluster secret"


def dial(port: int, secret: bytes, rank: int, queue: Any, garbage: bool = False) -> None:
    """Child process: connect and authenticate as ``rank``; report the outcome."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if garbage:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
            try:
                queue.put(("sent", sock.recv(1)))
            except OSError as error:  # the server hangs up: a reset is fine
                queue.put(("reset", str(error)))
            return
        try:
            result = auth.authenticate_client_socket(sock, secret, rank, timeout=5, expect_rank=0)
            queue.put(("ok", result.peer_rank))
        except UnauthenticatedError as error:
            queue.put(("refused", str(error)))


@contextmanager
def server(secret: bytes, admit: auth.Admit | None = None) -> Iterator[tuple[int, list[Any]]]:
    """A listener on loopback authenticating one connection at a time in a thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    outcomes: list[Any] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    outcomes.append(auth.authenticate_server_socket(conn, secret, 0, 5, admit))
                except Exception as error:
                    outcomes.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], outcomes
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        listener.close()
        thread.join(5)


def run_client(port: int, secret: bytes, rank: int = 1, garbage: bool = False) -> tuple[Any, ...]:
    queue = FORK.Queue()
    proc = FORK.Process(target=dial, args=(port, secret, rank, queue, garbage), daemon=True)
    proc.start()
    try:
        return queue.get(timeout=30)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_same_secret_authenticates_both_ways() -> None:
    with server(SECRET) as (port, outcomes):
        assert run_client(port, SECRET, rank=3) == ("ok", 0)
    assert outcomes[0] == auth.AuthResult(3)


def test_wrong_secret_is_refused_on_both_sides_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "lpsync.auth")
    with server(SECRET) as (port, outcomes):
        kind, message = run_client(port, b"a guess")
    assert kind == "refused" and "failed to prove" in message
    assert isinstance(outcomes[0], UnauthenticatedError)
    assert "refused peer" in caplog.text


def test_garbage_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "lpsync.auth")
    with server(SECRET) as (port, outcomes):
        run_client(port, SECRET, garbage=True)
    assert isinstance(outcomes[0], UnauthenticatedError)
    assert "another protocol" in caplog.text


def test_admit_hook_refuses_an_authenticated_rank(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "lpsync.auth")
    with server(SECRET, admit=lambda r: None if r == 1 else "not expected") as (port, _):
        kind, message = run_client(port, SECRET, rank=5)
    assert kind == "refused" and "refused rank 5" in message
    assert "not expected" in caplog.text


def test_proofs_are_bound_to_the_connection() -> None:
    """A recorded proof is useless on a new connection: the nonces differ."""
    c1, s1 = auth.ClientHandshake(SECRET, 1), auth.ServerHandshake(SECRET, 0)
    proof = c1.on_challenge(s1.on_hello(c1.hello()))
    assert s1.on_proof(proof)[1] == auth.AuthResult(1)
    s2 = auth.ServerHandshake(SECRET, 0)
    s2.on_hello(c1.hello())  # replay the old hello, then the old proof
    assert s2.on_proof(proof) == (b"\x00", None)


def test_reflected_server_proof_is_not_a_client_proof() -> None:
    client, srv = auth.ClientHandshake(SECRET, 1), auth.ServerHandshake(SECRET, 0)
    challenge = srv.on_hello(client.hello())
    server_mac = challenge[-auth.MAC_BYTES :]
    assert srv.on_proof(server_mac)[1] is None


def test_load_secret_from_file_and_env(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"s3cret\n")
    path.chmod(0o600)
    assert auth.load_secret(path, environ={}) == b"s3cret"
    assert auth.load_secret(None, environ={"LPSYNC_SECRET": "from env"}) == b"from env"
    # The file wins over the environment.
    assert auth.load_secret(path, environ={"LPSYNC_SECRET": "other"}) == b"s3cret"


def test_load_secret_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--secret-file PATH or set LPSYNC_SECRET"):
        auth.load_secret(None, environ={})
    with pytest.raises(ConfigError, match="empty"):
        auth.load_secret(None, environ={"LPSYNC_SECRET": "  "})
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(ConfigError, match="empty"):
        auth.load_secret(empty, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        auth.load_secret(tmp_path / "missing", environ={})
