"""Benchmarks: set up, run, verify; figures are printed, never asserted in tests."""
