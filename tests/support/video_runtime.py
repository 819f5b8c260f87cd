"""What the video-runtime test files (tests/cpu/test_videos_<family>.py: LTX-Video, HunyuanVideo,
SkyReels-V2) share: a tiny pipeline with its progress bars off, a seeded short call returning its
frames, the accelerated-vs-plain bitwise check with every op of the adapter reaching the gate,
the request parser on a fake engine, and the ``ditfuse generate`` / ``/v1/videos`` round trips.

Each helper asserts what the files asserted one by one before; the family-specific checks stay
in the files."""

from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

try:
    import openai
except ImportError:  # the GPU machine has no openai client; only the /v1/videos round trips need it
    openai = None

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.runtime import video_io
from ditfuse.runtime.params import ParamError

from tests.cpu.test_generate import run_cli
from tests.support.engaged import assert_gate_clean

if openai is not None:  # the live-server fixture (its module imports openai)
    from tests.cpu.test_videos_server import serving

KEY = "k"  # the API key of the servers started here


def picture(seed: int, width: int = 40, height: int = 30, mode: str = "RGB") -> Any:
    """A random PIL image of the size, for the image-to-video tests (the tiny pipelines only
    need pixels)."""
    from PIL import Image

    channels = len(mode)
    arr = (np.random.RandomState(seed).rand(height, width, channels) * 255).astype(np.uint8)
    return Image.fromarray(arr if channels > 1 else arr[..., 0], mode)


def image_bytes(image: Any, fmt: str = "PNG", **save: Any) -> bytes:
    """``image`` encoded as ``fmt`` (an upload's bytes)."""
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def quiet(pipe: Any) -> Any:
    """``pipe`` with diffusers' progress bars off (returned, for chaining)."""
    pipe.set_progress_bar_config(disable=True)
    return pipe


def frames(pipe: Any, seed: int = 3, **kwargs: Any) -> torch.Tensor:
    """``pipe(**kwargs)`` with 2 denoising steps (unless ``kwargs`` name others), numpy output and
    a CPU generator seeded with ``seed``: its frames as a tensor ``[videos, frames, H, W, 3]``."""
    kw = dict(num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(seed))
    out = pipe(**{**kw, **kwargs}).frames
    assert isinstance(out, np.ndarray), type(out)
    return torch.from_numpy(np.ascontiguousarray(out))


def assert_accelerated_bitwise(pipe: Any, call: Callable[[Any], torch.Tensor], adapter: Any,
                               no_skipped_sites: bool = True) -> Any:
    """``call(pipe)`` mounted with ``ditfuse.accelerate`` is bitwise ``call(pipe)`` plain, before
    and after unmounting; the transformer took ``adapter`` (a ``models.base.Adapter``) with every
    one of its sites (and, with ``no_skipped_sites``, no module of a site's class left on its own
    forward); the gate saw no fallback and no disabled op (under the interpreter, bitwise
    mismatches allowed: engaged.assert_gate_clean), and verified every op of the adapter.
    ``call`` must be deterministic (a seeded generator). Returns the transformer's mount report
    (``sites``, ``skipped_sites``), for a caller that checks what was skipped."""
    name = adapter.family
    base = call(pipe)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    try:
        tr = {c.component: c for c in h.report().components}["transformer"]
        assert tr.adapter == name and tr.status == "mounted", h.report().summary()
        assert {s for _, s in tr.sites} == {s.name for s in adapter.sites}, tr.sites
        assert not no_skipped_sites or not tr.skipped_sites, tr.skipped_sites
        out = call(pipe)
        gate = ditfuse.gate.report()
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, f"{name}: accelerated pipeline output")
    assert_gate_clean(gate, name)
    for op in adapter.ops():
        assert gate.calls.get(op, {}).get("verify", 0) > 0, f"{name}: {op} never reached the gate: {gate.calls}"
    assert_bitwise_equal(call(pipe), base, f"{name}: output after unmount")
    return tr


def video_engine(loaded: Any, model_name: str) -> SimpleNamespace:
    """What ``runtime.videos.parse_video_request`` reads of an engine, for ``loaded``."""
    from ditfuse.contracts.quality import Quality

    return SimpleNamespace(loaded=loaded, model_name=model_name, default_quality=Quality.LOSSLESS)


def assert_request_refused(loaded: Any, model_name: str, fields: dict[str, Any], param: str, needle: str) -> None:
    """``/v1/videos`` fields ``{"prompt": "a fox", **fields}`` are a ParamError on ``param`` whose
    message holds ``needle``."""
    from ditfuse.runtime.videos import parse_video_request

    with pytest.raises(ParamError) as e:
        parse_video_request({"prompt": "a fox", **fields}, video_engine(loaded, model_name))
    assert e.value.param == param and needle in str(e.value), str(e.value)


