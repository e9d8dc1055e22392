"""dsv3serve: DeepSeek-V3/R1 serving runtime."""
