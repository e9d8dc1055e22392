"""The memory planner: per-rank bytes of a layout from the shard rule, before anything loads."""