def generate_clip(preset: str, cache: Path, out: Path, args: list[str]) -> tuple[subprocess.CompletedProcess,
                                                                                 video_io.VideoInfo]:
    """``ditfuse generate --model PRESET ARGS --out OUT`` in a subprocess: it exits 0; returns the
    process and the written clip's probe."""
    r = run_cli(["generate", "--model", preset, *args, "--out", str(out)], cache)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, video_io.probe_video(out)


def assert_generate_report(r: subprocess.CompletedProcess, pipeline: str, guidance: str, fps: int,
                           steps: int = 2) -> None:
    """The summary of a ``ditfuse generate`` clip names the pipeline class, the guidance, the
    preset's noise note, the mounted adapter and the frame rate; the progress bar counted ``steps``
    denoising steps (its last tick is the VAE decode)."""
    assert f"({pipeline})" in r.stdout and f"guidance {guidance}" in r.stdout and "noise" in r.stdout
    assert "accelerated:" in r.stdout and f"{fps} fps" in r.stdout
    assert f"{steps}/{steps + 1}" in r.stderr


def assert_generate_refuses(preset: str, cache: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    """``ditfuse generate --model PRESET --prompt x ARGS`` exits 2 with ``needle`` on stderr and
    writes nothing."""
    r = run_cli(["generate", "--model", preset, "--prompt", "x", *args, "--out", str(tmp_path / "x.mp4")], cache)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


@contextmanager
def serve_preset(preset: str, data_dir: Path, accelerate: bool = True) -> Iterator[SimpleNamespace]:
    """``preset`` served (accelerated unless ``accelerate=False``) with the videos API (one image
    per batch, up to two videos per batch, 300 ms to gather a batch) under uvicorn: yields ``url``
    and ``engine``."""
    from ditfuse.runtime.server import build_engine, create_app
    from ditfuse.runtime.videos import VideoJobs

    engine, _ = build_engine(preset, accelerate=accelerate, max_batch_size=1, max_video_batch_size=2,
                             batch_wait_ms=300, max_queue=16)
    jobs = VideoJobs(engine, data_dir, sweep_interval_s=0)
    app = create_app(engine, api_key=KEY, max_body_bytes=64 * 1024, videos=jobs)
    with serving(app) as url:
        yield SimpleNamespace(url=url, engine=engine)


def wait_done(c: openai.OpenAI, job_id: str, timeout_s: float = 240) -> Any:
    """Poll a video job until it is completed or failed (at most ``timeout_s``); the job object."""
    deadline = time.monotonic() + timeout_s
    while (v := c.videos.retrieve(job_id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, v
        time.sleep(0.2)
    return v


def completed_clips(c: openai.OpenAI, jobs: list[Any]) -> tuple[list[Any], list[bytes]]:
    """Wait for each video job; each must complete. Their final job objects and MP4s, in order."""
    videos, clips = [], []
    for j in jobs:
        v = wait_done(c, j.id)
        assert v.status == "completed", v.error
        videos.append(v)
        clips.append(c.videos.download_content(j.id).read())
    return videos, clips


def assert_two_jobs_share_a_batch(served: SimpleNamespace, size: str, body: dict[str, Any], frames: int, fps: int,
                                  seconds: str, bad_frames: int, needle: str) -> None:
    """Through the official openai client: two ``/v1/videos`` jobs (``body`` plus seeds 0 and 1)
    complete, report ``seconds``, download as ``frames``-frame clips of ``size`` at ``fps`` that
    differ, and ran in padded batches holding both; a job of ``bad_frames`` frames is a 400 whose
    message holds ``needle``."""
    width, height = (int(v) for v in size.split("x"))
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=300, max_retries=0)
    jobs = [c.videos.create(prompt=f"a fox {i}", size=size, extra_body={**body, "seed": i}) for i in range(2)]
    videos, done = completed_clips(c, jobs)
    assert all(v.seconds == seconds for v in videos), videos
    infos = [video_io.probe_video(mp4) for mp4 in done]
    assert all((i.frames, i.width, i.height, i.fps) == (frames, width, height, float(fps)) for i in infos), infos
    assert done[0] != done[1]  # different seeds
    log = list(served.engine.batch_log)
    assert served.engine.pad_batches and sum(b["size"] for b in log) == 2, log
    with pytest.raises(openai.BadRequestError) as e:
        c.videos.create(prompt="x", size=size, extra_body={"num_frames": bad_frames})
    assert needle in str(e.value)
