"""The OpenAI videos API (``/v1/videos``) over the shared engine, with durable jobs.

Routes (as the official ``openai`` client speaks them: ``client.videos.create / retrieve / list /
delete / download_content / create_and_poll``)
    POST   /v1/videos                 create a job (multipart form, as the client sends it, or JSON)
    GET    /v1/videos                 list jobs, newest first (``after``, ``limit`` <= 100, ``order``)
    GET    /v1/videos/{id}            the job object
    GET    /v1/videos/{id}/content    the MP4 (``variant=video``, default) or ``variant=thumbnail``
                                      (the first frame, WebP)
    DELETE /v1/videos/{id}            delete a job and its files; a queued or running job is
                                      cancelled first (a running batch stops at its next step)

Request fields: ``prompt`` (required), ``model``, ``size`` ("WxH"), ``seconds``,
``input_reference``, plus ditfuse's ``quality``, ``seed``, ``num_frames``, ``steps`` (alias
``num_inference_steps``), ``guidance_scale``, ``guidance_scale_2`` (Wan 2.2 A14B's low-noise
expert; a 400 on any checkpoint without two experts), ``negative_prompt``, ``true_cfg_scale``
(HunyuanVideo: its negative prompt runs true CFG only with ``true_cfg_scale`` > 1; a 400 for a
pipeline without it), ``last_input_reference`` (first-last-frame-to-video: the image the clip ends
on, sent as ``input_reference`` is; a 400 where the checkpoint takes none). Anything else is a 400
naming the field.

Image-to-video (a pipeline whose row has ``image_kwarg``: WanImageToVideoPipeline,
LTXImageToVideoPipeline, HunyuanVideo15ImageToVideoPipeline, SkyReelsV2ImageToVideoPipeline;
presets ``tiny-wan-i2v``, ``tiny-ltx-i2v``, ``tiny-hunyuanvideo15-i2v``, ``tiny-skyreels-v2-i2v``)
    ``input_reference`` is required there and refused elsewhere: an uploaded file (what
    ``client.videos.create(input_reference=open("cat.png", "rb"))`` sends) or, in a JSON body,
    ``{"image_url": "data:image/png;base64,..."}`` (the server fetches no URLs; ``file_id`` needs a
    files API it does not have). The image is decoded (runtime/inputs.py), kept as
    ``<data dir>/inputs/<job id>.png`` until the job is deleted, and fingerprinted (SHA-256 of
    its pixels, the job's ``image_sha256``); a ``last_input_reference`` likewise, as
    ``<job id>-last.png`` (``last_image_sha256``). Wan (and SkyReels-V2, HunyuanVideo 1.5) conditions
    a whole call on one image, so its jobs share a batch only with the same image; LTX-Video takes one image per prompt, so its jobs
    batch whatever their images. A job that names no ``size`` gets the image's aspect ratio at
    the model's default area; on a pipeline that derives its size from the image
    (``PipelineSpec.size_from_image``: HunyuanVideo 1.5's aspect buckets) the size it will make,
    and a named size it cannot make is a 400, so a job's ``size`` is always its clip's.

Seconds and frames
    A clip of ``num_frames`` frames at the model's ``fps`` lasts ``(num_frames - 1) / fps``
    seconds (the time from the first frame to the last). ``seconds`` maps to the ``4k+1`` frame
    count (LTX-Video: ``8k+1``) nearest to ``seconds * fps + 1``: Wan (16 fps) 1 s -> 17 frames,
    4 s -> 65, 5 s -> 81; LTX-Video (25 fps) 1 s -> 25 frames (0.96 s). ``num_frames`` may be given
    instead (it must be ``4k+1``, LTX-Video ``8k+1``); given both, they must agree. The job
    object's ``seconds`` is always ``(num_frames - 1) / fps``.

Job lifecycle
    ``queued`` -> ``in_progress`` (its batch started; ``progress`` = denoising steps done / (steps
    + 1), the last share being decode + MP4 encode) -> ``completed`` (progress 100, the MP4 is on
    disk) or ``failed`` (``error: {code, message}``: ``timeout``, ``generation_failed``,
    ``encode_failed``, ``server_restarted``, ``model_unavailable``, ``queue_full``).
    ``quality`` is the tier asked for; ``quality_applied`` what ran (``params.applied_quality`` of
    the row's ``close_sites``: the job's one batch, the images API's rule), null when that is not
    known: the job has not completed (queued, in progress, failed), its row predates schema
    version 2, or the startup recovery marked it completed (the crash came before the row
    recorded what ran).

Restart policy (see docs/videos.md)
    On startup, jobs that were ``in_progress`` when the previous server stopped are marked
    ``failed`` (code ``server_restarted``), not re-run: a job that was running when the process
    died may be what killed it (out of memory, a driver fault), and re-running it at every start
    would crash-loop the server. The exception is a job whose MP4 had already been renamed into
    place (the crash came between the rename and the row update): it is marked ``completed``.
    Jobs that were still ``queued`` never started, so they are re-queued in their original order
    (their timeout restarts). On a graceful shutdown (SIGINT/SIGTERM) the running batch finishes
    and jobs still queued stay queued for the next start.

Retention
    Finished jobs (completed or failed) older than ``max_age_s`` (``expires_at``), and the oldest
    beyond the newest ``max_stored``, are deleted with their files: at startup, after each job
    finishes, and every ``sweep_interval_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..contracts.quality import Quality
from . import video_io
from .engine import Engine, RequestCancelled, RequestTimeout
from .jobs import FINISHED, JobStore, params_json
from .params import (
    MAX_STEPS,
    ParamError,
    SamplingParams,
    applied_quality,
    resolve_num_frames,
    seconds_for_frames,
)
from .server import APIError, parse_quality, read_json_object

logger = logging.getLogger("ditfuse.videos")

ALLOWED_FIELDS = (
    "prompt", "model", "size", "seconds", "input_reference", "quality", "seed", "num_frames", "steps",
    "num_inference_steps", "guidance_scale", "guidance_scale_2", "negative_prompt", "true_cfg_scale",
    "last_input_reference",
)
# The request fields that carry an image (an upload, or {"image_url": data URL}).
IMAGE_FIELDS = ("input_reference", "last_input_reference")
# A job's last image is kept as <job id>-last.png beside its first (<job id>.png).
LAST_SUFFIX = "-last"
POLL_AFTER_MS = 500
DEFAULT_JOB_TIMEOUT_S = 3600.0
DEFAULT_MAX_STORED = 1000
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0


def default_data_dir() -> Path:
    from .presets import cache_dir

    return cache_dir() / "videos"


# ---------------------------------------------------------------------------------------------
# Request parsing


def _int_field(name: str, value: Any) -> Any:
    """Form fields arrive as strings: '42' -> 42 (other values are left for validation)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return value


