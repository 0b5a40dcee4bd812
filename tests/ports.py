"""Ports for test listeners: lpsync.transport.ports, importable by name from the tests."""

from lpsync.transport.ports import free_ports

__all__ = ["free_ports"]
