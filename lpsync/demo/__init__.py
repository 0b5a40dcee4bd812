"""``lpsync demo``: the main job. A local two-node cluster (two daemons joined over loopback,
a fresh secret), 4 trainers under torchrun training a CNN on scikit-learn's digits through
the DDP hook, the one-process equivalence check and the same job over DDP with gloo."""
