"""Writing and reading video files: MP4 (H.264) through PyAV, animated WebP and GIF through Pillow.

PyAV's wheels ship their own FFmpeg build (libx264 included), so nothing else is installed.
Every write is atomic: the file is written to a temporary name in the destination's directory,
flushed to disk (fsync) and renamed into place, so a reader (or a server restarted after a crash)
never sees a half-written file under the final name.

MP4s are H.264, yuv420p (what every player plays), ``+faststart`` (the index first, so a browser
can start playing while downloading), with the sampling parameters in the container's ``comment``
tag (``key=value; ...``, as in the PNGs' ``parameters`` text).
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VIDEO_FORMATS = ("mp4", "webp", "gif")
# x264's constant-rate factor: 18 is visually lossless for natural video.
MP4_CRF = 18


def frames_to_uint8(frames: Any) -> Any:
    """Float frames in [0, 1] (a pipeline's ``output_type="np"``), shape (F, H, W, 3) -> uint8,
    rounded to nearest as diffusers' ``numpy_to_pil`` does."""
    import numpy as np

    arr = np.asarray(frames)
    if arr.dtype == np.uint8:
        return arr
    return (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)


def video_format(path: Path) -> str:
    """The container for ``path``'s suffix: mp4, webp or gif (ValueError otherwise)."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"unsupported video file type {Path(path).suffix or '(none)'!r}; use .mp4, .webp or .gif")
    return fmt


def _params_line(metadata: dict[str, str]) -> str:
    return "; ".join(f"{k}={v}" for k, v in metadata.items())


def _write_mp4(dst: Path, frames: Any, fps: int, metadata: dict[str, str] | None = None) -> None:
    """Write an H.264 MP4 of uint8 frames (F, H, W, 3) to the file ``dst`` (H and W even).
    A file, not a buffer: ``+faststart`` rewrites the file to move the index to the front."""
    import av

    frames = frames_to_uint8(frames)
    n, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"H.264 (yuv420p) needs even sizes, got {w}x{h}")
    with av.open(str(dst), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        if metadata:
            container.metadata["comment"] = _params_line(metadata)
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(MP4_CRF), "preset": "medium"}
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(frames[i], format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _write_animated(dst: Path, frames: Any, fps: int, fmt: str) -> None:
    """An animated WebP or GIF (Pillow), looping forever."""
    from PIL import Image

    frames = frames_to_uint8(frames)
    images = [Image.fromarray(f) for f in frames]
    duration = max(1, round(1000 / fps))
    if fmt == "webp":
        images[0].save(dst, format="WEBP", save_all=True, append_images=images[1:], duration=duration, loop=0, quality=90)
    elif fmt == "gif":
        images[0].save(dst, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    else:
        raise ValueError(f"not an animated image format: {fmt!r}")


TMP_PREFIX = ".tmp-"


def atomic_write(path: Path, write: "Callable[[Path], None] | bytes") -> int:
    """Create ``path`` atomically: ``write(tmp)`` (or the given bytes) fills a temporary file in
    the same directory (named ``.tmp-*``, so a sweeper can recognise leftovers), which is fsynced
    and renamed over ``path``. Returns the file's size."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{path.name}")
    try:
        if isinstance(write, (bytes, bytearray)):
            tmp.write_bytes(write)
        else:
            write(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return size
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    return size


def write_video(path: Path, frames: Any, fps: int, fmt: str | None = None, metadata: dict[str, str] | None = None) -> int:
    """Encode and atomically write a video file (format from the suffix unless ``fmt``); returns
    its size in bytes."""
    fmt = fmt or video_format(path)
    if fmt == "mp4":
        return atomic_write(Path(path), lambda tmp: _write_mp4(tmp, frames, fps, metadata))
    return atomic_write(Path(path), lambda tmp: _write_animated(tmp, frames, fps, fmt))


def thumbnail_webp(frames: Any) -> bytes:
    """The first frame as a WebP still (the videos API's ``variant=thumbnail``)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frames_to_uint8(frames)[0]).save(buf, format="WEBP", quality=90)
    return buf.getvalue()


@dataclass
class VideoInfo:
    frames: int  # counted by decoding every frame
    width: int
    height: int
    fps: float
    codec: str
    metadata: dict[str, str] = field(default_factory=dict)


def probe_video(source: "Path | bytes", decode: bool = True) -> VideoInfo:
    """Decode an MP4 (or WebP/GIF) back: frame count, size, frame rate, codec, container tags."""
    data = source if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
    if data[:4] == b"RIFF" or data[:3] == b"GIF":
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            n = getattr(im, "n_frames", 1)
            dur = im.info.get("duration") or 0
            return VideoInfo(n, im.width, im.height, 1000 / dur if dur else 0.0, im.format.lower())
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        count = sum(1 for _ in container.decode(stream)) if decode else int(stream.frames)
        return VideoInfo(
            frames=count,
            width=stream.codec_context.width,
            height=stream.codec_context.height,
            fps=float(stream.average_rate or 0),
            codec=stream.codec_context.name,
            metadata=dict(container.metadata),
        )


def decode_frames(source: "Path | bytes") -> Any:
    """All frames of an MP4 as uint8 RGB, shape (F, H, W, 3)."""
    import av
    import numpy as np

    data = source if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
