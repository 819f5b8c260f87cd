"""Everything under tests/gpu is marked ``gpu`` (root conftest) and skipped without CUDA."""
