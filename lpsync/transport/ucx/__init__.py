"""The peer plane over UCX (ucxx): an Endpoint per participant, authenticated connections."""

from lpsync.transport.ucx.endpoint import UcxEndpoint, UcxOptions
from lpsync.transport.ucx.runtime import RuntimeOptions, UcxRuntime

__all__ = ["RuntimeOptions", "UcxEndpoint", "UcxOptions", "UcxRuntime"]
