"""The serving engine: owns the pipeline and its ditfuse handle, batches compatible requests.

Scheduling
    Requests wait in one bounded FIFO (``max_queue`` requests; a full queue raises
    :class:`QueueFull`, which the server maps to 429). The scheduler takes the oldest request, waits
    at most ``batch_wait_ms`` (counted from that request's arrival) for more requests with the same
    signature (model, size, steps, guidance, quality, true-CFG), and runs up to ``max_batch_size``
    images of them as one pipeline call. A request's ``n`` images may be split over consecutive
    batches. Requests whose client went away, or whose timeout passed, are dropped before they run.

Seeds and batch-mates
    Every image gets its own ``torch.Generator`` (image ``i`` of a request: ``seed + i``), passed as
    a list to the pipeline, so its initial latents depend on its seed only. That alone is not
    enough for identical bytes: on CPU, PyTorch's GEMM for one row (M=1, a GEMV path) and its conv
    for batch 1 round differently from the batched kernels (measured on the tiny preset: the first
    differing op is ``time_text_embed.timestep_embedder.linear_1`` in the transformer and
    ``conv_in`` in the VAE decoder; batches of 2 and 4 agree with each other at every position).
    cuBLAS/cuDNN likewise pick kernels by batch size. So by default (``pad_batches=True``) every
    batch runs at exactly ``max_batch_size`` images, filling empty slots with copies of the first
    image (results discarded): an image is then a function of its own request and seed only, the
    same whether it ran alone or with batch-mates. ``pad_batches=False`` (``--no-pad-batches``)
    trades that guarantee for throughput at low load.

Quality
    quality is part of the signature, so a batch never mixes tiers; ``handle.set_quality`` (mount /
    unmount of the request-gated kernels) runs on the worker thread between batches only. Every
    batch is recorded in :attr:`Engine.batch_log` with the quality it ran at and the request-gated
    sites that were mounted while it ran. Switching tiers costs a mount/unmount, so the scheduler
    prefers waiting work of the tier that is mounted now: the oldest request of another tier runs
    first only once it has waited ``quality_switch_wait_ms`` (its fairness bound), so an
    alternating stream of lossless/high requests does not switch before every batch.

Videos (the same engine serves video jobs)
    A request whose params carry ``num_frames`` is a video; ``num_frames`` is in the signature, so
    videos batch only with videos of the same shape, steps, guidance (CFG or not) and quality, up to
    ``max_video_batch_size`` per call (padded to it like images). Kinds alternate so neither starves:
    waiting image requests run before waiting video jobs (an image's client holds its connection; a
    video is a job the client polls), but once ``image_batches_per_video`` image batches have run
    while a video job waited, the next batch is a video batch. A pipeline call is never preempted,
    so an image waits for at most one running video batch plus the image batches ahead of it.
    Video batches report progress per denoising step (``on_progress``), and a batch whose requests
    were all cancelled (:meth:`Engine.cancel`) or timed out stops at its next step.

Several devices: data parallel (``pool=``)
    With a :class:`~ditfuse.runtime.workers.WorkerPool`, each worker process holds its own copy of
    the pipeline on its own device and is one *lane*: the scheduler runs up to one batch per idle
    live lane at a time, so N workers run N batches concurrently, all taken from the one queue
    above (same signatures, padding, fairness between kinds). Each lane has its own mounted tier
    and the quality policy above holds per lane: an idle lane takes the oldest waiting request
    whose tier it has mounted, unless the oldest request of the other tier has waited
    ``quality_switch_wait_ms``; with no work of its tier waiting it switches at once. When the
    oldest request's tier is mounted on some idle lane, that lane takes it. A lane whose worker
    died fails its running batch (:class:`~ditfuse.runtime.workers.WorkerDied`) and gets no more
    work; with no live lane left, waiting and new requests fail with :class:`NoLiveWorkers` (503).
    Without a pool the engine runs one batch at a time on a thread of this process, as it always
    did.

Shutdown
    :meth:`Engine.shutdown` stops accepting requests, lets the running batch finish and (by
    default) drains the queue before the worker stops; with a pool it then stops and joins every
    worker process.

Metrics
    :attr:`Engine.metrics` (:class:`~ditfuse.runtime.metrics.EngineMetrics`) records what only the
    engine sees: queue waits, batch sizes and durations, drops, quality mounts. Requests are counted
    by the HTTP layer, which also sees the ones refused before they reach the engine.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ..contracts.quality import Quality
from .metrics import EngineMetrics, LiveState, WorkerState
from .params import SamplingParams
from .pipelines import GUIDANCE_GUIDER, GUIDANCE_KWARG, NEGATIVE_CFG, NEGATIVE_TRUE_CFG, spec_for

if TYPE_CHECKING:
    from .workers import Worker, WorkerPool

logger = logging.getLogger("ditfuse.engine")


class EngineError(Exception):
    """Base of the engine's request errors; ``status`` is the HTTP status the server returns."""

    status = 500
    code = "engine_error"


