"""The client <-> daemon contract held together: one error hierarchy (lpsync.errors
re-exports the client's classes and adds only its local ones), each class with a gRPC
code, and every code the daemon can answer comes back to a user as the typed exception
of the same name."""

from __future__ import annotations

import inspect

import grpc
import pytest

import lpsync.errors as daemon_errors
import lpsync_client
import lpsync_client.errors as client_errors
from lpsync.daemon.control import config
from lpsync.memory import emulated

# Raised by the CLI and the simulator on this machine, never answered over the wire.
_LOCAL_ONLY = {"ClusterError", "SimulationError", "ScheduleError", "ConfigError"}


def _classes(module) -> dict[str, type]:
    """The error classes a module offers by name (its own and those it re-exports)."""
    return {
        name: cls
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, client_errors.LpsyncError)
    }


def test_every_error_code_is_a_grpc_status_code() -> None:
    for name, cls in _classes(daemon_errors).items():
        assert cls.code in grpc.StatusCode.__members__, (name, cls.code)


def test_the_daemon_raises_the_clients_classes_written_once() -> None:
    ours, theirs = _classes(daemon_errors), _classes(client_errors)
    for name, cls in theirs.items():
        if name != "TimeoutError":  # the client's short alias of CollectiveTimeoutError
            assert ours[name] is cls, name
    local = {name: cls for name, cls in ours.items() if cls.__module__ == daemon_errors.__name__}
    assert set(local) == _LOCAL_ONLY
    assert all(issubclass(cls, client_errors.LpsyncError) for cls in local.values())
    assert set(daemon_errors.__all__) == set(ours)


# The root is abstract: the daemon never answers UNKNOWN (tests/daemon/test_fuzz_control.py).
@pytest.mark.parametrize("name", sorted(set(_classes(daemon_errors)) - _LOCAL_ONLY - {"LpsyncError"}))
def test_a_daemon_error_reaches_the_client_as_the_class_of_the_same_name(name: str) -> None:
    sent = _classes(daemon_errors)[name]
    got = client_errors.from_status(sent.code, "what happened", sent.__name__, "PARTIAL")
    assert type(got) is sent and str(got) == "what happened" and got.buffer_state == "PARTIAL"
    # Without the class name (a proxy dropped the trailers) the code alone picks the family.
    family = client_errors.from_status(sent.code, "what happened")
    assert isinstance(family, client_errors.LpsyncError) and family.code == sent.code


def test_the_wire_constants_have_one_definition() -> None:
    assert config.DEFAULT_SOCKET is lpsync_client.DEFAULT_SOCKET
    assert config.DaemonConfig().socket == lpsync_client.wire.DEFAULT_SOCKET
    assert emulated.HANDLE is lpsync_client.wire.EMULATED_HANDLE
    assert emulated.EVENT_HANDLE is lpsync_client.wire.EMULATED_EVENT_HANDLE
    assert emulated.MAGIC == lpsync_client.wire.EMULATED_MAGIC
