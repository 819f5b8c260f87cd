"""Input images of image-to-video requests: decode and check what a request sends, fingerprint the
pixels, keep them on disk for the job, and the clip size an image implies (for a pipeline that
derives its size from the image, the size it will make, and which named sizes it can make).

A request's image travels as a path plus the SHA-256 of its decoded RGB pixels
(``SamplingParams.image`` / ``image_sha256``): worker processes and a restarted server read the
same file, and requests share a batch only when their fingerprints are equal (the pipelines
condition one call on one image). :func:`open_image` re-checks the fingerprint, so a file that
changed on disk fails its batch instead of silently conditioning on other pixels.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from pathlib import Path
from typing import Any

from .params import MAX_SIDE, MIN_SIDE, ParamError

# An upload larger than this is refused before it is decoded.
MAX_INPUT_BYTES = 32 * 1024 * 1024
# Decoded images above this many pixels are refused (PIL's own bomb check warns at ~89 MP).
MAX_INPUT_PIXELS = 4096 * 4096


def decode_image(data: bytes, param: str = "input_reference") -> Any:
    """``data`` (PNG, JPEG, WebP, ... anything PIL reads) as an RGB PIL image; an animated file
    gives its first frame, an alpha channel is dropped (the pipelines take RGB). ParamError on
    ``param`` for an empty, oversized or undecodable upload."""
    return _decode(data, param).convert("RGB")


def decode_mask(data: bytes, param: str = "mask") -> Any:
    """An uploaded inpainting mask as the pipeline takes it: :func:`decode_image`'s checks, then
    :func:`mask_from_image`."""
    return mask_from_image(_decode(data, param), param)


def mask_from_image(image: Any, param: str = "mask") -> Any:
    """An inpainting mask in diffusers' convention (a grayscale "L" image, white = repaint, black =
    keep: FluxFillPipeline's ``mask_image``) from a mask as a user sends it:

    - an image with an alpha channel (RGBA, LA, a palette or colour key with transparency) follows
      OpenAI's ``images.edit``: its fully transparent pixels (alpha == 0) are the ones to edit.
      They become 255, every other pixel 0, whatever its colour.
    - an image without one (black and white, grayscale, RGB) is taken as diffusers takes it:
      converted to grayscale as it is; the pipeline binarizes it at half intensity after resizing
      it (white = repaint).

    ParamError on ``param`` for a mask that marks nothing to repaint (no pixel with alpha 0, or no
    pixel at half intensity or above): the pipeline would only redraw the image, and an opaque
    black-and-white mask saved with an alpha channel, the usual mix-up of the two conventions,
    would otherwise pass unnoticed."""
    if image.has_transparency_data:
        alpha = image.convert("RGBA").getchannel("A")
        mask = alpha.point(lambda a: 255 if a == 0 else 0)
        if mask.getextrema()[1] == 0:
            raise ParamError(param, f"{param} marks nothing to edit: it has an alpha channel, and no pixel is fully "
                                    "transparent (alpha 0), which is where an image is edited (OpenAI's convention); "
                                    "a mask without an alpha channel edits where it is white")
        return mask
    mask = image.convert("L")
    if mask.getextrema()[1] < 128:
        raise ParamError(param, f"{param} marks nothing to edit: it has no alpha channel, and no pixel is white (at "
                                "half intensity or above), which is where such a mask is repainted (diffusers' "
                                "convention); with an alpha channel, fully transparent pixels are edited")
    return mask


def check_mask_size(mask: Any, image: Any, param: str = "mask") -> None:
    """ParamError unless ``mask`` has ``image``'s size (OpenAI: "the same dimensions as image")."""
    if mask.size != image.size:
        raise ParamError(param, f"{param} is {mask.width}x{mask.height} pixels; it must be the size of the image "
                                f"({image.width}x{image.height})")


