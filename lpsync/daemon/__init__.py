"""The lpsync daemon, by role (docs/architecture.md, "The daemon"):

  control/      the control plane: gRPC server and handlers, trigger socket, decoding,
                sessions, limits, config, metrics, logs
  collectives/  matching and the stages a collective moves through
  peers/        the peer plane: discovery and the mesh of daemons
  values.py, watcher.py, device_registry.py: what every role stands on
  launch.py     start a daemon process, wait until it serves, read its status

Imports run downwards only: control -> collectives -> peers -> the shared modules.
"""
