"""Transport backends behind lpsync.engine.endpoint.Endpoint: inproc (tests, one process)."""
