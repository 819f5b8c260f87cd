"""Qwen-Image adapter on CUDA: accelerated QwenImageTransformer2DModel bitwise equal to plain
diffusers, fast path engaged (every op verified, nothing fell back, kernels ran) — the
attention's QK-chain op (``rope.qk_rmsnorm_diffusers_rope_complex``) included, once per block in
each of the two accelerated forwards.

Configs: the tiny one, and Qwen-Image width (3072 = 24 x 128, FF 12288, text width 3584) with 2
blocks. 1024² (4096 image tokens) and an odd 336x208 (273); text 512 and 77 (not multiples of
64; the prompt's real length in the pipeline); batch 1 and 2 (CFG)."""

import pytest

import ditfuse
from ditfuse.models import families
from ditfuse.models.qwenimage import ADAPTER, SITES
from tests.support.engaged import compare_accelerated

DEV = "cuda"
QWEN = families.get("qwenimage")
QK_OP = next(s for s in SITES if s.name == "qwenimage.attention").ops[0].op


def test_qk_op_is_one_of_the_adapter_ops():
    assert QK_OP == "rope.qk_rmsnorm_diffusers_rope_complex" and QK_OP in ADAPTER.ops()


def _run(config, batch, size, layers=None, txt=512):
    m = QWEN.build(config, layers, device=DEV)
    inp = QWEN.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    label = f"qwenimage {config} B={batch} {size} txt={txt}"
    compare_accelerated(m, inp, ADAPTER.ops(), label)  # verified, no fallback, kernel ran: every op
    # every block's attention ran the QK op in both accelerated forwards: one first-sight verify
    # per signature (all blocks share it), the kernel everywhere else
    calls = ditfuse.gate.report().calls.get(QK_OP, {})
    blocks = len(m.transformer_blocks)
    assert calls.get("verify", 0) == 1 and calls.get("kernel", 0) == 2 * blocks - 1, f"{label}: {dict(calls)}"


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["64x48", "336x208"])
def test_tiny(batch, size):
    _run("tiny", batch, size, txt=37)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("1024x1024", 512), ("336x208", 77)], ids=["1024px", "odd"])
def test_qwen_image_width(batch, size, txt):
    _run("dev", batch, size, layers=(2,), txt=txt)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("config", ["tiny", "dev"])
def test_edit_per_token_modulation(config, batch):
    """The Edit models' zero_cond_t: a 1024² target image followed by a 768x512 reference image
    (modulate_index 0 / 1 per token), text 77; every op engaged, bitwise."""
    import torch

    torch.manual_seed(0)
    with torch.device(DEV):
        m = QWEN.load_class()(**dict(QWEN.config(config, (2,) if config == "dev" else None), zero_cond_t=True))
    m = m.to(torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    (h1, w1), (h2, w2) = (64, 64), (48, 32)
    inp = dict(
        hidden_states=torch.randn(batch, h1 * w1 + h2 * w2, m.config.in_channels, generator=g).to(DEV, torch.bfloat16),
        encoder_hidden_states=torch.randn(batch, 77, m.config.joint_attention_dim, generator=g).to(DEV, torch.bfloat16),
        encoder_hidden_states_mask=None,
        timestep=torch.full((batch,), 0.7, device=DEV, dtype=torch.bfloat16),
        img_shapes=[[(1, h1, w1), (1, h2, w2)]] * batch,
        return_dict=False,
    )
    compare_accelerated(m, inp, ADAPTER.ops(), f"qwenimage edit {config} B={batch}")
