"""rope kernels (one file per op family, backend as filename suffix)."""
