"""The torch adapter's edges in one process (world size 1) on a real daemon: what a
single rank can show without peers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lpsync_client
import lpsync_client.torch as lpt
from tests.daemon.harness import DaemonProcess


@pytest.fixture
def client(daemon: DaemonProcess):
    with lpsync_client.connect(daemon.socket, job="single", rank=0, world_size=1, timeout=20) as c:
        yield c


def test_unused_parameter_and_buckets(client: lpsync_client.Client) -> None:
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 3), nn.Linear(4, 3)
    params = [*used.named_parameters(prefix="used"), *unused.named_parameters(prefix="unused")]
    opt = lpt.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.1), params, bucket_bytes=40, client=client
    )
    assert isinstance(opt, torch.optim.SGD) and len(opt._lpsync_buckets) == 4
    before = used.weight.detach().clone()
    used(torch.ones(2, 4)).sum().backward()
    expected = used.weight.grad.clone()
    opt.step()
    # world size 1: the average is the gradient itself; the unused layer got zeros
    torch.testing.assert_close(used.weight.grad, expected)
    torch.testing.assert_close(used.weight.detach(), before - 0.1 * expected)
    assert unused.weight.grad is not None and not unused.weight.grad.any()
    opt.zero_grad()
    used(torch.ones(2, 4)).sum().backward()  # a second step reuses the buffers
    opt.step()


def test_two_backwards_before_step_are_refused(client: lpsync_client.Client) -> None:
    layer = nn.Linear(4, 3)
    opt = lpt.DistributedOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1), layer.named_parameters(), client=client
    )
    layer(torch.ones(1, 4)).sum().backward()
    with pytest.raises(lpsync_client.InvalidArgumentError, match="accumulated twice"):
        layer(torch.ones(1, 4)).sum().backward()
    opt.synchronize()  # the first backward's buckets still complete


def test_ops_on_odd_tensors(client: lpsync_client.Client) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    y = lpt.allreduce(x, op="sum", client=client)
    torch.testing.assert_close(y, x)
    assert y.data_ptr() != x.data_ptr()
    flags = torch.tensor([True, False, True])
    assert lpt.broadcast(flags, root=0, client=client) is flags
    w = torch.ones(3, requires_grad=True)
    lpt.broadcast_parameters([w], client=client)
    with pytest.raises(lpsync_client.InvalidArgumentError):
        lpt.broadcast_parameters(42, client=client)
