"""The control plane: what training processes talk to (gRPC, the trigger socket)."""
