"""The peer plane: which daemons form the cluster, and the mesh between them."""
