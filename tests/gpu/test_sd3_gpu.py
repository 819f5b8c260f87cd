"""SD3 / SD3.5 adapter on CUDA: accelerated SD3Transformer2DModel bitwise equal to plain diffusers,
fast path engaged (every op verified, nothing fell back, kernels ran).

Configs: the tiny ones (SD3.5-like with a dual-attention block, SD3-like), SD3.5-large width (2432
= 38 x 64) and SD3.5-medium / SD3-medium width (1536; medium with dual attention) with 2 blocks
(the second is the context_pre_only last block). 1024² (4096 image tokens) and an odd 336x208
(273); text 333 (the pipeline's 77 + 256) and 77; batch 1 and 2 (CFG)."""

import pytest
import torch

from ditfuse.models import families
from ditfuse.models.sd3 import ADAPTER
from tests.support.engaged import compare_accelerated

DEV = "cuda"
SD3 = families.get("sd3")


def _sdpa_heads_first(m, inp) -> bool:
    """Whether SDPA writes the joint attention's output heads-first here (contiguous [B, H, S, D],
    as cuDNN and flash do for contiguous q): then the processor's transpose + reshape is a copy and
    the site runs layout.heads_to_tokens; a backend writing it token-major (memory-efficient
    attention) leaves eager's free view in place. Probed with this model's heads and dtype."""
    attn = m.transformer_blocks[0].attn
    heads, head_dim = attn.heads, attn.inner_dim // attn.heads
    lat = inp["hidden_states"]
    s = (lat.shape[-2] // 2) * (lat.shape[-1] // 2) + inp["encoder_hidden_states"].shape[1]
    q = torch.randn(lat.shape[0], heads, s, head_dim, device=DEV, dtype=lat.dtype)
    with torch.no_grad():
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    return o.stride(1) != head_dim * o.stride(3)


def _run(config, batch, size, layers=None, txt=333):
    m = SD3.build(config, layers, device=DEV)
    inp = SD3.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    ops = ADAPTER.ops()
    if not any(getattr(a, "norm_q", None) is not None for a in m.modules()):
        # SD3 (qk_norm None): sd3.attention runs only its q / k / v cats (layout.head_cat); SD3.5
        # configs must run rope.qk_rmsnorm_diffusers_cat verified, with no fallback, too
        ops = tuple(op for op in ops if op != "rope.qk_rmsnorm_diffusers_cat")
    if not _sdpa_heads_first(m, inp):
        ops = tuple(op for op in ops if op != "layout.heads_to_tokens")
    compare_accelerated(m, inp, ops, f"sd3 {config} B={batch} {size} txt={txt}")


@pytest.mark.parametrize("config", ["tiny", "tiny-sd3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny(config, batch):
    _run(config, batch, "64x48", txt=37)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("1024x1024", 333), ("336x208", 77)], ids=["1024px", "odd"])
def test_sd35_large_width(batch, size, txt):
    _run("dev", batch, size, layers=(2,), txt=txt)


@pytest.mark.parametrize("config", ["medium", "sd3-medium"])
@pytest.mark.parametrize("batch", [1, 2])
def test_medium_width(config, batch):
    _run(config, batch, "1024x1024", layers=(2,))
