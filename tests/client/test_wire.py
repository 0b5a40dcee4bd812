"""The client <-> daemon contract held together: the two error hierarchies (the daemon's
lpsync.errors and the client's lpsync_client.errors) name the same classes with the same
gRPC codes, and every code the daemon can answer comes back to a user as the typed
exception of the same name."""

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
    return {
        name: cls
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, module.LpsyncError) and cls.__module__ == module.__name__
    }


def test_every_daemon_error_code_is_a_grpc_status_code() -> None:
    for name, cls in _classes(daemon_errors).items():
        assert cls.code in grpc.StatusCode.__members__, (name, cls.code)


# The root is abstract: the daemon never answers UNKNOWN (tests/daemon/test_fuzz_control.py).
@pytest.mark.parametrize("name", sorted(set(_classes(daemon_errors)) - _LOCAL_ONLY - {"LpsyncError"}))
def test_a_daemon_error_reaches_the_client_as_the_class_of_the_same_name(name: str) -> None:
    sent = _classes(daemon_errors)[name]
    theirs = _classes(client_errors).get(name)
    assert theirs is not None, f"lpsync_client.errors has no {name} (the daemon answers it)"
    assert theirs.code == sent.code, (name, sent.code, theirs.code)
    got = client_errors.from_status(sent.code, "what happened", sent.__name__, "PARTIAL")
    assert type(got) is theirs and str(got) == "what happened" and got.buffer_state == "PARTIAL"
    # Without the class name (a proxy dropped the trailers) the code alone picks the family.
    family = client_errors.from_status(sent.code, "what happened")
    assert isinstance(family, client_errors.LpsyncError) and family.code == sent.code


def test_the_client_offers_no_error_the_daemon_never_sends() -> None:
    extra = set(_classes(client_errors)) - set(_classes(daemon_errors))
    assert extra <= {"TimeoutError"}, extra  # TimeoutError: the short alias users expect


def test_the_wire_constants_have_one_definition() -> None:
    assert config.DEFAULT_SOCKET is lpsync_client.DEFAULT_SOCKET
    assert config.DaemonConfig().socket == lpsync_client.wire.DEFAULT_SOCKET
    assert emulated.HANDLE is lpsync_client.wire.EMULATED_HANDLE
    assert emulated.EVENT_HANDLE is lpsync_client.wire.EMULATED_EVENT_HANDLE
    assert emulated.MAGIC == lpsync_client.wire.EMULATED_MAGIC