def _float_field(name: str, value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ParamError(name, f"{name} must be a number, got {value!r}") from None
    return value


def input_image(value: Any, param: str = "input_reference") -> Any:
    """An image field (``input_reference``, ``last_input_reference``: ``param``) as the RGB image
    it carries: uploaded bytes (read_fields), or a ``{"image_url": data URL}`` object (a JSON body,
    or the ``<param>[image_url]`` form field). ParamError on ``param`` for anything else."""
    from .inputs import data_url_bytes, decode_image

    if isinstance(value, (bytes, bytearray)):
        return decode_image(bytes(value), param)
    if isinstance(value, str):  # a plain data URL, for hand-written JSON
        return decode_image(data_url_bytes(value, param), param)
    if isinstance(value, dict):
        if value.get("file_id") is not None:
            raise ParamError(param, f"{param}.file_id is not supported (this server has no files "
                                    "API): upload the image, or send image_url as a base64 data URL")
        unknown = set(value) - {"image_url", "file_id"}
        if unknown or "image_url" not in value:
            raise ParamError(param, f"{param} must be an uploaded image file or an object "
                                    "{\"image_url\": \"data:image/png;base64,...\"}")
        return decode_image(data_url_bytes(value["image_url"], param), param)
    raise ParamError(param, f"{param} must be an uploaded image file or an object with "
                            f"image_url, got {type(value).__name__}")


def parse_video_request(fields: dict[str, Any], engine: Engine) -> tuple[SamplingParams, str]:
    """Validate a create body into SamplingParams (``num_frames`` set) and the ``seconds`` string
    the job reports. Raises ParamError (400) / APIError. With ``input_reference`` the params hold
    the image's fingerprint, and the decoded image in ``extra["input_image"]`` for the caller to
    store (``image`` is set once it has a path: :meth:`VideoJobs.create`); with
    ``last_input_reference`` the last image's, in ``extra["last_image"]`` (``last_image``)."""
    for key in fields:
        if key not in ALLOWED_FIELDS:
            raise ParamError(key, f"unknown field {key!r}; allowed fields: {', '.join(ALLOWED_FIELDS)}")
    loaded = engine.loaded
    model = fields.get("model")
    if model is not None and model not in (engine.model_name, "ditfuse"):
        raise APIError(404, f"model {model!r} is not served here; this server runs {engine.model_name!r}", "model", "model_not_found")
    capabilities = getattr(loaded, "capabilities", None)
    refused = loaded.spec.check_request(
        {k for k in ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "negative_prompt")
         if fields.get(k) is not None}, capabilities)
    if refused:
        raise ParamError(*refused)
    how = ": an uploaded image file, or {\"image_url\": \"data:image/png;base64,...\"})"
    given = fields.get("input_reference") is not None
    why = loaded.spec.check_image(given)
    if why is not None:
        raise ParamError("input_reference", why if given else f"{why} (input_reference{how}")
    given_last = fields.get("last_input_reference") is not None
    why = loaded.spec.check_last_image(capabilities, given_last)
    if why is not None:
        raise ParamError("last_input_reference", why if given_last else f"{why} (last_input_reference{how}")
    image = None if fields.get("input_reference") is None else input_image(fields["input_reference"])
    last = None if not given_last else input_image(fields["last_input_reference"], "last_input_reference")
    if fields.get("steps") is not None and fields.get("num_inference_steps") is not None:
        raise ParamError("steps", "give steps or num_inference_steps, not both")
    steps = fields.get("steps", fields.get("num_inference_steps"))
    if steps is not None:
        steps = _int_field("steps", steps)
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise ParamError("steps", f"steps must be an integer, got {steps!r}")
        if not 1 <= steps <= MAX_STEPS:
            raise ParamError("steps", f"steps must be between 1 and {MAX_STEPS}, got {steps}")
    else:
        steps = loaded.default_steps
    guidance = fields.get("guidance_scale")
    guidance = loaded.default_guidance if guidance is None else _float_field("guidance_scale", guidance)
    quality = parse_quality(fields.get("quality"), engine.default_quality)
    frames = resolve_num_frames(
        seconds=fields.get("seconds"),
        num_frames=_int_field("num_frames", fields.get("num_frames")),
        fps=loaded.fps,
        frame_multiple=loaded.frame_multiple,
        default_frames=loaded.default_frames,
    )
    # a pipeline with true CFG (HunyuanVideo) gets diffusers' default true_cfg_scale unless asked
    true_cfg = fields.get("true_cfg_scale")
    kwargs: dict[str, Any] = {"true_cfg_scale": loaded.spec.default_true_cfg if true_cfg is None
                              else _float_field("true_cfg_scale", true_cfg)}
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    if fields.get("guidance_scale_2") is not None:
        kwargs["guidance_scale_2"] = _float_field("guidance_scale_2", fields["guidance_scale_2"])
    if last is not None and frames < 2:
        # the call puts the last image after num_frames - 2 empty frames
        raise ParamError("num_frames", f"a clip with a last image has at least 2 frames ({loaded.frame_multiple}k+1: "
                                       f"{loaded.frame_multiple + 1} or more), got {frames}")
    size = fields.get("size")
    default_size = loaded.default_size
    if image is not None:
        from .inputs import default_size_for_image

        default_size = default_size_for_image(loaded, image)
    params = SamplingParams.create(
        fields.get("prompt"),
        size=None if size in (None, "auto") else size,
        seed=_int_field("seed", fields.get("seed")),
        quality=quality,
        negative_prompt=fields.get("negative_prompt") or None,
        default_size=default_size,
        size_multiple=loaded.size_multiple,
        **kwargs,
    ).with_(num_frames=frames)
    if image is not None:
        from .inputs import fit_image_to_size, pixel_sha256

        fit_image_to_size(loaded, image, params.width, params.height)  # a size it cannot make: 400
        params = params.with_(image_sha256=pixel_sha256(image), extra={"input_image": image})
    if last is not None:
        from .inputs import pixel_sha256

        params = params.with_(last_image_sha256=pixel_sha256(last), extra={**params.extra, "last_image": last})
    return params, seconds_for_frames(frames, loaded.fps)