class QueueFull(EngineError):
    status = 429
    code = "queue_full"


class EngineClosed(EngineError):
    status = 503
    code = "shutting_down"


class RequestTimeout(EngineError):
    status = 504
    code = "timeout"


class RequestDropped(EngineError):
    """The client disconnected before its request ran."""

    status = 499
    code = "client_closed_request"


class RequestCancelled(EngineError):
    """The request was cancelled (:meth:`Engine.cancel`) before it finished."""

    status = 409
    code = "cancelled"


class NoLiveWorkers(EngineError):
    """Every worker process of the engine's pool has died: nothing can run a batch."""

    status = 503
    code = "no_live_workers"


class BatchAbandoned(Exception):
    """Raised from the step callback to stop a pipeline call whose requests are all abandoned."""


@dataclass
class GeneratedImage:
    image: Any  # PIL.Image.Image
    index: int
    seed: int
    params: SamplingParams
    # The batch this image ran in and how many real images that batch had (for the access log:
    # a request's n images may span batches).
    batch_id: int | None = None
    batch_size: int | None = None
    # sites that ran their quality="high" (close) forward in that batch: 0 for a lossless batch,
    # and for a high one on a model with no close kernel or whose guards refused the tier
    close_sites: int = 0


# ---------------------------------------------------------------------------------------------
# One pipeline call for a list of (params, image index) slots. Shared by the engine and `generate`.


def _call_kwargs(pipe: Any) -> set[str]:
    try:
        return set(inspect.signature(pipe.__call__).parameters)
    except (TypeError, ValueError):
        return set()


class _StepCounter:
    """Progress for a pipeline without ``callback_on_step_end`` (HunyuanVideo 1.5): its
    scheduler's ``step`` is called once per denoising step, whatever its guidance does, so an
    instance attribute wrapping it reports ``on_step(i, total)`` for the duration of one call."""

    def __init__(self, pipe: Any, on_step: Callable[[int, int], None], total: int) -> None:
        self.scheduler = getattr(pipe, "scheduler", None)
        self.on_step, self.total, self.done = on_step, total, 0

    def start(self) -> None:
        sched = self.scheduler
        if sched is None or "step" in vars(sched):
            return
        inner = sched.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.on_step(self.done, self.total)
            self.done += 1
            return out

        sched.step = step

    def stop(self) -> None:
        if self.scheduler is not None:
            vars(self.scheduler).pop("step", None)


