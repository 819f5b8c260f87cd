"""Numerics helpers shared by the Triton kernels (imports triton: only kernel modules use it)."""
