"""Transport backends behind lpsync.engine.transport.Endpoint: inproc (tests, one process)."""
