"""The peer plane over UCX (ucxx): an Endpoint per participant, authenticated connections."""

from lpsync.transport.ucx.endpoint import UcxEndpoint, UcxOptions

__all__ = ["UcxEndpoint", "UcxOptions"]
