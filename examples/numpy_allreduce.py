"""Data-parallel SGD on plain NumPy: the gradient lives in a shared-memory buffer the
daemon maps (zero copy), registered once and averaged in place every step.

    lpsync daemon --socket /tmp/lpsync.sock &
    LPSYNC_SOCKET=/tmp/lpsync.sock torchrun --nproc-per-node 2 examples/numpy_allreduce.py
    # or by hand: RANK=0 WORLD_SIZE=2 python examples/numpy_allreduce.py & RANK=1 ...
"""

import numpy as np

import lpsync_client

with lpsync_client.connect() as client:  # RANK, WORLD_SIZE, LPSYNC_SOCKET from the env
    rng = np.random.default_rng(client.rank)  # each rank its own data
    true_w = np.linspace(-1, 1, 16)
    w = np.zeros(16)
    grad = client.zeros(16, "float64")  # in shared memory: allocated once
    for step in range(300):
        x = rng.standard_normal((64, 16))
        error = x @ w - x @ true_w
        grad[:] = 2 * x.T @ error / len(x)
        client.allreduce(grad, op="avg")  # in place, every rank gets the mean
        w -= 0.05 * grad
        if client.rank == 0 and step % 100 == 99:
            print(f"step {step + 1}: loss {np.mean(error**2):.6f}", flush=True)
    check = w.copy()
    client.broadcast(check, root=0)  # staged: any array works, more slowly
    assert np.array_equal(check, w), "ranks diverged"
    if client.rank == 0:
        print(f"max |w - true w| = {np.abs(w - true_w).max():.2e}")
