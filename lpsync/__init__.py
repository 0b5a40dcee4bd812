"""lpsync: Linear Pipelining collectives behind a parameter-synchronization service."""

__version__ = "0.1.0"
