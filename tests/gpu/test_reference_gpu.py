"""The reference chains equal the diffusers modules bitwise on CUDA too (same checks as the CPU
suite, tests/support/reference_checks.py), so the contract the kernels are held to is diffusers' own."""

import pytest
import torch

from tests.support import reference_checks as rc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("check", rc.ALL, ids=lambda f: f.__name__)
def test_reference_equals_diffusers_module_cuda(check, dtype):
    check("cuda", dtype)
