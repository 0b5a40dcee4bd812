"""The backend's staging pool and work objects against one real daemon, in this process
(a one-rank group made directly, without torch.distributed's global state)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lpsync_client
from lpsync_client.torch._staging import StagingPool
from lpsync_client.torch.backend import ProcessGroupLpsync


@pytest.fixture
def client(daemon):
    c = lpsync_client.connect(daemon.socket, job="staging-test", rank=0, world_size=1)
    try:
        yield c
    finally:
        c.close()


def _opts(op=dist.ReduceOp.SUM) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


def test_a_reused_tensor_reuses_its_staging(client) -> None:
    pg = ProcessGroupLpsync(client, 0, 1, 30.0)
    t = torch.arange(1000, dtype=torch.float32)
    pg.allreduce([t], _opts()).wait()
    segments = len(client._segments)
    for _ in range(20):
        work = pg.allreduce([t], _opts(dist.ReduceOp.MAX))
        assert work.wait() is True
        assert work.is_completed() and work.is_success() and work.exception() is None
        assert work.get_future().value()[0] is t
    assert len(client._segments) == segments  # no registration per call
    torch.testing.assert_close(t, torch.arange(1000, dtype=torch.float32))


def test_free_staging_beyond_the_budget_goes_back_to_the_daemon(client) -> None:
    pool = StagingPool(client, budget=5000)
    arrays = [pool.acquire(2048) for _ in range(4)]
    assert len({a.__array_interface__["data"][0] for a in arrays}) == 4
    held = len(client._segments)
    for a in arrays:
        pool.release(a)
    assert len(client._segments) == held - 2  # 2 x 2048 fit the budget, 2 were released
    again = pool.acquire(2048)  # reused, most recently released first
    assert again is arrays[-1]
    assert len(client._segments) == held - 2


def test_a_shut_down_group_refuses_work(client) -> None:
    pg = ProcessGroupLpsync(client, 0, 1, 30.0)
    pg.shutdown()
    pg.shutdown()  # idempotent
    with pytest.raises(dist.DistBackendError, match="shut down"):
        pg.allreduce([torch.ones(3)], _opts())


def test_a_failed_collective_fails_wait_and_the_future(daemon) -> None:
    """The daemon refuses a collective (world of 2, the other rank never comes, 1 s
    timeout): wait() and get_future() both raise DistBackendError with its message."""
    c = lpsync_client.connect(daemon.socket, job="staging-timeout", rank=0, world_size=2)
    try:
        pg = ProcessGroupLpsync(c, 0, 2, 1.0)
        work = pg.allreduce([torch.ones(4)], _opts())
        with pytest.raises(dist.DistBackendError, match=r"rank\(s\) 1 did not arrive"):
            work.wait()
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), dist.DistBackendError)
        with pytest.raises(dist.DistBackendError, match="did not arrive"):
            work.get_future().value()
    finally:
        c.close()


def test_a_refused_submit_gives_the_staging_back(daemon) -> None:
    """The client is closed under the group (its daemon session ended): the call raises
    DistBackendError and its staging array is back in the pool, not lost."""
    c = lpsync_client.connect(daemon.socket, job="staging-closed", rank=0, world_size=1)
    pg = ProcessGroupLpsync(c, 0, 1, 30.0)
    t = torch.ones(256)
    pg.allreduce([t], _opts()).wait()  # the staging array is made, used and freed
    assert pg._pool._free_bytes == t.nbytes
    c.close()
    with pytest.raises(dist.DistBackendError, match="lpsync all_reduce failed"):
        pg.allreduce([t], _opts())
    assert pg._pool._free_bytes == t.nbytes


def _sync(opts):
    opts.asyncOp = False  # torch's synchronous call: it waits for the work at once
    return opts


def test_a_synchronous_op_is_answered_on_its_staging_by_the_engine(client) -> None:
    """A small synchronous all_reduce takes the quick path: the same staging buffer and
    operand every call (no registration, no view made per call), its work complete when
    returned, and from its second call the daemon's engine answers it (the doorbell)."""
    pg = ProcessGroupLpsync(client, 0, 1, 30.0)
    t = torch.arange(6, dtype=torch.float32)
    pg.allreduce([t], _sync(_opts())).wait()
    segments, (staged,) = len(client._segments), pg._pool._free.values()
    operand = pg._pool.views(staged, torch.float32)[1]
    (job,) = [j for j in client.status().jobs if j.job == client.job]
    before = job.native_answered
    for i in range(20):
        t.copy_(torch.arange(6, dtype=torch.float32) * i)
        work = pg.allreduce([t], _sync(_opts(dist.ReduceOp.MAX)))
        assert work.is_completed() and work.is_success() and work.exception() is None
        assert work.wait() is True and work.get_future().value()[0] is t
        torch.testing.assert_close(t, torch.arange(6, dtype=torch.float32) * i)  # one rank: itself
    assert len(client._segments) == segments  # no registration per call
    assert list(pg._pool._free.values()) == [staged] and pg._pool.views(staged, torch.float32)[1] is operand
    (job,) = [j for j in client.status().jobs if j.job == client.job]
    # The first calls of the MAX plan go the general way until a reply says it is armed.
    assert job.native_answered - before >= 18 and job.native_fallbacks == 0, job.path


def test_a_synchronous_op_over_the_buffer_limit_runs_in_pieces(tmp_path) -> None:
    """A daemon whose buffers are smaller than a synchronous op's staging refuses it: the
    quick path learns the limit and the op runs the general way, in pieces, correctly;
    lpsync's errors on the quick path are torch's (DistBackendError with the message)."""
    from lpsync_client.torch._pieces import buffer_limit
    from tests.daemon.harness import DaemonProcess

    daemon = DaemonProcess(tmp_path, "--max-buffer-bytes", "4096")
    c = lpsync_client.connect(daemon.socket, job="staging-limit", rank=0, world_size=1)
    try:
        pg = ProcessGroupLpsync(c, 0, 1, 30.0)
        t = torch.arange(3000, dtype=torch.float32)  # 12000 B of staging
        assert pg.allreduce([t], _sync(_opts())).wait() is True
        torch.testing.assert_close(t, torch.arange(3000, dtype=torch.float32))
        assert buffer_limit(c) == 4096
        small = torch.ones(4)
        pg.allreduce([small], _sync(_opts()))  # on the quick path: its staging is pooled
        free = pg._pool._free_bytes
        c.close()  # the session ends under the group
        with pytest.raises(dist.DistBackendError, match="lpsync all_reduce failed"):
            pg.allreduce([small], _sync(_opts()))
        assert pg._pool._free_bytes == free  # the staging is back, not lost
    finally:
        c.close()
        daemon.stop_and_check()