def run_batch(
    loaded: Any,
    slots: Sequence[tuple[SamplingParams, int]],
    pad_to: int | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run one pipeline call producing one image per slot; returns PIL images in slot order
    (for video params, ``num_frames`` set: one uint8 array ``(frames, height, width, 3)`` per slot).

    All slots must share a signature. ``pad_to`` appends copies of slot 0 until the call has that
    many images (their outputs are discarded); see the module docstring for why. ``on_step(i,
    total)`` is called after each denoising step (from ``callback_on_step_end``, or from the
    scheduler's ``step`` for a pipeline without one).
    """
    import torch

    if not slots:
        return []
    p0 = slots[0][0]
    pipe = loaded.pipe
    spec = getattr(loaded, "spec", None) or spec_for(type(pipe).__name__)
    sig = spec.batch_signature(p0, loaded.name)
    for p, _ in slots:
        if spec.batch_signature(p, loaded.name) != sig:
            raise ValueError("run_batch: slots with different signatures cannot share a pipeline call")
    real = len(slots)
    if spec.image_alone and p0.image is not None and real > 1:
        raise ValueError(f"run_batch: {spec.name} samples an input image's latents with the first video's generator, "
                         "so a call with an image runs one video")
    full = list(slots)
    if pad_to is not None and pad_to > real:
        full += [slots[0]] * (pad_to - real)
    accepted = _call_kwargs(pipe)
    gen_device = "cpu" if loaded.device == "cpu" else loaded.device
    kwargs: dict[str, Any] = {
        "prompt": [p.prompt for p, _ in full],
        "height": p0.height,
        "width": p0.width,
        "num_inference_steps": p0.num_inference_steps,
        "generator": [torch.Generator(device=gen_device).manual_seed(p.seed + i) for p, i in full],
        "num_images_per_prompt": 1,
        "output_type": "pil",
    }
    if spec.guidance == GUIDANCE_KWARG:
        kwargs["guidance_scale"] = p0.guidance_scale
    capabilities = getattr(loaded, "capabilities", None)
    if p0.guidance_scale_2 is not None:
        # Wan 2.2 A14B's low-noise expert; the request parsers refused it for any other checkpoint
        refused = spec.check_request({"guidance_scale_2"}, capabilities)
        if refused:
            raise ValueError(refused[1])
        kwargs[spec.guidance_2_kwarg] = p0.guidance_scale_2
    negatives = any(p.negative_prompt for p, _ in full)
    if spec.negative == NEGATIVE_TRUE_CFG:
        if p0.uses_true_cfg:
            kwargs["negative_prompt"] = [p.negative_prompt for p, _ in full]
            kwargs["true_cfg_scale"] = p0.true_cfg_scale
    elif spec.negative == NEGATIVE_CFG:
        if negatives:
            # the pipelines' own default negative prompt is "" (used whenever guidance is on)
            kwargs["negative_prompt"] = [p.negative_prompt or "" for p, _ in full]
    elif negatives:
        raise ValueError(spec.check_request({"negative_prompt"})[1])
    # -- video: frames as float arrays ----------------------------------------------------------
    # An image request on a video model is a one-frame clip (Wan is trained on images too).
    video = p0.num_frames is not None
    still = not video and getattr(loaded, "is_video", False)
    if video or still:
        del kwargs["num_images_per_prompt"]
        kwargs.update(num_frames=p0.num_frames or 1, num_videos_per_prompt=1, output_type="np")
        if spec.fps_kwarg is not None and getattr(loaded, "fps", None):
            # LTX-Video: the frame rate scales its RoPE in time; the clip is written at loaded.fps
            kwargs[spec.fps_kwarg] = loaded.fps
    # -- image-to-video: one image per slot, or the one image every slot starts from (equal
    # signatures: equal pixel fingerprints) -------------------------------------------------------
    for p, _ in slots:
        why = spec.check_image(p.image is not None)
        if why is None and (p.image is not None or p.mask is not None):
            why = spec.check_mask(p.mask is not None)
        if why is not None:
            raise ValueError(why)
    if spec.area_kwarg is not None:
        kwargs[spec.area_kwarg] = p0.width * p0.height
    if spec.image_kwarg is not None and p0.image is not None:
        from .inputs import fit_image_to_size, open_image

        def image_for_call(p: SamplingParams) -> Any:
            # a pipeline that derives its size from the image (no height / width in its call) gets
            # the image fitted so that it makes the request's size (checked); others the image
            return fit_image_to_size(loaded, open_image(p.image, p.image_sha256), p.width, p.height)

        def mask_for_call(p: SamplingParams) -> Any:
            # in diffusers' convention (white = repaint); the pipeline resizes it with the image
            from .inputs import open_mask

            return open_mask(p.mask, p.mask_sha256)

        if spec.image_per_sample:
            opened: dict[str | None, Any] = {}
            masks: dict[str | None, Any] = {}
            for p, _ in full:
                if p.image_sha256 not in opened:
                    opened[p.image_sha256] = image_for_call(p)
                if spec.mask_kwarg is not None and p.mask_sha256 not in masks:
                    masks[p.mask_sha256] = mask_for_call(p)
            kwargs[spec.image_kwarg] = [opened[p.image_sha256] for p, _ in full]
            if spec.mask_kwarg is not None:
                kwargs[spec.mask_kwarg] = [masks[p.mask_sha256] for p, _ in full]
        else:
            kwargs[spec.image_kwarg] = image_for_call(p0)
            if spec.mask_kwarg is not None:  # equal signatures: the one mask of every slot
                kwargs[spec.mask_kwarg] = mask_for_call(p0)
    # -- first-last-frame: the one last image of the call (equal signatures: equal fingerprints).
    # It goes as it is, as the first image does: the pipeline resizes both to height x width with
    # its video_processor (no pipeline with a last image derives its size from the image).
    for p, _ in slots:
        why = spec.check_last_image(capabilities, p.last_image is not None)
        if why is not None:
            raise ValueError(why)
    if p0.last_image is not None:
        from .inputs import open_image as open_last

        kwargs[spec.last_image_kwarg] = open_last(p0.last_image, p0.last_image_sha256)
    # -------------------------------------------------------------------------------------------
    kwargs.update(loaded.call_kwargs)
    steps_counted = None
    if on_step is not None:
        total = p0.num_inference_steps
        if "callback_on_step_end" in accepted:

            def _cb(_pipe: Any, i: int, _t: Any, cb_kwargs: dict[str, Any]) -> dict[str, Any]:
                on_step(i, total)
                return {}

            kwargs["callback_on_step_end"] = _cb
            kwargs["callback_on_step_end_tensor_inputs"] = []
        else:
            steps_counted = _StepCounter(pipe, on_step, total)
    if accepted:
        dropped = [k for k in kwargs if k not in accepted]
        if "negative_prompt" in dropped:
            raise ValueError(f"{type(pipe).__name__} does not take a negative_prompt")
        for k in (spec.guidance_2_kwarg, spec.last_image_kwarg, spec.mask_kwarg):
            if k is not None and k in dropped:  # what a request asked for is never dropped silently
                raise ValueError(f"{type(pipe).__name__} does not take {k}")
        for k in dropped:
            kwargs.pop(k)
    # no_grad, as diffusers' pipelines themselves: under inference_mode every tensor is an
    # inference tensor without a version counter, and the cross-block hand-off and the RoPE table
    # cache (models/handoff.py, models/pos_cache.py), which rely on it, would stand down.
    guider = getattr(pipe, "guider", None) if spec.guidance == GUIDANCE_GUIDER else None
    saved_scale = guider.guidance_scale if guider is not None else None
    try:
        if guider is not None:
            # HunyuanVideo 1.5 reads its scale from the guider component: set for this call only
            guider.guidance_scale = p0.guidance_scale
        if steps_counted is not None:
            steps_counted.start()
        with torch.no_grad():
            out = pipe(**kwargs)
    finally:
        if guider is not None:
            guider.guidance_scale = saved_scale
        if steps_counted is not None:
            steps_counted.stop()
    if video or still:
        from .video_io import frames_to_uint8

        clips = [frames_to_uint8(v) for v in out.frames[:real]]
        made = {c.shape[1:3] for c in clips}
        if spec.size_from_image is not None and made != {(p0.height, p0.width)}:
            # the call was given no size: the job and the file's metadata report the request's,
            # which must be the clip's true size
            raise ValueError(f"{type(pipe).__name__} made {' and '.join(f'{w}x{h}' for h, w in sorted(made))} "
                             f"frames for a {p0.width}x{p0.height} request")
        if still:
            from PIL import Image

            return [Image.fromarray(c[0]) for c in clips]
        return clips
    return list(out.images[:real])


def mounted_sites(pipe: Any) -> list[str]:
    """The sites running their quality="high" forward on any component of ``pipe`` ("comp/path:site")."""
    import torch

    from ..models import mounted_sites as _mounted

    comps = getattr(pipe, "components", {}) or {}
    out = []
    for name, mod in comps.items():
        if isinstance(mod, torch.nn.Module):
            out += [f"{name}/{s}" for s in _mounted(mod)]
    return sorted(out)


def transition_info(before: Quality, to: Quality, results: Mapping[str, Any] | None) -> dict[str, Any]:
    """The batch log's record of a tier switch from ``handle.set_quality``'s results (one
    ``MountResult`` per component): what each component mounted, unmounted or why it failed.
    Plain data, so a worker process can send it to the engine as it is."""
    return {
        "from": before.value,
        "to": to.value,
        "result": {
            k: {"mounted": list(v.mounted), "unmounted": list(v.unmounted), "failed": str(v.failed) if v.failed else None}
            for k, v in (results or {}).items()
        },
    }


def transition_results(info: Mapping[str, Any] | None) -> dict[str, Any]:
    """:func:`transition_info`'s ``result`` back as objects with ``mounted`` / ``unmounted``
    (what :meth:`EngineMetrics.observe_transition` reads)."""
    return {k: SimpleNamespace(**v) for k, v in ((info or {}).get("result") or {}).items()}


# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    id: int
    params: SamplingParams
    signature: tuple
    future: asyncio.Future
    enqueued: float
    deadline: float
    started: float | None = None  # when its first batch started (queue wait ends)
    next_index: int = 0
    results: dict[int, GeneratedImage] = field(default_factory=dict)
    abandoned: str | None = None  # "disconnected" | "timeout" | "cancelled" | ...
    # Called on the event loop after each denoising step of a batch this request is in: (done, total).
    on_progress: Callable[[int, int], None] | None = None

    @property
    def remaining(self) -> int:
        return self.params.n - self.next_index

    @property
    def is_video(self) -> bool:
        return self.params.num_frames is not None


class Engine:
    """Owns the loaded pipeline and its acceleration handle; batches and runs requests."""

    def __init__(
        self,
        loaded: Any,
        handle: Any = None,
        *,
        max_batch_size: int = 4,
        batch_wait_ms: float = 10.0,
        max_queue: int = 256,
        request_timeout_s: float = 600.0,
        pad_batches: bool = True,
        default_quality: "str | Quality" = Quality.LOSSLESS,
        batch_log_limit: int = 10000,
        quality_switch_wait_ms: float = 500.0,
        runner: Callable[..., list[Any]] = run_batch,
        max_video_batch_size: int = 1,
        image_batches_per_video: int = 4,
        pool: "WorkerPool | None" = None,
    ) -> None:
        """``loaded`` / ``handle``: the in-process pipeline and its acceleration handle. With
        ``pool`` (a started :class:`~ditfuse.runtime.workers.WorkerPool`) batches run in its worker
        processes instead: ``loaded`` is then ``pool.loaded`` (the model's description, no
        pipeline), ``handle`` must be None and ``runner`` the default (a worker runs the pool's
        runner); the engine owns the pool and closes it in :meth:`shutdown`."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if max_video_batch_size < 1:
            raise ValueError("max_video_batch_size must be >= 1")
        if image_batches_per_video < 0:
            raise ValueError("image_batches_per_video must be >= 0")
        self.max_video_batch_size = int(max_video_batch_size)
        self.image_batches_per_video = int(image_batches_per_video)
        # Image batches run while a video job waited, since the last video batch (see "Videos").
        self._image_batches_since_video = 0
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if pool is not None:
            if handle is not None:
                raise ValueError("Engine: with a worker pool the workers hold the acceleration handles; pass handle=None")
            if runner is not run_batch:
                raise ValueError("Engine: with a worker pool the runner runs in the workers (WorkerPool(runner=...))")
            if not pool.workers:
                raise ValueError("Engine: the worker pool has not been started")
        self.pool = pool
        # Lanes of a pool: the workers, each running one batch at a time (module docstring).
        self._busy: set[int] = set()  # indices of workers running a batch
        self._running: dict[int, tuple[list[_Request], "Worker"]] = {}  # batch id -> (requests, worker)
        self.loaded = loaded
        # how its pipeline class is called (which requests may share a call)
        self._spec = getattr(loaded, "spec", None) or spec_for(type(loaded.pipe).__name__)
        self.handle = handle
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_s = max(0.0, float(batch_wait_ms)) / 1000.0
        self.quality_switch_wait_s = max(0.0, float(quality_switch_wait_ms)) / 1000.0
        self.max_queue = int(max_queue)
        self.request_timeout_s = float(request_timeout_s)
        self.pad_batches = bool(pad_batches)
        self.default_quality = Quality.parse(default_quality)
        self.metrics = EngineMetrics(live=self._live_state)
        self.batch_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=batch_log_limit)
        self._runner = runner
        self._pending: list[_Request] = []
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closing = False
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def quality(self) -> str | None:
        """The tier mounted now: the handle's; with a pool, the tier every live worker has mounted
        (None when they differ, none is alive, or acceleration is off)."""
        if self.pool is None:
            return None if self.handle is None else self.handle.quality.value
        tiers = {w.quality for w in self.pool.workers if w.alive}
        if len(tiers) != 1:
            return None
        q = tiers.pop()
        return None if q is None else q.value

    def worker_states(self) -> list[WorkerState]:
        """One entry per worker of the pool (empty without one): index, device, alive, tier, busy."""
        if self.pool is None:
            return []
        return [
            WorkerState(
                worker=w.index,
                device=w.device,
                up=w.alive,
                quality=None if w.quality is None else w.quality.value,
                busy=w.index in self._busy,
            )
            for w in self.pool.workers
        ]

    def _live_state(self) -> LiveState:
        return LiveState(
            queue_depth=len(self._pending),
            images_in_flight=self._in_flight,
            quality=self.quality,
            qualities=tuple(q.value for q in Quality),
            workers=tuple(self.worker_states()),
        )

    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if self.pool is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ditfuse-engine")
            self._task = asyncio.create_task(self._scheduler(), name="ditfuse-scheduler")
        else:
            loop = self._loop
            # A worker's reader thread reports its exit: wake the scheduler (on the loop) so it
            # stops offering that lane work, or fails the queue when no lane is left.
            self.pool.add_exit_listener(lambda w: loop.call_soon_threadsafe(self._on_worker_exit, w))
            self._task = asyncio.create_task(self._pool_scheduler(), name="ditfuse-scheduler")

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting requests; finish the running batch and, if ``drain``, the queue."""
        self._closing = True
        if not drain:
            for r in self._pending:
                if not r.future.done():
                    r.future.set_exception(EngineClosed("server is shutting down"))
            self._pending.clear()
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)

    # -- requests ----------------------------------------------------------------------------

    async def submit(
        self,
        params: SamplingParams,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        timeout_s: float | None = None,
    ) -> list[GeneratedImage]:
        """Queue ``params`` and wait for its images.

        Raises QueueFull, EngineClosed, RequestTimeout, RequestDropped (client went away) or the
        pipeline's own exception.
        """
        return await self.wait(self.enqueue(params, timeout_s=timeout_s), is_disconnected)

    def enqueue(
        self,
        params: SamplingParams,
        timeout_s: float | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> _Request:
        """Queue ``params`` now (raises QueueFull / EngineClosed at once); :meth:`wait` for it.

        Must be called on the engine's event loop. ``on_progress(done, total)`` is called there
        after each denoising step of the batch the request runs in."""
        if self._task is None:
            raise EngineClosed("engine is not running")
        if self._closing:
            raise EngineClosed("server is shutting down")
        if len(self._pending) >= self.max_queue:
            raise QueueFull(f"queue is full ({self.max_queue} requests waiting); retry later")
        if self.pool is not None and not self.pool.live():
            raise NoLiveWorkers(self._no_workers_message())
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        req = _Request(
            id=next(self._ids),
            params=params,
            signature=self._spec.batch_signature(params, self.loaded.name),
            future=loop.create_future(),
            enqueued=now,
            deadline=now + timeout,
            on_progress=on_progress,
        )
        self._pending.append(req)
        self._wake.set()
        return req

    async def wait(
        self, req: _Request, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> list[GeneratedImage]:
        """Wait for a request from :meth:`enqueue`; raises as :meth:`submit` does, or
        RequestCancelled after :meth:`cancel`."""
        timeout = req.deadline - req.enqueued
        try:
            while True:
                left = req.deadline - time.monotonic()
                if left <= 0:
                    req.abandoned = "timeout"
                    raise RequestTimeout(f"request did not finish within {timeout:g} s")
                step = left if is_disconnected is None else min(left, 0.1)
                done, _ = await asyncio.wait({req.future}, timeout=step)
                if done:
                    break
                if is_disconnected is not None and await is_disconnected():
                    req.abandoned = "disconnected"
                    raise RequestDropped("client disconnected")
        except asyncio.CancelledError:
            req.abandoned = req.abandoned or "disconnected"
            raise
        images = req.future.result()
        self.metrics.latency.observe(time.monotonic() - req.enqueued)
        return images

    def cancel(self, req: _Request, reason: str = "cancelled") -> bool:
        """Cancel a request from :meth:`enqueue`: a waiting one never runs; a running one's batch
        stops at its next step once every request in it is cancelled or abandoned (batch-mates
        still get their results). Its waiter gets RequestCancelled. False if it already finished."""
        if req.future.done():
            return False
        req.abandoned = reason
        req.future.set_exception(RequestCancelled(f"request {reason}"))
        req.future.exception()  # retrieved: the waiter may be gone already
        # A worker process cannot look at our requests from its step callback: tell the worker
        # running this request's batch to stop at its next step once every request in it is gone.
        for batch_id, (reqs, worker) in list(self._running.items()):
            if req in reqs and all(r.abandoned is not None for r in reqs):
                worker.stop(batch_id, _abandon_reason(reqs))
        if self._wake is not None:
            self._wake.set()
        return True

    def is_waiting(self, req: _Request) -> bool:
        """True while ``req`` is queued and none of it has started running."""
        return req.next_index == 0 and req in self._pending

    # -- scheduler ---------------------------------------------------------------------------

    def _drop_abandoned(self) -> None:
        now = time.monotonic()
        keep = []
        for r in self._pending:
            if r.abandoned is None and now >= r.deadline:
                r.abandoned = "timeout"
            if r.abandoned is not None:
                if not r.future.done():
                    r.future.set_exception(RequestDropped(f"dropped before running ({r.abandoned})"))
                    r.future.exception()  # mark retrieved: nobody may be waiting any more
                self.metrics.queue_dropped.labels(reason=r.abandoned).inc()
                continue
            keep.append(r)
        self._pending[:] = keep

    def _available(self, sig: tuple) -> int:
        return sum(r.remaining for r in self._pending if r.signature == sig)

    def _kind_pool(self) -> list[_Request]:
        """The waiting requests of the kind the next batch takes (module docstring, "Videos"):
        images while fewer than ``image_batches_per_video`` image batches ran since a video job
        started waiting, else videos."""
        pool = self._pending
        videos = [r for r in pool if r.is_video]
        if videos and len(videos) < len(pool):  # both kinds wait
            if self._image_batches_since_video >= self.image_batches_per_video:
                pool = videos
            else:
                pool = [r for r in pool if not r.is_video]
        return pool

    def _next_request(self, lane: "Worker | None" = None) -> "_Request":
        """The request whose signature the next batch takes: within the kind (:meth:`_kind_pool`),
        the oldest request, unless another tier than the mounted one (the handle's, or ``lane``'s
        with a pool) would force a switch while same-tier work waits and the oldest request has
        not yet waited ``quality_switch_wait_ms``."""
        pool = self._kind_pool()
        oldest = pool[0]
        if lane is not None:
            current = lane.quality
        else:
            current = None if self.handle is None else self.handle.quality
        if current is None or oldest.params.quality is current:
            return oldest
        if time.monotonic() - oldest.enqueued >= self.quality_switch_wait_s:
            return oldest
        return next((r for r in pool if r.params.quality is current), oldest)

    def _batch_cap(self, params: SamplingParams) -> int:
        if params.image is not None and self._spec.image_alone:
            # the call samples the image's latents with the first video's generator: one video
            # per call, unpadded (every such call alike, so no clip depends on batch-mates)
            return 1
        return self.max_video_batch_size if params.num_frames is not None else self.max_batch_size

    async def _scheduler(self) -> None:
        assert self._wake is not None
        while True:
            self._drop_abandoned()
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            first = self._next_request()
            sig = first.signature
            cap = self._batch_cap(first.params)
            await self._wait_for_mates(first, cap)
            self._drop_abandoned()
            slots = self._take_slots(sig, cap)
            if not slots:
                continue
            await self._run(slots)

    async def _wait_for_mates(self, first: _Request, cap: int) -> None:
        """Wait until ``cap`` images of ``first``'s signature wait, or ``batch_wait_ms`` after
        ``first`` arrived, or shutdown begins."""
        assert self._wake is not None
        sig = first.signature
        fill_deadline = first.enqueued + self.batch_wait_s
        while not self._closing and self._available(sig) < cap:
            left = fill_deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=left)
            except asyncio.TimeoutError:
                break

    def _take_slots(self, sig: tuple, cap: int) -> list[tuple[_Request, int]]:
        """Up to ``cap`` images of signature ``sig``, oldest request first (a request's images in
        order); requests whose images are all taken leave the queue."""
        slots: list[tuple[_Request, int]] = []
        for r in list(self._pending):
            if r.signature != sig:
                continue
            while r.remaining and len(slots) < cap:
                slots.append((r, r.next_index))
                r.next_index += 1
            if r.remaining == 0:
                self._pending.remove(r)
            if len(slots) >= cap:
                break
        return slots

    # -- scheduler with a worker pool: one batch per idle live lane ----------------------------

    def _pick(self, idle: list["Worker"]) -> tuple["Worker", _Request]:
        """The lane and request of the next batch (module docstring, "Several devices"): an idle
        lane with the oldest request's tier mounted, else the first idle lane; the request by that
        lane's tier (:meth:`_next_request`)."""
        oldest = self._kind_pool()[0]
        lane = min(idle, key=lambda w: (w.quality not in (None, oldest.params.quality), w.index))
        return lane, self._next_request(lane)

    async def _pool_scheduler(self) -> None:
        assert self._wake is not None and self.pool is not None
        running: set[asyncio.Task] = set()
        while True:
            self._drop_abandoned()
            if self._pending and not self.pool.live():
                self._fail_pending(NoLiveWorkers(self._no_workers_message()))
            idle = [w for w in self.pool.live() if w.index not in self._busy]
            if not self._pending or not idle:
                if not self._pending and self._closing:
                    if running:
                        await asyncio.gather(*running, return_exceptions=True)
                        continue  # a failed batch may leave nothing pending; look once more
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            lane, first = self._pick(idle)
            sig = first.signature
            cap = self._batch_cap(first.params)
            await self._wait_for_mates(first, cap)
            self._drop_abandoned()
            if not lane.alive or lane.index in self._busy:
                continue  # it died while we waited for mates: pick again
            slots = self._take_slots(sig, cap)
            if not slots:
                continue
            self._busy.add(lane.index)
            task = asyncio.create_task(self._run(slots, lane), name=f"ditfuse-batch-worker{lane.index}")
            running.add(task)
            task.add_done_callback(lambda t, i=lane.index: self._lane_done(t, i, running))

    def _lane_done(self, task: asyncio.Task, index: int, running: set[asyncio.Task]) -> None:
        running.discard(task)
        self._busy.discard(index)
        if not task.cancelled() and task.exception() is not None:  # _run handles batch errors itself
            logger.error("batch task on worker %d failed", index, exc_info=task.exception())
        if self._wake is not None:
            self._wake.set()

    def _fail_pending(self, error: EngineError) -> None:
        for r in self._pending:
            if not r.future.done():
                r.future.set_exception(error)
                r.future.exception()  # retrieved: the waiter may be gone already
        self._pending.clear()

    def _no_workers_message(self) -> str:
        assert self.pool is not None
        dead = "; ".join(w.exit_description() for w in self.pool.workers)
        return f"no live worker left to run requests ({dead})"

    def _on_worker_exit(self, worker: "Worker") -> None:
        """On the loop, after a worker process ended (killed, crashed, or stopped at shutdown)."""
        if not self._closing:
            left = len(self.pool.live()) if self.pool is not None else 0
            logger.error("%s; %d of %d workers left", worker.exit_description(), left, len(self.pool.workers))
        if self._wake is not None:
            self._wake.set()

    def _run_sync(
        self,
        quality: Quality,
        slots: list[tuple[SamplingParams, int]],
        on_step: Callable[[int, int], None] | None = None,
    ) -> tuple[list[Any], dict]:
        info: dict[str, Any] = {"transition": None}
        if self.handle is not None and self.handle.quality != quality:
            before = self.handle.quality
            res = self.handle.set_quality(quality)
            info["transition"] = transition_info(before, quality, res)
            # Count only what really changed: on a machine where no request-gated kernel can
            # mount (no CUDA, or a failing guard) the switch mounts nothing.
            self.metrics.observe_transition(res)
        info["mounted"] = mounted_sites(self.loaded.pipe)
        info["handle_quality"] = None if self.handle is None else self.handle.quality.value
        pad_to = self._batch_cap(slots[0][0]) if self.pad_batches else None
        t0 = time.perf_counter()
        step_kw = {} if on_step is None else {"on_step": on_step}
        images = self._runner(self.loaded, slots, pad_to=pad_to, **step_kw)
        info["seconds"] = time.perf_counter() - t0
        info["padded_to"] = max(len(slots), pad_to or 0)
        return images, info

    async def _run(self, slots: list[tuple[_Request, int]], worker: "Worker | None" = None) -> None:
        """Run one batch (in this process, or on ``worker``) and settle its requests."""
        batch_id = next(self._batch_ids)
        quality = slots[0][0].params.quality
        reqs = list(dict.fromkeys(r for r, _ in slots))
        now = time.monotonic()
        for r in reqs:
            if r.started is None:
                r.started = now
                self.metrics.queue_wait.observe(now - r.enqueued)
        self._in_flight += len(slots)
        loop = asyncio.get_running_loop()
        entry: dict[str, Any] = {
            "batch_id": batch_id,
            "size": len(slots),
            "quality": quality.value,
            "requests": [r.id for r in reqs],
            "signature": list(slots[0][0].signature),
            "worker": None if worker is None else worker.index,
            "device": getattr(self.loaded, "device", None) if worker is None else worker.device,
        }
        is_video = slots[0][0].is_video
        on_step = self._step_hook(reqs) if is_video else None
        if is_video:  # progress 0 of N: the batch has started
            for r in reqs:
                if r.on_progress is not None:
                    r.on_progress(0, r.params.num_inference_steps)
        try:
            if worker is None:
                images, info = await loop.run_in_executor(
                    self._executor, self._run_sync, quality, [(r.params, i) for r, i in slots], on_step
                )
            else:
                self._running[batch_id] = (reqs, worker)
                pad_to = self._batch_cap(slots[0][0].params) if self.pad_batches else None
                images, info = await worker.run(batch_id, quality, [(r.params, i) for r, i in slots], pad_to, on_step)
                # The worker switched its tier before the batch (if it had to): count it here.
                if info["transition"] is not None:
                    self.metrics.observe_transition(transition_results(info["transition"]))
        except Exception as e:  # the pipeline failed: fail every request of this batch
            if getattr(e, "transition", None) is not None:  # a worker switched tiers before it failed
                self.metrics.observe_transition(transition_results(e.transition))
            self._count_kind(is_video)
            outcome = "error"
            if isinstance(e, BatchAbandoned):  # every request in it was cancelled or timed out
                e, outcome = RequestDropped(f"stopped while running ({e})"), "stopped_abandoned"
                self.metrics.queue_dropped.labels(reason=outcome).inc(len(reqs))
            entry.update(error=f"{type(e).__name__}: {e}")
            self.batch_log.append(entry)
            for r in reqs:
                if not r.future.done():
                    r.future.set_exception(e)
                    r.future.exception()
                if r in self._pending:
                    self._pending.remove(r)
            if outcome == "error":
                self.metrics.batch_errors.inc()
            return
        finally:
            self._in_flight -= len(slots)
            self._running.pop(batch_id, None)
        self._count_kind(is_video)
        entry.update(
            mounted=info["mounted"],
            handle_quality=info["handle_quality"],
            transition=info["transition"],
            padded_to=info["padded_to"],
            seconds=round(info["seconds"], 6),
        )
        self.batch_log.append(entry)
        self.metrics.observe_batch(len(slots), quality.value, info["seconds"], video=is_video)
        for (r, i), img in zip(slots, images):
            r.results[i] = GeneratedImage(
                image=img, index=i, seed=r.params.seed + i, params=r.params, batch_id=batch_id, batch_size=len(slots),
                close_sites=len(info["mounted"] or ()),
            )
            if len(r.results) == r.params.n and not r.future.done():
                r.future.set_result([r.results[k] for k in range(r.params.n)])

    def _count_kind(self, was_video: bool) -> None:
        """Fairness bookkeeping after a batch (module docstring, "Videos")."""
        if was_video:
            self._image_batches_since_video = 0
        elif any(r.is_video for r in self._pending):
            self._image_batches_since_video += 1

    def _step_hook(self, reqs: list[_Request]) -> Callable[[int, int], None]:
        """The per-step callback of a video batch (runs on the worker thread): forwards progress
        to each live request on the loop, and stops the call once every request is abandoned."""
        loop = self._loop

        def on_step(i: int, total: int) -> None:
            for r in reqs:
                if r.on_progress is not None and r.abandoned is None:
                    loop.call_soon_threadsafe(r.on_progress, i + 1, total)
            if all(r.abandoned is not None for r in reqs):
                raise BatchAbandoned(_abandon_reason(reqs))

        return on_step

    # -- metrics -----------------------------------------------------------------------------

    def prometheus(self) -> bytes:
        """/metrics in Prometheus text format (see :mod:`ditfuse.runtime.metrics`)."""
        return self.metrics.render()


def _abandon_reason(reqs: Sequence[_Request]) -> str:
    return ", ".join(sorted({str(r.abandoned) for r in reqs}))
