"""``dsv3serve bench serve``: load an OpenAI-compatible server with a workload, report
latencies and throughput.
"""
