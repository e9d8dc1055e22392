"""The generation backends over worker replicas: PD orchestration (reserve on decode,
prefill, hand the KV over, stream, migrate) and the colocated baseline.
"""
