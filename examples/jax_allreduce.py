"""Data-parallel linear regression in JAX, gradients averaged through lpsync between
jitted steps.

    lpsync daemon --socket /tmp/lpsync.sock &
    LPSYNC_SOCKET=/tmp/lpsync.sock torchrun --nproc-per-node 2 examples/jax_allreduce.py
    # or by hand: RANK=0 WORLD_SIZE=2 python examples/jax_allreduce.py & RANK=1 ...
"""

import os

import jax
import jax.numpy as jnp

import lpsync_client.jax as lpj

rank = int(os.environ["RANK"])
true_w = jnp.arange(8, dtype=jnp.float32) / 8
params = {"w": jnp.zeros(8), "b": jnp.zeros(())}


@jax.jit
def grads_of(params, x, y):
    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    return jax.value_and_grad(loss)(params)


key = jax.random.PRNGKey(rank)  # each rank its own data
for step in range(300):
    key, sub = jax.random.split(key)
    x = jax.random.normal(sub, (64, 8))
    loss, grads = grads_of(params, x, x @ true_w + 0.5)
    grads = lpj.pmean(grads)  # outside jit: one fused allreduce per dtype
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    if rank == 0 and step % 100 == 99:
        print(f"step {step + 1}: loss {float(loss):.5f}", flush=True)

total = lpj.allreduce(params, op="sum")
same = jax.tree_util.tree_map(
    lambda s, p: bool(jnp.allclose(s, p * int(os.environ["WORLD_SIZE"]))), total, params
)
assert all(jax.tree_util.tree_leaves(same)), "ranks diverged"
if rank == 0:
    print(f"w = {params['w'].round(3)}, b = {float(params['b']):.3f}")
