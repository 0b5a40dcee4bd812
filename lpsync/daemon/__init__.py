"""The lpsync daemon: gRPC control plane, sessions, matching, execution, metrics, config."""