def _decode(data: bytes, param: str) -> Any:
    """``data`` as a loaded PIL image in its own mode (see :func:`decode_image`)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ParamError(param, f"{param} is empty")
    if len(data) > MAX_INPUT_BYTES:
        raise ParamError(param, f"{param} is {len(data)} bytes; at most {MAX_INPUT_BYTES} are accepted")
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > MAX_INPUT_PIXELS:
                raise ParamError(param, f"{param} is {w}x{h} pixels; at most {MAX_INPUT_PIXELS} pixels are accepted")
            im.load()
            # a copy detached from the file (the animated formats' frame 0, whatever PIL keeps open)
            return im.copy()
    except ParamError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ParamError(param, f"{param} is not an image PIL can read: {e}") from None


def data_url_bytes(url: Any, param: str = "input_reference") -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL. This server fetches nothing: an http(s)
    URL is a ParamError that says to upload the file or send a data URL."""
    if not isinstance(url, str) or not url.strip():
        raise ParamError(param, f"{param}.image_url must be a non-empty string")
    url = url.strip()
    if url.lower().startswith(("http://", "https://")):
        raise ParamError(param, f"{param}.image_url: this server does not fetch URLs; upload the image as a file "
                                "or send it as a base64 data URL (data:image/png;base64,...)")
    head, sep, payload = url.partition(",")
    if not (sep and head.lower().startswith("data:") and head.lower().endswith(";base64")):
        raise ParamError(param, f"{param}.image_url must be a base64 data URL (data:image/png;base64,...), "
                                f"got {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ParamError(param, f"{param}.image_url is not valid base64: {e}") from None


def pixel_sha256(image: Any) -> str:
    """SHA-256 of an RGB image's size and pixels (not of its file: the same picture saved as PNG
    or WebP, or by another encoder, has one fingerprint)."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def save_png(image: Any, path: Path) -> None:
    """Write ``image`` as PNG at ``path`` with video_io.atomic_write (a ``.tmp-*`` file, fsynced
    and renamed: a reader never sees half a file, and a queued job's input survives a crash)."""
    from .video_io import atomic_write

    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def open_image(path: str | Path, sha256: str | None = None) -> Any:
    """The RGB image at ``path``; with ``sha256``, ValueError unless its pixels still have that
    fingerprint."""
    return _open_checked(path, sha256, lambda im: im.convert("RGB"), "input image")


def open_mask(path: str | Path, sha256: str | None = None) -> Any:
    """The inpainting mask at ``path`` in diffusers' convention (:func:`mask_from_image` of the file:
    a mask the server stored is already converted, and converts to itself; ``generate --mask``
    passes the user's file); with ``sha256``, ValueError unless the converted pixels still have that
    fingerprint."""
    return _open_checked(path, sha256, mask_from_image, "mask")


def _open_checked(path: str | Path, sha256: str | None, convert: Any, what: str) -> Any:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            out = convert(im)
    except FileNotFoundError:
        raise ValueError(f"the request's {what} {str(path)!r} is gone") from None
    if sha256 is not None and pixel_sha256(out) != sha256:
        raise ValueError(f"the request's {what} {str(path)!r} changed after the request was made")
    return out


def size_for_image(width: int, height: int, default_size: tuple[int, int], multiple: int) -> tuple[int, int]:
    """The clip ``(width, height)`` for an image of ``width`` x ``height`` when a request names
    no size: the image's aspect ratio at the area of ``default_size``, each side rounded down to
    ``multiple`` (the rule of diffusers' Wan image-to-video example) and kept within the sides a
    request may name."""
    area = default_size[0] * default_size[1]
    aspect = height / width
    lo = max(MIN_SIDE, multiple)
    hi = MAX_SIDE // multiple * multiple

    def side(v: float) -> int:
        return min(hi, max(lo, round(v) // multiple * multiple))

    return side(math.sqrt(area / aspect)), side(math.sqrt(area * aspect))


def _sizing(loaded: Any) -> tuple[Any, Any]:
    """``loaded``'s spec, and what its ``size_from_image`` / ``fit_image`` read (``loaded.sizing``,
    else the pipeline); None for the second where the spec derives no size, or nothing is loaded."""
    spec = getattr(loaded, "spec", None)
    if spec is None or spec.size_from_image is None:
        return spec, None
    state = getattr(loaded, "sizing", None)
    if state is None:
        pipe = getattr(loaded, "pipe", None)
        state = pipe if pipe is None or spec.sizing is None else spec.sizing(pipe)
    return spec, state


def default_size_for_image(loaded: Any, image: Any) -> tuple[int, int]:
    """The ``(width, height)`` a request on ``image`` gets when it names no size, on ``loaded``
    (a LoadedModel, with or without its pipeline; or a Preset, before loading). Where the pipeline
    derives its output size from the image (``PipelineSpec.size_from_image``: HunyuanVideo 1.5
    image-to-video's aspect buckets), the size it will make, so that the job and the file report
    the true size; else :func:`size_for_image` at the model's default area."""
    spec, state = _sizing(loaded)
    if spec is not None and spec.size_from_image is not None:
        if state is None:  # a Preset: the bucket needs the loaded pipeline; asked again once loaded
            return tuple(loaded.default_size)
        w, h = spec.size_from_image(state, image.width, image.height)
        return int(w), int(h)
    return size_for_image(image.width, image.height, loaded.default_size, loaded.size_multiple)


def fit_image_to_size(loaded: Any, image: Any, width: int, height: int, param: str = "size") -> Any:
    """The image to call ``loaded``'s pipeline with for a ``width`` x ``height`` output: ``image``
    itself, unless the pipeline derives its output size from its image
    (``PipelineSpec.size_from_image``); then ``image`` fitted by the spec's ``fit_image`` so that
    the call makes that size, checked with ``size_from_image``. ParamError on ``param`` when it
    would make another: a size is never silently replaced by another. The request parsers call it
    to refuse such a size up front (discarding the image), the engine to call the pipeline. Before
    the pipeline is loaded (a Preset) there is nothing to check."""
    spec, state = _sizing(loaded)
    if state is None:
        return image
    fitted = spec.fit_image(state, image, width, height) if spec.fit_image is not None else image
    if tuple(int(v) for v in spec.size_from_image(state, fitted.width, fitted.height)) == (width, height):
        return fitted
    # what an image of the named aspect comes out at: a bucket, which can be named
    made = tuple(int(v) for v in spec.size_from_image(state, width, height))
    raise ParamError(param, f"{spec.label} ({spec.name}) makes only the sizes of its aspect buckets; {width}x{height} "
                            f"is not one (an image of that aspect comes out at {made[0]}x{made[1]}): name that size, or "
                            "none, and the output takes the bucket nearest the image's aspect")
