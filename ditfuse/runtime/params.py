"""Sampling parameters shared by ``ditfuse generate`` and the HTTP server, with validation.

Every check raises :class:`ParamError` (a ``ValueError``) naming the parameter and what is allowed,
so the server can turn it into a 400 with ``param`` set and the CLI can print it as is.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..contracts.quality import Quality

MIN_SIDE = 16
MAX_SIDE = 2048
MAX_STEPS = 200
MAX_N = 8
MAX_PROMPT_CHARS = 4000
MAX_SEED = 2**63 - 1
OUTPUT_FORMATS = ("png", "jpeg", "webp")

_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


class ParamError(ValueError):
    """An invalid sampling parameter. ``param`` names it (as the HTTP API spells it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def parse_size(size: str, multiple: int = 16) -> tuple[int, int]:
    """``"WxH"`` -> (width, height), each a multiple of ``multiple`` within [MIN_SIDE, MAX_SIDE]."""
    if not isinstance(size, str):
        raise ParamError("size", f"size must be a string 'WIDTHxHEIGHT', got {size!r}")
    m = _SIZE_RE.match(size)
    if m is None:
        raise ParamError("size", f"size must look like '256x256' (WIDTHxHEIGHT), got {size!r}")
    w, h = int(m.group(1)), int(m.group(2))
    check_side("size", w, multiple)
    check_side("size", h, multiple)
    return w, h


def check_side(param: str, value: Any, multiple: int = 16) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(param, f"{param} must be an integer, got {value!r}")
    lo = max(MIN_SIDE, multiple)
    if value < lo or value > MAX_SIDE or value % multiple:
        raise ParamError(
            param,
            f"{param}: {value} is not allowed; width and height must be multiples of {multiple} "
            f"between {lo} and {MAX_SIDE}",
        )
    return value


def _check_int(param: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(param, f"{param} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ParamError(param, f"{param} must be between {lo} and {hi}, got {value}")
    return value


def _check_float(param: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(param, f"{param} must be a number, got {value!r}")
    v = float(value)
    if not (lo <= v <= hi):  # also rejects NaN
        raise ParamError(param, f"{param} must be between {lo} and {hi}, got {value}")
    return v


def applied_quality(close_sites: int | None) -> str | None:
    """The tier one batch ran, from how many sites ran their quality="high" (close) forward in it:
    "high" when any did; "lossless" when none did -- a lossless batch, or a high one on a model
    without close kernels or whose guards refused the tier (its output is then bitwise
    diffusers'); None when that was not recorded. The one rule behind every ``quality_applied``
    (images and videos responses, saved files' metadata, ``generate``'s summary)."""
    if close_sites is None:
        return None
    return "high" if close_sites > 0 else "lossless"


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. Build with :meth:`create` (validates); fields are final values.

    ``seed`` is the seed of image 0; image ``i`` of a request uses ``seed + i``, so an image is a
    function of (model, prompt, negative prompt, size, steps, guidance, quality, its seed) only.
    ``true_cfg_scale`` > 1 with a ``negative_prompt`` runs FLUX's true classifier-free guidance
    (two transformer passes per step); otherwise the negative prompt has no effect on FLUX.
    """

    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    n: int = 1
    quality: Quality = Quality.LOSSLESS
    negative_prompt: str | None = None
    true_cfg_scale: float = 1.0
    output_format: str = "png"
    # Video requests only (None for images): the clip's frame count; see resolve_num_frames.
    num_frames: int | None = None
    # Image-conditioned requests only (image-to-video, image editing): the input image, as a file
    # on this machine (runtime/inputs.py), and the SHA-256 of its RGB pixels. Where the pipeline
    # takes one image per call, requests share a batch only with equal fingerprints.
    image: str | None = None
    image_sha256: str | None = None
    # Wan 2.2 A14B: the low-noise expert's guidance scale (the call's guidance_scale_2); None: the
    # request named none, and guidance_scale goes to both experts.
    guidance_scale_2: float | None = None
    # First-last-frame-to-video: the image the clip ends on, as ``image`` / ``image_sha256`` are the
    # one it starts from. One last image conditions a whole call: requests share a batch only with
    # equal fingerprints.
    last_image: str | None = None
    last_image_sha256: str | None = None
    # Inpainting requests only (FLUX.1 Fill): the mask of ``image``, already in diffusers'
    # convention (white = repaint: inputs.mask_from_image), as a file, and the SHA-256 of its
    # pixels. It travels with the image: where the pipeline takes one image per call, requests share
    # a batch only with equal image and mask fingerprints.
    mask: str | None = None
    mask_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def create(
        cls,
        prompt: Any,
        *,
        size: str | None = None,
        width: int | None = None,
        height: int | None = None,
        num_inference_steps: int = 28,
        guidance_scale: float = 3.5,
        guidance_scale_2: float | None = None,
        seed: int | None = None,
        n: int = 1,
        quality: "str | Quality | None" = None,
        default_quality: "str | Quality" = Quality.LOSSLESS,
        negative_prompt: str | None = None,
        true_cfg_scale: float = 1.0,
        output_format: str = "png",
        default_size: tuple[int, int] = (1024, 1024),
        size_multiple: int = 16,
    ) -> "SamplingParams":
        if not isinstance(prompt, str) or not prompt.strip():
            raise ParamError("prompt", "prompt must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ParamError("prompt", f"prompt is longer than {MAX_PROMPT_CHARS} characters")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ParamError("negative_prompt", "negative_prompt must be a string")
        if negative_prompt is not None and len(negative_prompt) > MAX_PROMPT_CHARS:
            raise ParamError("negative_prompt", f"negative_prompt is longer than {MAX_PROMPT_CHARS} characters")
        if size is not None and (width is not None or height is not None):
            raise ParamError("size", "give either size or width/height, not both")
        if size is not None and size != "auto":
            w, h = parse_size(size, size_multiple)
        else:
            w = check_side("width", width, size_multiple) if width is not None else default_size[0]
            h = check_side("height", height, size_multiple) if height is not None else default_size[1]
        steps = _check_int("num_inference_steps", num_inference_steps, 1, MAX_STEPS)
        guidance = _check_float("guidance_scale", guidance_scale, 0.0, 100.0)
        guidance_2 = None if guidance_scale_2 is None else _check_float("guidance_scale_2", guidance_scale_2, 0.0, 100.0)
        tcfg = _check_float("true_cfg_scale", true_cfg_scale, 0.0, 100.0)
        count = _check_int("n", n, 1, MAX_N)
        if seed is None:
            seed = random.SystemRandom().randrange(0, 2**32)
        seed = _check_int("seed", seed, 0, MAX_SEED - MAX_N)
        try:
            q = Quality.parse(quality) if quality is not None else Quality.parse(default_quality)
        except ValueError as e:
            raise ParamError("quality", str(e)) from None
        fmt = str(output_format).lower()
        if fmt == "jpg":
            fmt = "jpeg"
        if fmt not in OUTPUT_FORMATS:
            raise ParamError("output_format", f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")
        return cls(
            prompt=prompt,
            width=w,
            height=h,
            num_inference_steps=steps,
            guidance_scale=guidance,
            guidance_scale_2=guidance_2,
            seed=seed,
            n=count,
            quality=q,
            negative_prompt=negative_prompt or None,
            true_cfg_scale=tcfg,
            output_format=fmt,
        )

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def uses_true_cfg(self) -> bool:
        return self.negative_prompt is not None and self.true_cfg_scale > 1.0

    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.n)]

    def signature(self, model: str, by_image: bool = True) -> tuple:
        """Requests with equal signatures can share a batch (one pipeline call). ``by_image``:
        the input image's and its mask's fingerprints are part of it (a pipeline whose call takes
        one image; ``PipelineSpec.batch_signature`` decides). The call takes one guidance_scale_2
        and one last image, so their values are always in it (None where a request names none)."""
        return (
            model,
            self.width,
            self.height,
            self.num_inference_steps,
            self.guidance_scale,
            self.quality.value,
            self.uses_true_cfg,
            self.true_cfg_scale if self.uses_true_cfg else 1.0,
            self.num_frames,
            self.image_sha256 if by_image else self.image_sha256 is not None,
            self.guidance_scale_2,
            self.last_image_sha256,
            self.mask_sha256 if by_image else self.mask_sha256 is not None,
        )

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def metadata(self, index: int = 0, model: str | None = None, close_sites: int | None = None) -> dict[str, str]:
        """Text metadata for image ``index`` of this request (PNG tEXt chunks, the video
        container's tags). ``quality`` is the tier asked for; ``quality_applied``
        (:func:`applied_quality` of the batch's ``close_sites``) what ran, when the caller knows."""
        meta = {
            "prompt": self.prompt,
            "size": self.size,
            "num_inference_steps": str(self.num_inference_steps),
            "guidance_scale": repr(self.guidance_scale),
            "seed": str(self.seed + index),
            "quality": self.quality.value,
        }
        applied = applied_quality(close_sites)
        if applied is not None:
            meta["quality_applied"] = applied
        if self.negative_prompt is not None:
            meta["negative_prompt"] = self.negative_prompt
            meta["true_cfg_scale"] = repr(self.true_cfg_scale)
        if self.num_frames is not None:
            meta["num_frames"] = str(self.num_frames)
        if self.image_sha256 is not None:
            meta["image_sha256"] = self.image_sha256
        if self.mask_sha256 is not None:
            meta["mask_sha256"] = self.mask_sha256
        if self.guidance_scale_2 is not None:
            meta["guidance_scale_2"] = repr(self.guidance_scale_2)
        if self.last_image_sha256 is not None:
            meta["last_image_sha256"] = self.last_image_sha256
        if model is not None:
            meta["model"] = model
        return meta

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quality"] = self.quality.value
        d.pop("extra")
        return d


# ---------------------------------------------------------------------------------------------
# Video: frame count from ``seconds`` or an explicit ``num_frames``.

# The most frames a clip may have (15 s at Wan's 16 fps).
MAX_FRAMES = 241


def _parse_number(param: str, value: Any) -> float:
    """A JSON number or a numeric string (form fields are strings), finite."""
    if isinstance(value, bool):
        raise ParamError(param, f"{param} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ParamError(param, f"{param} must be a number, got {value!r}") from None
    if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise ParamError(param, f"{param} must be a number, got {value!r}")
    return float(value)


def frames_for_seconds(seconds: float, fps: int, frame_multiple: int = 4) -> int:
    """The ``frame_multiple * k + 1`` frame count whose duration ``(frames - 1) / fps`` is nearest
    to ``seconds`` (ties round up). Wan (16 fps, k*4+1): 1 s -> 17 frames, 4 s -> 65, 5 s -> 81."""
    k = int(seconds * fps / frame_multiple + 0.5)
    return frame_multiple * k + 1


def seconds_for_frames(num_frames: int, fps: int) -> str:
    """A clip's duration as the API reports it: ``(num_frames - 1) / fps`` seconds, e.g. '4', '1.25'."""
    return f"{(num_frames - 1) / fps:g}"


def resolve_num_frames(
    *,
    seconds: Any = None,
    num_frames: Any = None,
    fps: int,
    frame_multiple: int = 4,
    default_frames: int,
    max_frames: int = MAX_FRAMES,
) -> int:
    """Validate ``seconds`` / ``num_frames`` into a frame count.

    ``num_frames`` (if given) must be ``frame_multiple * k + 1`` in ``[1, max_frames]``;
    ``seconds`` maps with :func:`frames_for_seconds` and must lie in
    ``[frame_multiple / fps, (max_frames - 1) / fps]``; given both, they must agree; given neither,
    ``default_frames``."""
    rule = f"{frame_multiple}k+1"
    frames = None
    if num_frames is not None:
        if isinstance(num_frames, str) and num_frames.strip().isdigit():
            num_frames = int(num_frames.strip())
        frames = _check_int("num_frames", num_frames, 1, max_frames)
        if (frames - 1) % frame_multiple:
            lo = (frames - 1) // frame_multiple * frame_multiple + 1
            raise ParamError(
                "num_frames",
                f"num_frames must be {rule} (the VAE packs {frame_multiple} frames into one latent frame), "
                f"got {frames}; nearest allowed: {lo} or {lo + frame_multiple}",
            )
    if seconds is not None:
        s = _parse_number("seconds", seconds)
        lo_s, hi_s = frame_multiple / fps, (max_frames - 1) / fps
        if not lo_s <= s <= hi_s:
            raise ParamError(
                "seconds",
                f"seconds must be between {lo_s:g} and {hi_s:g} ({fps} fps, at most {max_frames} frames), got {seconds!r}",
            )
        from_seconds = frames_for_seconds(s, fps, frame_multiple)
        if frames is not None and frames != from_seconds:
            raise ParamError(
                "num_frames",
                f"num_frames {frames} does not match seconds {seconds!r} ({from_seconds} frames at {fps} fps); "
                "give one of them",
            )
        frames = from_seconds
    return default_frames if frames is None else frames
