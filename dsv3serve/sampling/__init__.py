"""The request vocabulary: sampling parameters, structured-output constraints, stop rules.

Torch-free; the engine and the router both import it, it imports neither.
"""
