"""Fixtures of the torch backend tests: real daemons (one, or two joined over UCX on
loopback) and real rank processes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    """Two daemons joined by the UCX peer plane (as tests/daemon/test_daemon_multinode.py
    starts them), shared by this folder's tests (each job has its own name, and a killed
    rank leaves the daemons serving); stopped at the end, each required to exit cleanly."""
    pytest.importorskip("ucxx")
    from tests.daemon.harness import PeeredDaemons

    cluster = PeeredDaemons(tmp_path_factory.mktemp("torch-two-nodes"), 2)
    try:
        yield cluster
    finally:
        unclean = cluster.stop()
        assert not unclean, "\n".join(unclean)
