"""``lpsync chaos``: a seeded run of faults against daemons and trainers on an emulated
cluster, every collective checked (docs/reliability.md, "Chaos").

  run.py      the schedule: inject one fault, hold it, release it, wait for the job to heal
  report.py   the record of what was injected and seen, the checks and the table
  nodes.py    daemons and trainers on the cluster's nodes, and the leak checks
  trainer.py  one trainer process (``python -m lpsync.chaos.trainer``)
"""
