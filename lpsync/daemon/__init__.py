"""The lpsync daemon, by role (docs/architecture.md, "The daemon"):

  control/      the control plane: the gRPC server and its thin servicer, the daemon's
                parts and shutdown (state), admission, Status, trigger socket,
                decoding, sessions, limits, config, metrics, logs
  collectives/  matching, the collective runner (conductor) and the stages a
                collective moves through
  peers/        the peer plane: discovery and the mesh of daemons
  values.py, watcher.py, device_registry.py: what every role stands on
  launch.py     start a daemon process, wait until it serves, read its status

Imports run downwards only: control -> collectives -> peers -> the shared modules.
"""
