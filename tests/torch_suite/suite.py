"""PyTorch's own distributed test suite (``torch.testing._internal.distributed.
distributed_test.DistributedTest``), made runnable on the backend named by ``BACKEND``.

Imported by the worker (``tests.torch_suite.worker``) and again by every rank process the
suite spawns (``MultiProcessTestCase`` pickles ``TestDistBackendWithSpawn._run`` by
reference, so each rank imports this module): whatever must hold in a rank process is
done here at import, before torch's module is imported, because that module reads
``BACKEND``, ``WORLD_SIZE`` and ``INIT_METHOD`` and evaluates its skip decorators at import.

How ``lpsync`` is made acceptable to the suite, which knows gloo, nccl, ucc and mpi:

- ``import lpsync_client.torch`` registers the backend, so ``dist.Backend("lpsync")`` and
  ``init_process_group(backend="lpsync")`` work in every rank process;
- ``DistTestCases.backend_feature`` is torch's table of what each backend implements, with
  a ``"plugin"`` entry for third-party backends (``require_backend_is_available`` accepts a
  backend listed there). lpsync is added to ``plugin`` and to the features it implements
  (docs/training.md): ``ddp``, ``subgroup``, and ``gpu``/``cuda`` (CUDA tensors are staged
  through host memory). Nothing else of torch's module is changed.

Tests skipped only because a decorator names gloo (``require_backend_is_available({"gloo"})``,
``skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)``) are "lifted" by :func:`lift`:
the worker clears that skip and runs the same test body on lpsync. Which tests those are is
found by comparing the decorator skips under ``BACKEND=gloo`` and ``BACKEND=lpsync``
(:func:`decorator_skips`), not by matching reasons.
"""

from __future__ import annotations

import os

BACKEND = os.environ["BACKEND"]  # torch's module reads the same variable
START_METHOD = os.environ.get("TORCH_SUITE_START_METHOD", "spawn")
LPSYNC_FEATURES = ("plugin", "ddp", "subgroup", "gpu", "cuda")

if BACKEND == "lpsync":
    from torch.testing._internal.common_distributed import DistTestCases

    import lpsync_client.torch  # noqa: F401 - registers the backend "lpsync"

    for _feature in LPSYNC_FEATURES:
        DistTestCases.backend_feature[_feature].add("lpsync")

import torch  # noqa: E402
from torch.testing._internal.common_utils import FILE_SCHEMA  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402 - after the above
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's test/distributed/test_distributed_spawn.py: every test starts WORLD_SIZE rank
    processes that each init the process group on BACKEND (file:// rendezvous).

    TORCH_SUITE_START_METHOD: ``spawn`` (torch's own: each rank a fresh interpreter that
    imports torch and the suite, ~3.5 CPU-seconds a rank) or ``forkserver`` (each rank forked
    from a server that imported them once, when the worker's first test starts). A
    forked rank inherits the server's environment, not the test's: it finds the test's
    TEMP_DIR (the suite's file barrier) and INIT_METHOD from its store file, which setUp
    puts inside TEMP_DIR."""

    def setUp(self) -> None:
        super().setUp()
        if START_METHOD == "forkserver":
            os.unlink(self.file_name)
            self.file_name = os.path.join(os.environ["TEMP_DIR"], "init_dir", "store")
            ctx = torch.multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            self._start_processes(ctx.Process)
        else:
            self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):  # type: ignore[override]
        if START_METHOD == "forkserver":
            # What a spawned rank would have read from the test's environment: TEMP_DIR and
            # INIT_METHOD (the second as torch's module constant too: the barrier-timeout
            # test re-initializes the default group with it).
            temp_dir = os.path.dirname(os.path.dirname(file_name))
            init = FILE_SCHEMA + os.path.join(temp_dir, "init_dir", "shared_init_file")
            os.environ["TEMP_DIR"], os.environ["INIT_METHOD"] = temp_dir, init
            distributed_test.INIT_METHOD = init
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def test_names() -> list[str]:
    """Every test of the suite, in the order torch's file defines them."""
    names = [n for n in vars(DistributedTest._DistTestBase) if n.startswith("test_")]
    return [n for n in names if callable(getattr(TestDistBackendWithSpawn, n))]


def decorator_skips() -> dict[str, str]:
    """The tests a skip decorator skips under this BACKEND and WORLD_SIZE, with the reason
    (decided at import: the parent skips them without spawning any rank)."""
    skips = {}
    for name in test_names():
        fn = getattr(TestDistBackendWithSpawn, name)
        if getattr(fn, "__unittest_skip__", False):
            skips[name] = str(getattr(fn, "__unittest_skip_why__", ""))
    return skips


def lift(names: list[str]) -> None:
    """Clear the decorator skip of ``names`` in this process (the parent: rank processes run
    a test's body without looking at it), so the same body runs."""
    for name in names:
        fn = getattr(TestDistBackendWithSpawn, name)
        fn.__unittest_skip__ = False
