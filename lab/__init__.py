"""The lab: experiments and forensics beside the product, run from the repository's root as
``python -m lab.<name>`` (not part of the ``lpsync`` wheel).

What users run stays in ``lpsync``: ``lpsync bench`` (the nccl-tests-style harness,
lpsync/bench), ``lpsync chaos`` (lpsync/chaos), ``lpsync paper``. The lab imports only
public names of ``lpsync`` and ``lpsync_client``: no module or name with a leading
underscore, nothing of ``lpsync.daemon`` but its launcher (``lpsync.daemon.launch``), so
that it drives the daemon as a user's program would (tests/lab/unit/test_public_imports.py).

By job:
  sweeps beside the harness   executor (the in-process executor against numpy),
                              peer_plane (schedules over the UCX endpoint on an emulated
                              cluster), nccl (NCCL through torch.distributed, GPU)
  responsiveness, exits       responsive (health checks under a flood), exits (how fast
                              every daemon of an emulated cluster exits on SIGTERM)
  CPU forensics               loopback_cpu, leaf_floor, wake_floor, pass_through,
                              profile (py-spy on one daemon), daemon_ab (this tree's daemons
                              against another revision's)
  framework calls             torch_calls, ddp_step (ranks: their torchrun environment)
  device memory               staging_memory (host memory the staged device path takes)
"""
