"""The KV cache on GPUs: the KV-transfer check between two devices, the hierarchical
cache's load-back.
"""
