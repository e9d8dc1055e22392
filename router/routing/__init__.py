"""Which replica (and DP rank) serves a request: the replica sets and policies, per-rank
reports, replica health.
"""
