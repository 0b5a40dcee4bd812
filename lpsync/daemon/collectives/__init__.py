"""A collective's path through the daemon: matched, agreed, planned, staged, run."""
