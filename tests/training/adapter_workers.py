"""What the adapter tests' rank processes run (spawned: importable by name)."""

from __future__ import annotations

import os

import numpy as np

import lpsync_client


def inputs(rank: int, grow: bool = False) -> dict[str, np.ndarray]:
    """Rank ``rank``'s leaves (numpy): several dtypes and shapes; ``grow`` adds a larger
    leaf (the fusion buffer must grow)."""
    g = np.random.default_rng(rank)
    leaves = {
        "a": g.standard_normal((3, 5)).astype(np.float32),
        "b": g.standard_normal(7).astype(np.float64),
        "c": g.integers(-50, 50, (2, 2, 2)).astype(np.int32),
        "d": g.standard_normal(4).astype(np.float32),
    }
    if grow:
        leaves["e"] = g.standard_normal(10_000).astype(np.float32)
    return leaves


def jax_ranks(rank: int, world: int, socket: str, job: str) -> list[dict[str, np.ndarray]]:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)  # the float64 leaf stays float64

    import lpsync_client.jax as lpj

    out = []
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=30) as client:
        for op, grow in (("sum", False), ("avg", True), ("max", False)):
            mine = inputs(rank, grow)
            tree = {
                "params": {k: jnp.asarray(v) for k, v in mine.items() if k != "d"},
                "extra": [jnp.asarray(mine["d"]), (jnp.asarray(mine["d"]) * 2,)],
            }
            if op == "avg":
                tree["params"].pop("c")  # the average of ints is not an int
            reduced = lpj.allreduce(tree, op, client=client)
            assert type(reduced) is dict and isinstance(reduced["extra"][1], tuple)
            out.append(
                {
                    "op": op,
                    **{k: np.asarray(v) for k, v in reduced["params"].items()},
                    "d": np.asarray(reduced["extra"][0]),
                    "d2": np.asarray(reduced["extra"][1][0]),
                }
            )
        lpj.set_default_client(client)
        mean = lpj.pmean({"x": jnp.full(3, float(rank))})
        out.append({"op": "pmean", "x": np.asarray(mean["x"])})
        lpj.set_default_client(None)
    return out


def cupy_ranks(rank: int, world: int, socket: str, job: str) -> list[np.ndarray]:
    import cupy

    import lpsync_client.cupy as lpc

    with lpsync_client.connect(socket, job=job, rank=rank, world_size=world, timeout=30) as client:
        mine = inputs(rank)
        tree = {k: cupy.asarray(v) for k, v in mine.items() if k != "c"}
        lpc.allreduce(tree, "sum", client=client)
        return [cupy.asnumpy(tree[k]) for k in sorted(tree)]
