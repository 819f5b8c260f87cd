"""bench_step's ``compile_regional`` provider: which blocks regional compilation compiles per family,
and that compiling and uncompiling them leaves the model computing what it computed before.

Dynamo runs with ``backend="eager"`` here (it traces the block and replays the captured graph with
aten; no C++ compiler on the CI machine): what is checked is the mechanism (the blocks' calls go
through the compiled wrapper, one compilation per block class, the output unchanged, uncompile
restores the plain call), not inductor's code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families

_spec = importlib.util.spec_from_file_location(
    "bench_step", Path(__file__).resolve().parents[2] / "bench" / "bench_step.py")
bench_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_step)

# family -> (layer counts of the tiny model, block classes regional compilation must pick)
EXPECTED = {
    "flux": ((2, 3), {"FluxTransformerBlock": 2, "FluxSingleTransformerBlock": 3}),
    "flux2": ((2, 3), {"Flux2TransformerBlock": 2, "Flux2SingleTransformerBlock": 3}),
    # per-mode blocks for each of the three token modes (text, image, reference image)
    "flux3": ((2, 3), {"Flux3ModeTransformerBlock": 6, "Flux3SingleTransformerBlock": 3}),
    "chroma": ((2, 3), {"ChromaTransformerBlock": 2, "ChromaSingleTransformerBlock": 3}),
    # SD3Transformer2DModel names no _repeated_blocks in diffusers 0.42.1: the ModuleList fallback
    "sd3": ((3,), {"JointTransformerBlock": 3}),
    "qwenimage": ((3,), {"QwenImageTransformerBlock": 3}),
    "wan": ((3,), {"WanTransformerBlock": 3}),
    # the noise and context refiners are ZImageTransformerBlocks too: 2 main + 2 x 1 refiner
    "zimage": ((2, 1), {"ZImageTransformerBlock": 4}),
    "ltx": ((3,), {"LTXVideoTransformerBlock": 3}),
    # HunyuanVideo's _repeated_blocks also names its patch embedding and its token refiner (one each)
    "hunyuanvideo": ((2, 3), {"HunyuanVideoTransformerBlock": 2, "HunyuanVideoSingleTransformerBlock": 3,
                              "HunyuanVideoPatchEmbed": 1, "HunyuanVideoTokenRefiner": 1}),
}


def _build(family: str, layers: tuple[int, ...]):
    fam = families.get(family)
    torch.manual_seed(0)
    m = fam.load_class()(**fam.config("tiny", layers))
    return m.to(torch.bfloat16).eval().requires_grad_(False)


def _inputs(family: str, m):
    size = "32x16x5" if family == "wan" else "64x48"
    return families.get(family).make_inputs(m, 1, size, device="cpu", dtype=torch.bfloat16, txt_tokens=7)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_repeated_blocks_per_family(family):
    layers, expected = EXPECTED[family]
    m = _build(family, layers)
    got: dict[str, int] = {}
    for b in bench_step.repeated_blocks(m):
        got[type(b).__name__] = got.get(type(b).__name__, 0) + 1
    assert got == expected, f"{family}: regional compilation would compile {got}, expected {expected}"


def test_no_repeated_blocks_is_an_error():
    with pytest.raises(ValueError, match="no repeated blocks"):
        bench_step.compile_regional(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_compile_regional_keeps_outputs_and_uncompiles(family):
    torch._dynamo.reset()
    m = _build(family, EXPECTED[family][0])
    inp = _inputs(family, m)
    with torch.no_grad():
        ref = m(**inp)[0]
    blocks = bench_step.compile_regional(m, backend="eager")
    try:
        assert all(b._compiled_call_impl is not None for b in blocks)
        with torch.no_grad():
            out = m(**inp)[0]
        assert_bitwise_equal(out, ref, name=f"{family} regional compile (backend=eager)")
    finally:
        bench_step.uncompile_regional(blocks)
        torch._dynamo.reset()
    assert all(b._compiled_call_impl is None for b in blocks)
    with torch.no_grad():
        again = m(**inp)[0]
    assert_bitwise_equal(again, ref, name=f"{family} after uncompile")


def test_regional_provider_is_listed_but_not_default():
    assert "compile_regional" in bench_step.PROVIDERS
    assert "compile_regional" not in bench_step.DEFAULT_PROVIDERS
    assert set(bench_step.COMPILED) <= set(bench_step.PROVIDERS)
