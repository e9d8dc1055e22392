"""``dsv3serve bench kernels`` and the MoE tuner: kernels on DeepSeek-V3 shapes against the
GPU's ceilings.
"""
