"""Benchmark scripts (print a table, write JSON; never timed tests)."""
