"""Parallel layouts of one worker group: config, per-rank roles, shard rules, collectives."""
