"""The engine's own runs: one static batch, a sharded group against its roofline, the
host's per-step cost, greedy tokens against a reference.
"""
