"""Input images of image-to-video requests: decode and check what a request sends, fingerprint the
pixels, keep them on disk for the job, and the clip size an image implies.

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
            return im.convert("RGB")
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
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            rgb = im.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"the request's input image {str(path)!r} is gone") from None
    if sha256 is not None and pixel_sha256(rgb) != sha256:
        raise ValueError(f"the request's input image {str(path)!r} changed after the request was made")
    return rgb


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