async def read_fields(request: Request) -> dict[str, Any]:
    """The create body as a dict: multipart/form-data (what the openai client sends),
    application/x-www-form-urlencoded, or application/json. Other content types: 415."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form()
        except Exception as e:  # malformed multipart
            raise APIError(400, f"request body is not a valid form: {e}", code="invalid_form") from None
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            field_name, bracket, sub = key.partition("[")
            if field_name in IMAGE_FIELDS and bracket and sub in ("image_url]", "file_id]"):
                # the openai client's form encoding of an {"image_url": ...} / {"file_id": ...} object
                ref = fields.setdefault(field_name, {})
                sub = sub[:-1]
                if not isinstance(ref, dict) or sub in ref:
                    raise ParamError(field_name, f"{field_name} is given more than once")
                ref[sub] = value
                continue
            if key in fields:
                raise ParamError(key, f"field {key!r} is given more than once")
            if not isinstance(value, str):  # an uploaded file
                try:
                    if key not in IMAGE_FIELDS:
                        raise ParamError(key, f"{key} must be a text field, not a file")
                    fields[key] = await value.read()
                finally:
                    await value.close()
            else:
                fields[key] = value
        return fields
    if ctype == "application/json":
        return await read_json_object(request)
    raise APIError(
        415,
        f"unsupported Content-Type {ctype or '(none)'!r}; send multipart/form-data (as the openai client does) or application/json",
        code="unsupported_media_type",
    )


# ---------------------------------------------------------------------------------------------
# Jobs


@dataclass
class _Live:
    """A job this process is running or has queued in the engine."""

    req: Any  # engine request
    task: asyncio.Task | None = None
    progress: int = 0


class VideoJobs:
    """Video jobs over a shared :class:`Engine`: SQLite rows + files under ``data_dir``."""

    def __init__(
        self,
        engine: Engine,
        data_dir: Path | None = None,
        *,
        job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S,
        max_stored: int | None = DEFAULT_MAX_STORED,
        max_age_s: float | None = DEFAULT_MAX_AGE_S,
        sweep_interval_s: float = 60.0,
        store: JobStore | None = None,
    ) -> None:
        if not engine.loaded.is_video:
            raise ValueError(f"{engine.model_name!r} makes images, not videos")
        self.engine = engine
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
        self.job_timeout_s = float(job_timeout_s)
        self.max_stored = max_stored if max_stored is None or max_stored > 0 else None
        self.max_age_s = max_age_s if max_age_s else None
        self.sweep_interval_s = float(sweep_interval_s)
        self.store: JobStore | None = store  # opened (and the data dir locked) by open() if None
        self._live: dict[str, _Live] = {}
        self._sweeper: asyncio.Task | None = None
        self._closing = False
        self.recovered: dict[str, list[str]] = {}

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def inputs_dir(self) -> Path:
        """Input images of image-to-video jobs, ``<job id>.png`` (and a last image's
        ``<job id>-last.png``), kept until the job is deleted."""
        return self.data_dir / "inputs"

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> JobStore:
        """Open the store and lock the data dir (DataDirLocked if another server holds it)."""
        if self.store is None:
            self.store = JobStore(self.data_dir)
        return self.store

    async def start(self) -> None:
        """Open the store, recover jobs of a previous run, sweep. The engine must be running
        (queued jobs are re-queued into it)."""
        self.open()
        self._closing = False
        self.recovered = self._recover()
        self._remove_orphans()
        self.sweep()
        if self.sweep_interval_s > 0:
            self._sweeper = asyncio.create_task(self._sweep_loop(), name="ditfuse-video-sweeper")

    def detach_queued(self) -> None:
        """Before a graceful engine shutdown: take jobs that have not started out of the engine
        queue (their rows stay ``queued``: the next start re-queues them)."""
        self._closing = True
        for live in list(self._live.values()):
            if self.engine.is_waiting(live.req):
                self.engine.cancel(live.req, reason="shutdown")

    async def close(self) -> None:
        """After the engine has stopped: let running jobs write their files, close the store."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        tasks = [lv.task for lv in self._live.values() if lv.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.store is not None:
            self.store.close()
            self.store = None

    def _recover(self) -> dict[str, list[str]]:
        """Jobs a previous server left unfinished (module docstring, "Restart policy")."""
        store, out = self.store, {"completed": [], "failed": [], "requeued": []}
        now = int(time.time())
        for row in store.with_status(("in_progress",)):
            mp4 = self.files_dir / f"{row['id']}.mp4"
            if mp4.is_file():
                store.update(row["id"], status="completed", progress=100, completed_at=now, finished_at=now,
                             expires_at=self._expires(now), file=mp4.name, bytes=mp4.stat().st_size)
                out["completed"].append(row["id"])
            else:
                self._fail(row["id"], "server_restarted",
                           "the server stopped while this job was running; it is not re-run automatically "
                           "(a job running when the server died may be what killed it): create it again")
                out["failed"].append(row["id"])
        for row in store.with_status(("queued",)):
            if row["model"] != self.engine.model_name:
                self._fail(row["id"], "model_unavailable",
                           f"queued for model {row['model']!r}, but the server restarted with {self.engine.model_name!r}")
                out["failed"].append(row["id"])
                continue
            try:
                d = json.loads(row["params"])
                params = SamplingParams(**{**d, "quality": Quality.parse(d["quality"])})
                self._enqueue(row["id"], params)
            except Exception as e:  # QueueFull, EngineClosed, a params row from another version
                self._fail(row["id"], getattr(e, "code", "requeue_failed"), f"could not re-queue after a restart: {e}")
                out["failed"].append(row["id"])
                continue
            out["requeued"].append(row["id"])
        if any(out.values()):
            logger.warning("video jobs recovered after a restart: %s", {k: len(v) for k, v in out.items()})
        return out

    def _remove_orphans(self) -> None:
        """Leftover temporary files, and files whose job row is gone or not completed."""
        in_use = self.store.files_in_use()
        ids = {r["id"] for r in self.store.with_status(("completed",))}
        for f in self.files_dir.iterdir():
            if f.name.startswith(video_io.TMP_PREFIX) or (f.name not in in_use and f.stem not in ids):
                f.unlink(missing_ok=True)
        if self.inputs_dir.is_dir():  # an input image whose job row is gone (or a half-written one)
            rows = self.store.ids()
            for f in self.inputs_dir.iterdir():
                if f.name.startswith(".") or f.stem.removesuffix(LAST_SUFFIX) not in rows:
                    f.unlink(missing_ok=True)

    def _expires(self, finished_at: int) -> int | None:
        return None if self.max_age_s is None else int(finished_at + self.max_age_s)

    def sweep(self) -> list[str]:
        """Apply the retention limits; returns the deleted job ids."""
        if self.store is None:
            return []
        gone = []
        for row in self.store.retention_victims(self.max_stored):
            if self.store.delete(row["id"]):
                self._unlink_files(row["id"])
                gone.append(row["id"])
        if gone:
            logger.info("retention: deleted %d finished video jobs", len(gone))
        return gone

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.sweep()
            except Exception:  # never let the sweeper die
                logger.exception("video retention sweep failed")

    def _unlink_files(self, job_id: str, outputs_only: bool = False) -> None:
        for suffix in (".mp4", ".webp"):
            (self.files_dir / f"{job_id}{suffix}").unlink(missing_ok=True)
        if not outputs_only:
            for suffix in ("", LAST_SUFFIX):
                (self.inputs_dir / f"{job_id}{suffix}.png").unlink(missing_ok=True)

    # -- jobs --------------------------------------------------------------------------------

    async def create(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Validate, queue in the engine (QueueFull -> 429 before anything is stored), store the
        row; returns the job object. An input image is decoded, fingerprinted and written off the
        event loop."""
        if self._closing or self.store is None:
            from .engine import EngineClosed

            raise EngineClosed("server is shutting down")
        params, seconds = await asyncio.to_thread(parse_video_request, fields, self.engine)
        job_id = f"video_{uuid.uuid4().hex}"
        stored: dict[str, str] = {}
        for key, param, suffix in (("input_image", "image", ""), ("last_image", "last_image", LAST_SUFFIX)):
            image = params.extra.get(key)
            if image is not None:
                from .inputs import save_png

                path = self.inputs_dir / f"{job_id}{suffix}.png"
                try:
                    await asyncio.to_thread(save_png, image, path)
                except BaseException:
                    self._unlink_files(job_id)  # the first image, when the last one failed
                    raise
                stored[param] = str(path)
        if params.extra:
            params = params.with_(**stored, extra={})
        if self._closing or self.store is None:  # shutdown began while the image was written
            from .engine import EngineClosed

            self._unlink_files(job_id)
            raise EngineClosed("server is shutting down")
        row = {
            "id": job_id,
            "model": self.engine.model_name,
            "status": "queued",
            "progress": 0,
            "created_at": int(time.time()),
            "prompt": params.prompt,
            "size": params.size,
            "seconds": seconds,
            "quality": params.quality.value,
            "params": params_json(params),
        }
        try:
            live = self._enqueue(job_id, params, start_task=False)
        except BaseException:
            self._unlink_files(job_id)
            raise
        try:
            self.store.insert(row)
        except BaseException:
            self.engine.cancel(live.req, reason="store_failed")
            self._live.pop(job_id, None)
            self._unlink_files(job_id)
            raise
        live.task = asyncio.create_task(self._run(job_id, live), name=f"ditfuse-{job_id}")
        return self.to_api(row)

    def _enqueue(self, job_id: str, params: SamplingParams, start_task: bool = True) -> _Live:
        live = _Live(req=None)
        live.req = self.engine.enqueue(
            params, timeout_s=self.job_timeout_s, on_progress=lambda done, total: self._on_progress(job_id, live, done, total)
        )
        self._live[job_id] = live
        if start_task:
            live.task = asyncio.create_task(self._run(job_id, live), name=f"ditfuse-{job_id}")
        return live

    def _on_progress(self, job_id: str, live: _Live, done: int, total: int) -> None:
        """On the loop, per denoising step (done = 0 when the job's batch starts)."""
        pct = min(99, int(100 * done / (total + 1)))
        if self.store is None:
            return
        if done == 0:
            self.store.update(job_id, only_status=("queued",), status="in_progress", started_at=int(time.time()))
        elif pct > live.progress:
            self.store.update(job_id, only_status=("in_progress",), progress=pct)
        live.progress = max(live.progress, pct)

    def _fail(self, job_id: str, code: str, message: str) -> bool:
        now = int(time.time())
        return self.store.update(job_id, status="failed", error_code=code, error_message=message,
                                 finished_at=now, expires_at=self._expires(now))

    async def _run(self, job_id: str, live: _Live) -> None:
        try:
            try:
                out = await self.engine.wait(live.req)
            except RequestCancelled:
                return  # deleted (row gone) or detached at shutdown (row stays queued)
            except RequestTimeout as e:
                self._fail(job_id, "timeout", f"the job did not finish within its timeout ({self.job_timeout_s:g} s): {e}")
                return
            except Exception as e:
                self._fail(job_id, "generation_failed", f"{type(e).__name__}: {e}")
                return
            if self.store is None or self.store.get(job_id) is None:
                return  # deleted while its batch finished
            frames = out[0].image
            params = out[0].params
            meta = params.metadata(0, model=self.engine.model_name, close_sites=out[0].close_sites)
            mp4 = self.files_dir / f"{job_id}.mp4"
            try:
                # The thumbnail first: a present MP4 means the job's files are all there.
                await asyncio.to_thread(video_io.atomic_write, self.files_dir / f"{job_id}.webp", video_io.thumbnail_webp(frames))
                size = await asyncio.to_thread(video_io.write_video, mp4, frames, self.engine.loaded.fps, "mp4", meta)
            except Exception as e:
                self._unlink_files(job_id, outputs_only=True)
                self._fail(job_id, "encode_failed", f"{type(e).__name__}: {e}")
                return
            now = int(time.time())
            # a video request is one clip (n = 1), so one batch: its close sites say what ran
            ok = self.store.update(job_id, status="completed", progress=100, completed_at=now, finished_at=now,
                                   expires_at=self._expires(now), file=mp4.name, bytes=size,
                                   close_sites=out[0].close_sites)
            if not ok:  # deleted while encoding
                self._unlink_files(job_id)
            self.sweep()
        finally:
            self._live.pop(job_id, None)

    def get(self, job_id: str) -> dict[str, Any]:
        row = self.store.get(job_id) if self.store is not None else None
        if row is None:
            raise APIError(404, f"no video job with id {job_id!r}", "video_id", "video_not_found")
        return row

    def delete(self, job_id: str) -> dict[str, Any]:
        self.get(job_id)
        live = self._live.get(job_id)
        if live is not None:
            self.engine.cancel(live.req, reason="cancelled")
        self.store.delete(job_id)
        self._unlink_files(job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    def list(self, after: str | None, limit: int, order: str) -> dict[str, Any]:
        try:
            rows, more = self.store.list(after=after, limit=limit, order=order)
        except KeyError:
            raise APIError(400, f"after: no video job with id {after!r}", "after", "invalid_value") from None
        data = [self.to_api(r) for r in rows]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    def to_api(self, row: dict[str, Any]) -> dict[str, Any]:
        """A job row as OpenAI's ``Video`` object (plus ditfuse's fields)."""
        p = json.loads(row["params"])
        error = None
        if row.get("status") == "failed":
            error = {"code": row.get("error_code") or "failed", "message": row.get("error_message") or ""}
        return {
            "id": row["id"],
            "object": "video",
            "model": row["model"],
            "status": row["status"],
            "progress": int(row.get("progress") or 0),
            "created_at": row["created_at"],
            "completed_at": row.get("completed_at"),
            "expires_at": row.get("expires_at"),
            "prompt": row["prompt"],
            "seconds": row["seconds"],
            "size": row["size"],
            "remixed_from_video_id": None,
            "error": error,
            "quality": row["quality"],
            "quality_applied": applied_quality(row.get("close_sites")),
            "seed": p["seed"],
            "num_frames": p["num_frames"],
            "num_inference_steps": p["num_inference_steps"],
            "guidance_scale": p["guidance_scale"],
            "guidance_scale_2": p.get("guidance_scale_2"),
            "fps": self.engine.loaded.fps,
            "image_sha256": p.get("image_sha256"),
            "last_image_sha256": p.get("last_image_sha256"),
        }

    def content_path(self, job_id: str, variant: str | None) -> tuple[Path, str]:
        row = self.get(job_id)
        variant = variant or "video"
        if variant not in ("video", "thumbnail", "spritesheet"):
            raise ParamError("variant", f"variant must be video, thumbnail or spritesheet, got {variant!r}")
        if variant == "spritesheet":
            raise ParamError("variant", "variant 'spritesheet' is not supported; use 'video' or 'thumbnail'")
        if row["status"] != "completed":
            raise APIError(
                409,
                f"video {job_id} is {row['status']}, not completed: its content can be downloaded once status is 'completed'",
                "video_id",
                "video_not_ready",
            )
        if variant == "video":
            return self.files_dir / row["file"], "video/mp4"
        return self.files_dir / f"{job_id}.webp", "image/webp"


# ---------------------------------------------------------------------------------------------
# Routes


def _file_response(path: Path, media_type: str) -> StreamingResponse:
    try:
        f = open(path, "rb")  # opened now: a later delete (retention) cannot cut the download
    except FileNotFoundError:
        raise APIError(404, f"the file of {path.stem} is gone (deleted)", "video_id", "video_not_found") from None
    size = Path(f.name).stat().st_size

    def chunks():
        try:
            while True:
                block = f.read(1 << 20)
                if not block:
                    return
                yield block
        finally:
            f.close()

    return StreamingResponse(
        chunks(),
        media_type=media_type,
        headers={"content-length": str(size), "content-disposition": f'attachment; filename="{path.name}"'},
    )


def _poll_headers() -> dict[str, str]:
    return {"openai-poll-after-ms": str(POLL_AFTER_MS)}


def router(jobs: VideoJobs) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/videos")
    async def create(request: Request) -> JSONResponse:
        fields = await read_fields(request)
        return JSONResponse(await jobs.create(fields), headers=_poll_headers())

    @r.get("/v1/videos")
    async def list_videos(after: str | None = None, limit: str | None = None, order: str | None = None) -> JSONResponse:
        n = 20
        if limit is not None:
            if not limit.strip().isdigit() or not 1 <= int(limit) <= 100:
                raise ParamError("limit", f"limit must be an integer between 1 and 100, got {limit!r}")
            n = int(limit)
        order = order or "desc"
        if order not in ("asc", "desc"):
            raise ParamError("order", f"order must be 'asc' or 'desc', got {order!r}")
        return JSONResponse(jobs.list(after or None, n, order))

    @r.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str) -> JSONResponse:
        return JSONResponse(jobs.to_api(jobs.get(video_id)), headers=_poll_headers())

    @r.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, variant: str | None = None) -> StreamingResponse:
        path, media_type = jobs.content_path(video_id, variant)
        return _file_response(path, media_type)

    @r.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> JSONResponse:
        return JSONResponse(jobs.delete(video_id))

    return r


def unsupported_router(model: str) -> APIRouter:
    """``/v1/videos`` on a server whose model makes images: a clear 400 on every route."""
    r = APIRouter()
    from .presets import video_models_hint

    message = f"this server runs {model!r}, an image model; the videos API needs a video model ({video_models_hint()})"


    async def refuse(request: Request) -> JSONResponse:
        raise APIError(400, message, "model", "model_not_video")

    for path in ("/v1/videos", "/v1/videos/{rest:path}"):
        r.add_api_route(path, refuse, methods=["GET", "POST", "DELETE"])
    return r


__all__ = ["VideoJobs", "router", "unsupported_router", "parse_video_request", "default_data_dir", "FINISHED"]
