"""SamplingParams validation and the server's quality mapping (no model needed)."""

from __future__ import annotations

import pytest

from ditfuse.contracts.quality import Quality
from ditfuse.runtime.params import MAX_SIDE, ParamError, SamplingParams, parse_size
from ditfuse.runtime.server import ALLOWED_QUALITY, parse_quality


def make(**kw):
    kw.setdefault("seed", 0)
    return SamplingParams.create(kw.pop("prompt", "a cat"), **kw)


@pytest.mark.parametrize("size,expected", [("256x256", (256, 256)), ("64X32", (64, 32)), (" 512 x 1024 ", (512, 1024)), ("16x2048", (16, 2048))])
def test_size_parses_width_then_height(size, expected):
    assert parse_size(size) == expected
    p = make(size=size)
    assert (p.width, p.height) == expected
    assert p.size == f"{expected[0]}x{expected[1]}"


@pytest.mark.parametrize("size", ["65x64", "64x63", "0x64", "64x0", "4096x64", f"{MAX_SIDE + 16}x64", "64", "64x64x3", "axb", "-64x64", ""])
def test_bad_sizes_are_rejected_with_param_size(size):
    with pytest.raises(ParamError) as e:
        make(size=size)
    assert e.value.param == "size"
    assert str(e.value)


def test_size_multiple_follows_the_model():
    assert make(size="48x48", size_multiple=16).width == 48
    with pytest.raises(ParamError, match="multiples of 32"):
        make(size="48x48", size_multiple=32)


def test_width_height_and_defaults():
    p = make(width=32, height=96)
    assert (p.width, p.height) == (32, 96)
    p = make(default_size=(128, 64))
    assert (p.width, p.height) == (128, 64)
    assert make(size="auto", default_size=(64, 64)).size == "64x64"
    with pytest.raises(ParamError) as e:
        make(size="64x64", width=64)
    assert e.value.param == "size"
    with pytest.raises(ParamError) as e:
        make(width=33)
    assert e.value.param == "width"


@pytest.mark.parametrize("steps", [0, -1, 201, 2.5, "8", True])
def test_steps_out_of_range(steps):
    with pytest.raises(ParamError) as e:
        make(num_inference_steps=steps)
    assert e.value.param == "num_inference_steps"


@pytest.mark.parametrize("steps", [1, 200])
def test_steps_bounds_accepted(steps):
    assert make(num_inference_steps=steps).num_inference_steps == steps


@pytest.mark.parametrize("n", [0, 9, -3, 1.0])
def test_n_out_of_range(n):
    with pytest.raises(ParamError) as e:
        make(n=n)
    assert e.value.param == "n"


def test_quality_parsing_and_default():
    assert make().quality is Quality.LOSSLESS
    assert make(quality="HIGH").quality is Quality.HIGH
    assert make(default_quality="high").quality is Quality.HIGH
    assert make(quality="lossless", default_quality="high").quality is Quality.LOSSLESS
    with pytest.raises(ParamError) as e:
        make(quality="ultra")
    assert e.value.param == "quality"
    assert "lossless" in str(e.value) and "high" in str(e.value)


@pytest.mark.parametrize("bad", [dict(prompt=""), dict(prompt="   "), dict(prompt=None), dict(prompt="x" * 5000)])
def test_prompt_validation(bad):
    with pytest.raises(ParamError) as e:
        SamplingParams.create(bad["prompt"], seed=0)
    assert e.value.param == "prompt"


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(guidance_scale=float("nan")), "guidance_scale"),
        (dict(guidance_scale=-1), "guidance_scale"),
        (dict(guidance_scale="3"), "guidance_scale"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(output_format="gif"), "output_format"),
        (dict(negative_prompt=3), "negative_prompt"),
        (dict(true_cfg_scale=-2), "true_cfg_scale"),
    ],
)
def test_other_params_rejected(kw, param):
    with pytest.raises(ParamError) as e:
        make(**kw)
    assert e.value.param == param


def test_random_seed_when_none_and_per_image_seeds():
    p = SamplingParams.create("x", seed=None, n=3)
    assert 0 <= p.seed < 2**32
    assert p.seeds() == [p.seed, p.seed + 1, p.seed + 2]
    assert make(output_format="JPG").output_format == "jpeg"


def test_signature_groups_only_compatible_requests():
    a = make(size="64x64", num_inference_steps=2, seed=1, prompt="a")
    b = make(size="64x64", num_inference_steps=2, seed=99, prompt="b", n=3)
    assert a.signature("m") == b.signature("m")
    for other in (
        make(size="64x32", num_inference_steps=2),
        make(size="64x64", num_inference_steps=3),
        make(size="64x64", num_inference_steps=2, guidance_scale=5.0),
        make(size="64x64", num_inference_steps=2, quality="high"),
        make(size="64x64", num_inference_steps=2, negative_prompt="blur", true_cfg_scale=4.0),
    ):
        assert other.signature("m") != a.signature("m")
    assert a.signature("m") != a.signature("other-model")
    # a negative prompt without true CFG changes nothing for FLUX, so it does not split batches
    assert make(size="64x64", num_inference_steps=2, negative_prompt="blur").signature("m") == a.signature("m")


def test_metadata_names_every_sampling_parameter():
    p = make(size="64x32", num_inference_steps=3, seed=10, n=2, quality="high", negative_prompt="blur", true_cfg_scale=2.0)
    meta = p.metadata(1, model="tiny-flux")
    assert meta == {
        "prompt": "a cat",
        "size": "64x32",
        "num_inference_steps": "3",
        "guidance_scale": "3.5",
        "seed": "11",
        "quality": "high",
        "negative_prompt": "blur",
        "true_cfg_scale": "2.0",
        "model": "tiny-flux",
    }


@pytest.mark.parametrize(
    "value,default,expected",
    [
        (None, Quality.LOSSLESS, Quality.LOSSLESS),
        (None, Quality.HIGH, Quality.HIGH),
        ("auto", Quality.HIGH, Quality.HIGH),
        ("standard", Quality.LOSSLESS, Quality.LOSSLESS),
        ("standard", Quality.HIGH, Quality.HIGH),
        ("hd", Quality.LOSSLESS, Quality.HIGH),
        ("low", Quality.HIGH, Quality.LOSSLESS),
        ("medium", Quality.HIGH, Quality.LOSSLESS),
        ("high", Quality.LOSSLESS, Quality.HIGH),
        ("Lossless", Quality.HIGH, Quality.LOSSLESS),
    ],
)
def test_openai_quality_values(value, default, expected):
    assert parse_quality(value, default) is expected


@pytest.mark.parametrize("value", ["ultra", "", 3, "best"])
def test_unknown_quality_lists_allowed_values(value):
    with pytest.raises(ParamError) as e:
        parse_quality(value, Quality.LOSSLESS)
    assert e.value.param == "quality"
    for allowed in ALLOWED_QUALITY:
        assert allowed in str(e.value)
