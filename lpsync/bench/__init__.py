"""``lpsync bench``: nccl-tests-style measurements of a daemon, optionally beside gloo.

Steps, as in nccl-tests: set up (daemon, N client processes, buffers), run (warm-up,
timed iterations, per rank), verify (#wrong after a final checked iteration), report
(the table, or JSON with the distributions). Benchmarks report; they never assert.
"""
