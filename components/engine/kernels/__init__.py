"""Triton kernels of the CUDA path; each names the torch form it replaces, which tests compare it
with."""
