"""``lpsync paper``: the evidence for each of the LP paper's research questions, measured
and simulated, written as one report (paper.md) with its figures.

One module per research question (rq1_scaling ... rq5_message_mix), each taking the run's
context and returning a Section; measure.py calls the project's own benchmarks (the
simulator, ``lpsync bench`` local and ``--cluster``, the model replay, the demo);
figures.py draws; report.py writes the markdown. Nothing here re-implements a
measurement: every number in the report comes from those tools, in this run.
"""
