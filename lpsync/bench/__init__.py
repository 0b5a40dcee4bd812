"""Benchmarks: set up, run, verify; figures are printed, never asserted in tests."""

# The collectives `lpsync bench` measures (locally and with --cluster). Here, not in a
# heavier module: the CLI's parser lists them at every start.
# sendrecv is point-to-point in a ring (send to the next rank, receive from the previous).
OPS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "reduce_scatter",
    "gather",
    "scatter",
    "alltoall",
    "sendrecv",
)
