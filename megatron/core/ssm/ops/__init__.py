"""Sequence-mixing scans of the SSM layers: eager PyTorch references (CPU, tests) and the optional Triton
kernels chosen by ``kernels.py``."""
