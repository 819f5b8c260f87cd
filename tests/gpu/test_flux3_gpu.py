"""FLUX.3 adapter on CUDA: accelerated Flux3Transformer2DModel bitwise equal to plain diffusers,
fast path engaged (every op verified, nothing fell back, kernels ran).

Models load as ``from_pretrained(torch_dtype=bf16)`` leaves them (QK norms fp32). Configs: the
tiny one, and FLUX.3 width (3072 = 24 x 128, SwiGLU 9216, 20480-wide text states) with one
per-mode block per mode and one joint block. Image token counts 1024² (4096) and an odd 336x208
(273); text lengths 512 and 77 (not a multiple of 64); batch 1 and 2; with and without a
reference image (its own mode blocks and rows in the joint blocks). The CUDA-graph path replays
bitwise too; the fp32-norm QK op is also checked alone against the live eager chain."""

import pytest
import torch

from ditfuse.kernels import reference
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import qk_fp32_rmsnorm_rope
from ditfuse.models import families
from ditfuse.models.flux3 import ADAPTER
from tests.support.engaged import compare_accelerated, compare_cuda_graph, handoff_counts_after

DEV = "cuda"
FLUX3 = families.get("flux3")


def _run(config, batch, size, layers=None, txt=512, cond=0):
    m = FLUX3.build(config, layers, device=DEV, load="pretrained")
    inp = FLUX3.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    if cond:
        from ditfuse.models import image_family_configs as ifc

        W, H = (int(v) for v in size.split("x"))
        kw = ifc.step_inputs("flux3", m, batch=batch, height=H, width=W, text_tokens=txt, dtype=torch.bfloat16,
                             cond_tokens=cond)
        inp = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    compare_accelerated(m, inp, ADAPTER.ops(), f"flux3 {config} B={batch} {size} txt={txt} cond={cond}")
    counts = handoff_counts_after(m, inp)  # the blocks hand off
    assert counts["discarded"] == 0 and (counts["links"] == 0 or counts["used"] > 0), counts


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,cond", [("64x48", 0), ("336x208", 0), ("64x48", 7)], ids=["small", "odd", "reference"])
def test_tiny(batch, size, cond):
    _run("tiny", batch, size, txt=37, cond=cond)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt,cond", [("1024x1024", 512, 0), ("336x208", 77, 0), ("512x512", 77, 256)],
                         ids=["1024px", "odd", "reference"])
def test_dev_width(batch, size, txt, cond):
    # two blocks of each kind: the cross-block hand-off (an op of ADAPTER.ops()) links them
    _run("dev", batch, size, layers=(2, 2), txt=txt, cond=cond)


@pytest.mark.parametrize("S", [1, 77, 4096 + 512])
@pytest.mark.parametrize("batch", [1, 2])
def test_qk_op_matches_eager_chain(S, batch):
    """The op alone against the eager chain (``norm(q.float())``, fp32 RoPE, ``.to(bf16)``) at
    FLUX.3's head shape, with NaN / Inf / zero rows."""
    g = torch.Generator(device=DEV).manual_seed(S)
    H, D = 24, 128
    q, k = (torch.randn(batch, S, H, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(2))
    q[0, 0, 0, 3] = float("nan")
    k[-1, -1, 1, :] = 0.0
    q[-1, S // 2, 2, 5] = float("inf")
    wq, wk = (1 + 0.2 * torch.randn(D, device=DEV, generator=g) for _ in range(2))
    ang = torch.arange(S, device=DEV)[:, None].double() * (1e-4 ** (torch.arange(0, D, 2, device=DEV).double() / D))
    cos, sin = (f(ang).float().repeat_interleave(2, dim=1) for f in (torch.cos, torch.sin))
    out = qk_fp32_rmsnorm_rope(q, k, wq, wk, cos, sin, 1e-6)
    exp = reference.qk_fp32_rmsnorm_rope(q, k, wq, wk, cos, sin, 1e-6)
    assert_bitwise_equal(out, exp, f"qk_fp32_rmsnorm_rope B={batch} S={S}")


def test_cuda_graph_replays_bitwise():
    m = FLUX3.build("dev", (1, 1), device=DEV, load="pretrained")
    inp = FLUX3.make_inputs(m, 1, "512x512", device=DEV, txt_tokens=512)
    inp2 = FLUX3.make_inputs(m, 1, "512x512", device=DEV, txt_tokens=512, seed=7)
    compare_cuda_graph(m, inp, inp2, "flux3")
