"""OpenAI-compatible images server (FastAPI + uvicorn).

Routes
    POST /v1/images/generations   OpenAI request schema (model, prompt, n, size, response_format,
                                  quality) plus seed, num_inference_steps, guidance_scale,
                                  guidance_scale_2 (Wan 2.2 A14B), negative_prompt,
                                  true_cfg_scale, output_format.
    POST /v1/images/edits         image-editing models (FluxKontextPipeline; FluxFillPipeline, which
                                  inpaints): the same fields plus the image to edit (multipart
                                  ``image``, as the openai client's ``images.edit`` sends it, or
                                  JSON ``{"image_url": data URL}``), and for inpainting its ``mask``
                                  (the same ways; OpenAI's convention: alpha 0 = edit here).
    GET  /v1/models               the one model this server runs.
    GET  /health                  liveness/readiness (never needs the API key); with worker
                                  processes (``--gpus N``) also each worker's device, state, tier.
    GET  /metrics                 Prometheus text (prometheus_client): requests by outcome and
                                  status, queue wait / generation / latency histograms, batch
                                  sizes, quality mounts/unmounts (see runtime/metrics.py).
    GET  /v1/debug/batches        the engine's recent batch log (batch id, size, quality, mounted
                                  request-gated sites).
    /v1/videos...                 the OpenAI videos API (video models): ditfuse/runtime/videos.py.

quality
    ``lossless`` (bit-exact kernels only) and ``high`` (adds the request-gated close kernels) are
    ditfuse's tiers. OpenAI's own values are accepted too: ``auto`` and ``standard`` mean the
    server's ``--default-quality``; ``hd`` means ``high``; ``low`` and ``medium`` mean
    ``lossless`` (ditfuse has no lower-fidelity tier than eager diffusers, and these ask for
    nothing better). Anything else is a 400 listing the allowed values.

Strict requests
    Like OpenAI's API, a request field this server does not know is a 400 naming it
    (``code="unknown_parameter"``), not silently ignored: a typo such as ``num_inference_step``
    would otherwise run 28 steps without a word. The accepted fields are :data:`REQUEST_FIELDS`.
    The body must be sent as JSON (``Content-Type: application/json``; 415 otherwise).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 invalid
parameters, 401 missing/wrong API key, 404 unknown model or route, 413 body too large, 415 not
JSON, 429 queue full, 499 client went away, 503 shutting down, 504 request timeout, 500 pipeline
failure.

Logs
    One access-log line per request on the ``ditfuse.access`` logger (client, method, path,
    status, milliseconds, and for generations the quality, batch size(s) and image count; the
    prompt only with ``log_prompts=True``), and on shutdown one line on ``ditfuse.server`` saying
    how many requests were in flight when it began and how many of them finished.

Security: binds 127.0.0.1 unless told otherwise; ``--api-key`` requires ``Authorization: Bearer
<key>`` on every route except /health; request bodies over ``max_body_bytes`` are refused with 413
before they reach the app.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import itertools
import json
import logging
import time
from collections.abc import Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

# FastAPI resolves handler annotations from this module's globals (``from __future__ import
# annotations`` makes them strings), so these must be module-level imports.
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..contracts.quality import Quality
from .engine import Engine, EngineError
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import EngineMetrics
from .params import ParamError, SamplingParams, applied_quality
from .pipelines import PIPELINE_SPECS

access_logger = logging.getLogger("ditfuse.access")
server_logger = logging.getLogger("ditfuse.server")

GENERATIONS_PATH = "/v1/images/generations"
EDITS_PATH = "/v1/images/edits"
# Fields of POST /v1/images/generations: OpenAI's that this server honours (``user`` is accepted
# and ignored, as it only tags the end user for OpenAI's abuse monitoring), then ditfuse's
# documented extensions. Anything else is a 400 naming the field.
OPENAI_FIELDS = ("model", "prompt", "n", "size", "quality", "response_format", "output_format", "user")
EXTENSION_FIELDS = ("seed", "num_inference_steps", "guidance_scale", "guidance_scale_2", "negative_prompt",
                    "true_cfg_scale", "width", "height")
REQUEST_FIELDS = frozenset(OPENAI_FIELDS + EXTENSION_FIELDS)
# OpenAI image parameters that ditfuse does not implement: named as such in the 400's message.
UNSUPPORTED_OPENAI_FIELDS = frozenset(
    {"style", "background", "moderation", "output_compression", "partial_images", "stream", "input_fidelity", "mask"}
)
# Fields of a multipart POST /v1/images/edits that are numbers (form values arrive as text).
_INT_FIELDS = ("n", "seed", "num_inference_steps", "width", "height")
_FLOAT_FIELDS = ("guidance_scale", "guidance_scale_2", "true_cfg_scale")
# The key in the ASGI scope under which the layers of one request leave what the access log and
# the request counter need (error code, quality, batch sizes); a dict shared by reference.
SCOPE_KEY = "ditfuse.request"

OPENAI_QUALITY_ALIASES = {"hd": Quality.HIGH, "low": Quality.LOSSLESS, "medium": Quality.LOSSLESS}
DEFAULT_QUALITY_ALIASES = ("auto", "standard")
ALLOWED_QUALITY = [q.value for q in Quality] + list(DEFAULT_QUALITY_ALIASES) + list(OPENAI_QUALITY_ALIASES)
DEFAULT_MAX_BODY_BYTES = 1 << 20


def default_max_body_bytes(engine: Any) -> int:
    """The body limit a server gets when it names none: 1 MiB, plus room for one input image
    (runtime/inputs.MAX_INPUT_BYTES, base64 included) on an image-to-video model, and for a second
    one where the checkpoint takes a last image, or the pipeline a mask."""
    from .inputs import MAX_INPUT_BYTES
    from .pipelines import LAST_IMAGE_NONE

    images = int(engine.loaded.spec.takes_image)
    capabilities = getattr(engine.loaded, "capabilities", None)
    if images and capabilities is not None and capabilities.last_image != LAST_IMAGE_NONE:
        images += 1
    if engine.loaded.spec.takes_mask:
        images += 1
    return DEFAULT_MAX_BODY_BYTES + images * (MAX_INPUT_BYTES * 4 // 3)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}


def quality_applied(images: Iterable[Any]) -> str:
    """What ran for a request's images (``GeneratedImage.close_sites`` of their batches): "high"
    when every batch ran close kernels, "lossless" when none did -- a lossless request, or a high one
    on a model without close kernels or whose guards refused the tier (the output is then bitwise
    diffusers') -- and "mixed" otherwise."""
    ran = {applied_quality(g.close_sites) for g in images}
    return ran.pop() if len(ran) == 1 else "lossless" if not ran else "mixed"


def parse_quality(value: Any, default: Quality) -> Quality:
    """Map an OpenAI-or-ditfuse quality value to a tier (see the module docstring)."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise ParamError("quality", f"quality must be a string; allowed values: {', '.join(ALLOWED_QUALITY)}")
    v = value.strip().lower()
    if v in DEFAULT_QUALITY_ALIASES:
        return default
    if v in OPENAI_QUALITY_ALIASES:
        return OPENAI_QUALITY_ALIASES[v]
    try:
        return Quality.parse(v)
    except ValueError:
        raise ParamError("quality", f"unknown quality {value!r}; allowed values: {', '.join(ALLOWED_QUALITY)}") from None


def check_fields(body: dict) -> None:
    """Refuse fields this server does not know (400 naming the first, listing all), as OpenAI's
    API does: ignoring them would let a misspelt parameter fall back to its default silently."""
    unknown = [k for k in body if k not in REQUEST_FIELDS]
    if not unknown:
        return
    first = unknown[0]
    names = ", ".join(repr(k) for k in unknown)
    if first == "mask":
        # OpenAI's mask belongs to an edit, beside the image it masks (FLUX.1 Fill takes one there)
        msg = ("Unsupported parameter: 'mask' is not a generations parameter; send it with its image to "
               f"POST {EDITS_PATH} (a model that takes masks: FluxFillPipeline).")
    elif first in UNSUPPORTED_OPENAI_FIELDS:
        msg = f"Unsupported parameter: {first!r} is an OpenAI images parameter that ditfuse does not implement."
    else:
        msg = f"Unknown parameter{'s' if len(unknown) > 1 else ''}: {names}."
    msg += f" Accepted: {', '.join(OPENAI_FIELDS + EXTENSION_FIELDS)}."
    raise APIError(400, msg, first, "unknown_parameter")


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` (any parameters, e.g. charset) or a ``+json`` structured suffix."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def parse_generation_request(body: Any, engine: Engine, image: Any = None, mask: Any = None) -> SamplingParams:
    """Validate an images/generations body (or, with ``image``, an images/edits one: the decoded
    input image, and ``mask``, its inpainting mask already converted by inputs.mask_from_image) into
    SamplingParams (raises ParamError / APIError). With an image (and a mask) the params carry their
    fingerprints; the caller stores them and sets ``image`` (``mask``) to the files."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    check_fields(body)
    model = body.get("model")
    if model is not None and model not in (engine.model_name, "ditfuse"):
        raise APIError(404, f"model {model!r} is not served here; this server runs {engine.model_name!r}", "model", "model_not_found")
    fmt = body.get("response_format")
    if fmt not in (None, "b64_json"):
        raise ParamError("response_format", f"response_format {fmt!r} is not supported; use 'b64_json'")
    quality = parse_quality(body.get("quality"), engine.default_quality)
    loaded = engine.loaded
    spec = loaded.spec
    refused = spec.check_request({k for k in ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "negative_prompt")
                                  if body.get(k) is not None}, getattr(loaded, "capabilities", None))
    if refused:
        raise ParamError(*refused)
    if image is None and spec.check_image(False) is not None:
        where = ("create a video with input_reference (POST /v1/videos)" if spec.is_video
                 else f"send the image to {EDITS_PATH}")
        raise APIError(400, f"{engine.model_name!r} ({spec.name}) generates from an image, and "
                            f"/v1/images/generations takes none: {where}", "model", "model_needs_image")
    if image is not None and spec.check_image(True) is not None:
        editing = ", ".join(s.name for s in PIPELINE_SPECS.values() if s.takes_image and not s.is_video)
        raise APIError(400, f"{engine.model_name!r} ({spec.name}) takes no input image: {EDITS_PATH} needs an "
                            f"image-editing pipeline ({editing})", "image", "model_takes_no_image")
    if image is not None:
        why = spec.check_mask(mask is not None)
        if why is not None:
            raise APIError(400, why, "mask", "model_takes_no_mask" if mask is not None else "mask_required")
    if mask is not None:
        from .inputs import check_mask_size

        check_mask_size(mask, image)
    # the pipeline's defaults for what the request leaves out (diffusers' own, runtime/pipelines.py)
    kwargs: dict[str, Any] = {"true_cfg_scale": spec.default_true_cfg}
    if loaded.default_steps is not None:
        kwargs["num_inference_steps"] = loaded.default_steps
    if loaded.default_guidance is not None:
        kwargs["guidance_scale"] = loaded.default_guidance
    for key in ("num_inference_steps", "guidance_scale", "guidance_scale_2", "true_cfg_scale"):
        if body.get(key) is not None:
            kwargs[key] = body[key]
    n = body.get("n")
    default_size = loaded.default_size
    if image is not None:
        from .inputs import default_size_for_image

        default_size = default_size_for_image(loaded, image)
    params = SamplingParams.create(
        body.get("prompt"),
        size=body.get("size"),
        width=body.get("width"),
        height=body.get("height"),
        seed=body.get("seed"),
        n=1 if n is None else n,
        quality=quality,
        negative_prompt=body.get("negative_prompt"),
        output_format=body.get("output_format") or "png",
        default_size=default_size,
        size_multiple=loaded.size_multiple,
        **kwargs,
    )
    if image is not None:
        from .inputs import fit_image_to_size, pixel_sha256

        fit_image_to_size(loaded, image, params.width, params.height)  # a size it cannot make: 400
        params = params.with_(image_sha256=pixel_sha256(image))
    if mask is not None:
        params = params.with_(mask_sha256=pixel_sha256(mask))
    return params


_edit_ids = itertools.count()


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; a 400 (``invalid_json``) for anything else."""
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


def inputs_dir() -> Any:
    """Where /v1/images/edits keeps a request's input image while it runs: a directory of this
    process under the cache (``$DITFUSE_CACHE/inputs/<pid>``), emptied of a dead process's leftovers."""
    import os
    import shutil
    from pathlib import Path

    from .presets import cache_dir

    root = cache_dir() / "inputs"
    mine = root / str(os.getpid())
    if not mine.is_dir():
        mine.mkdir(parents=True, exist_ok=True)
        for other in root.iterdir():  # a server that died mid-request left its inputs behind
            if other != mine and other.name.isdigit() and not Path(f"/proc/{other.name}").exists():
                shutil.rmtree(other, ignore_errors=True)
    return mine


async def read_edit_request(request: Request) -> tuple[dict[str, Any], bytes, bytes | None]:
    """An images/edits body: multipart/form-data (what the openai client sends: ``image`` or
    ``image[]`` files, a ``mask`` file, text fields) or JSON (``image`` and ``mask`` each as
    ``{"image_url": data URL}`` or a data URL string). Returns the other fields (numbers parsed),
    the image's bytes and the mask's (None without one)."""
    from .inputs import data_url_bytes

    ctype = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    images: list[Any] = []
    masks: list[bytes] = []
    body: dict[str, Any] = {}
    if ctype == "multipart/form-data":
        try:
            form = await request.form()
        except Exception as e:  # malformed multipart
            raise APIError(400, f"request body is not a valid form: {e}", code="invalid_form") from None
        for key, value in form.multi_items():
            if not isinstance(value, str):  # an uploaded file
                try:
                    if key not in ("image", "image[]", "mask"):
                        raise ParamError(key, f"{key} must be a text field, not a file")
                    (masks if key == "mask" else images).append(await value.read())
                finally:
                    await value.close()
                continue
            if key in body:
                raise ParamError(key, f"field {key!r} is given more than once")
            body[key] = value
        for key in _INT_FIELDS:
            v = body.get(key)
            if isinstance(v, str) and v.strip().lstrip("-").isdigit():
                body[key] = int(v.strip())
        for key in _FLOAT_FIELDS:
            v = body.get(key)
            if isinstance(v, str):
                try:
                    body[key] = float(v.strip())
                except ValueError:
                    raise ParamError(key, f"{key} must be a number, got {v!r}") from None
    elif is_json_content_type(ctype):
        body = await read_json_object(request)
        for key, found in (("image", images), ("mask", masks)):
            ref = body.pop(key, None)
            if ref is not None:
                url = ref.get("image_url") if isinstance(ref, dict) else ref
                found.append(data_url_bytes(url, key))
    else:
        raise APIError(415, f"unsupported Content-Type {ctype or '(none)'!r}; send multipart/form-data (as the "
                            "openai client does) or application/json", code="unsupported_media_type")
    if not images:
        raise ParamError("image", "image is required: the image to edit, as an uploaded file")
    if len(images) > 1:
        raise ParamError("image", f"{len(images)} images were sent; this server edits one image per request")
    if len(masks) > 1:
        raise ParamError("mask", f"{len(masks)} masks were sent; a request takes one, the size of its image")
    return body, images[0], masks[0] if masks else None


def encode_image(image: Any, params: SamplingParams, index: int, model: str, close_sites: int | None = None) -> str:
    from .generate import save_image

    buf = io.BytesIO()
    save_image(image, buf, params.output_format, params.metadata(index, model=model, close_sites=close_sites))
    return base64.b64encode(buf.getvalue()).decode("ascii")


class GuardMiddleware:
    """Pure ASGI: API-key check (all routes but /health) and a request body size limit.

    The body is read here (bounded) and replayed to the app, so an oversized body never reaches
    it; later ``receive`` calls go to the server, so disconnect detection keeps working.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def _reply(self, send: Any, status: int, body: dict, scope: dict | None = None) -> None:
        if scope is not None and isinstance(scope.get(SCOPE_KEY), dict):
            scope[SCOPE_KEY]["code"] = body["error"]["code"]
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") != "/health":
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                msg = "missing API key (send 'Authorization: Bearer <key>')" if not auth else "invalid API key"
                return await self._reply(send, 401, error_body(401, msg, code="invalid_api_key"), scope)
        too_large = error_body(413, f"request body is larger than {self.max_body_bytes} bytes", code="request_too_large")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._reply(send, 413, too_large, scope)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._reply(send, 413, too_large, scope)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_OUTCOME_BY_STATUS = {404: "not_found", 405: "method_not_allowed", 499: "client_closed_request", 500: "internal_error"}


@dataclass
class ShutdownReport:
    """Requests in flight when shutdown began, and how they ended."""

    in_flight: int = 0
    finished: int = 0  # got a response (any status)
    ok: int = 0  # of those, 2xx
    seconds: float = 0.0

    def line(self) -> str:
        failed = self.finished - self.ok
        unfinished = self.in_flight - self.finished
        tail = f", {unfinished} did not finish" if unfinished else ""
        noun = "request" if self.in_flight == 1 else "requests"
        return (
            f"shutdown: {self.finished} of {self.in_flight} in-flight {noun} finished "
            f"({self.ok} ok, {failed} failed{tail}) in {self.seconds:.1f} s"
        )


@dataclass
class _Tracked:
    t0: float
    status: int | None = None
    responded: bool = False


@dataclass
class _Shutdown:
    t0: float
    ids: set[int] = field(default_factory=set)
    finished: int = 0
    ok: int = 0


class ObservedApp:
    """Pure ASGI, outermost: one access-log line and one ``ditfuse_requests_total`` count per
    request (after its response, so the 401/413 of :class:`GuardMiddleware` and every other
    refusal are counted too), and the in-flight bookkeeping behind the shutdown line.

    Inner layers leave the error code, quality and batch sizes in ``scope[SCOPE_KEY]``; the status
    comes from the ``http.response.start`` message. Lifespan events pass straight through.
    """

    def __init__(self, app: Any, metrics: EngineMetrics, access_log: bool = True, log_prompts: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log
        self.log_prompts = log_prompts
        self._ids = itertools.count(1)
        self._live: dict[int, _Tracked] = {}
        self._shutdown: _Shutdown | None = None

    @property
    def in_flight(self) -> int:
        """HTTP requests received whose response has not completed."""
        return len(self._live)

    def begin_shutdown(self) -> None:
        """Remember which requests are in flight now (idempotent): called when the server stops
        accepting connections, before it waits for them."""
        if self._shutdown is None:
            self._shutdown = _Shutdown(t0=time.monotonic(), ids=set(self._live))

    def shutdown_report(self) -> ShutdownReport:
        self.begin_shutdown()
        s = self._shutdown
        assert s is not None
        return ShutdownReport(in_flight=len(s.ids), finished=s.finished, ok=s.ok, seconds=time.monotonic() - s.t0)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info: dict[str, Any] = {}
        scope[SCOPE_KEY] = info
        rid = next(self._ids)
        tracked = _Tracked(t0=time.perf_counter())
        self._live[rid] = tracked

        async def send_observed(message: dict) -> None:
            if message["type"] == "http.response.start":
                tracked.status = int(message["status"])
                tracked.responded = True
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        except asyncio.CancelledError:
            tracked.status = tracked.status or 499
            raise
        except Exception:
            tracked.status = tracked.status or 500
            raise
        finally:
            del self._live[rid]
            self._finish(rid, scope, info, tracked)

    def _finish(self, rid: int, scope: dict, info: dict, tracked: _Tracked) -> None:
        status = tracked.status or 500
        ms = (time.perf_counter() - tracked.t0) * 1000.0
        s = self._shutdown
        if s is not None and rid in s.ids and tracked.responded:
            s.finished += 1
            s.ok += 200 <= status < 300
        path = scope.get("path", "")
        generation = path == GENERATIONS_PATH
        outcome = "ok" if 200 <= status < 300 else info.get("code") or _OUTCOME_BY_STATUS.get(status, f"http_{status}")
        if generation:
            self.metrics.observe_request(outcome, status)
        if self.access_log and access_logger.isEnabledFor(logging.INFO):
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            parts = [who, scope.get("method", "-"), path, str(status), f"{ms:.1f}ms"]
            if generation:
                sizes = info.get("batch_sizes") or []
                parts.append(f"quality={info.get('quality', '-')}")
                parts.append(f"batch={'+'.join(str(b) for b in sizes) if sizes else '-'}")
                parts.append(f"images={info.get('images', 0)}")
                if outcome != "ok":
                    parts.append(f"error={outcome}")
                if self.log_prompts and "prompt" in info:
                    parts.append(f"prompt={info['prompt'][:200]!r}")
            access_logger.info(" ".join(parts))


def _note(request: Request, **fields: Any) -> None:
    """Leave fields for the access log / request counter (see :class:`ObservedApp`)."""
    info = request.scope.get(SCOPE_KEY)
    if isinstance(info, dict):
        info.update(fields)


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    *,
    access_log: bool = True,
    log_prompts: bool = False,
    videos: Any = None,
) -> ObservedApp:
    """The ASGI app: FastAPI routes wrapped in :class:`GuardMiddleware`, wrapped in
    :class:`ObservedApp` (access log, request counts). Starts and drains ``engine`` with the app's
    lifespan, and logs the shutdown line when it has drained. ``videos`` (a
    :class:`ditfuse.runtime.videos.VideoJobs`) adds the videos API; without it a video-less server
    answers /v1/videos with a clear 400. ``max_body_bytes``: None for :func:`default_max_body_bytes`."""
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(engine)
    started = int(time.time())
    observed: ObservedApp | None = None

    @asynccontextmanager
    async def lifespan(app: Any):
        await engine.start()
        # -- videos: open the job store after the engine starts (it re-queues queued jobs);
        # graceful stop: queued jobs leave the engine queue (they stay queued on disk), the
        # running batch finishes and its files are written before the store closes.
        if videos is not None:
            try:
                await videos.start()
            except BaseException:
                await engine.shutdown(drain=False)
                raise
        try:
            yield
        finally:
            if observed is not None:
                observed.begin_shutdown()
            if videos is not None:
                videos.detach_queued()
            await engine.shutdown(drain=True)
            if videos is not None:
                await videos.close()
            if observed is not None:
                server_logger.info(observed.shutdown_report().line())

    app = FastAPI(title="ditfuse", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    def err(request: Request, status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        _note(request, code=code)
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return err(request, e.status, e.message, e.param, e.code)

    @app.exception_handler(ParamError)
    async def _param_error(request: Request, e: ParamError) -> JSONResponse:
        return err(request, 400, e.message, e.param, "invalid_value")

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
        return err(request, e.status, str(e), None, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return err(request, 400, first.get("msg", "invalid request"), ".".join(loc) or None, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return err(request, e.status_code, str(e.detail), None, None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return err(request, 500, f"{type(e).__name__}: {e}", None, "internal_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.running and not engine._closing
        if engine.pool is not None:
            ok = ok and bool(engine.pool.live())
        body = {
            "status": "ok" if ok else "unavailable",
            "model": engine.model_name,
            "queue_depth": engine.queue_depth,
            "in_flight": engine.in_flight,
            "quality": engine.quality,
        }
        if engine.pool is not None:
            body["workers"] = [
                {"worker": w.worker, "device": w.device, "alive": w.up, "quality": w.quality, "busy": w.busy}
                for w in engine.worker_states()
            ]
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": engine.model_name, "object": "model", "created": started, "owned_by": "ditfuse"}],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.prometheus(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/debug/batches")
    async def batches(limit: int = 100) -> dict:
        log = list(engine.batch_log)[-max(0, limit):] if limit else []
        return {"object": "list", "data": log}

    from . import videos as _videos

    if videos is not None:
        app.include_router(_videos.router(videos))
    elif not getattr(engine.loaded, "is_video", False):
        app.include_router(_videos.unsupported_router(engine.model_name))

    @app.post(GENERATIONS_PATH)
    async def generations(request: Request) -> JSONResponse:
        ctype = request.headers.get("content-type")
        if not is_json_content_type(ctype):
            got = f"got {ctype!r}" if ctype else "no Content-Type header was sent"
            raise APIError(415, f"the request body must be JSON with 'Content-Type: application/json'; {got}", None, "unsupported_media_type")
        return await _run_images(request, parse_generation_request(await read_json_object(request), engine))

    @app.post(EDITS_PATH)
    async def edits(request: Request) -> JSONResponse:
        from .inputs import decode_image, decode_mask, save_png

        body, data, mask_data = await read_edit_request(request)
        refused = None if mask_data is None else engine.loaded.spec.check_mask(True)
        if refused is not None:  # before decoding it: whatever the mask holds, this model takes none
            raise APIError(400, refused, "mask", "model_takes_no_mask")
        # decoding and fingerprinting a large image takes a while: off the event loop
        image = await asyncio.to_thread(decode_image, data, "image")
        mask = None if mask_data is None else await asyncio.to_thread(decode_mask, mask_data, "mask")
        params = await asyncio.to_thread(parse_generation_request, body, engine, image, mask)
        # The workers read the image (and mask) from files (as a video job's); they live as long as
        # the request.
        edit_id = next(_edit_ids)
        path = inputs_dir() / f"edit-{edit_id}-{params.image_sha256[:16]}.png"
        mask_path = None if mask is None else inputs_dir() / f"edit-{edit_id}-mask-{params.mask_sha256[:16]}.png"
        try:
            await asyncio.to_thread(save_png, image, path)
            if mask is not None:
                await asyncio.to_thread(save_png, mask, mask_path)
                params = params.with_(mask=str(mask_path))
            return await _run_images(request, params.with_(image=str(path)))
        finally:
            path.unlink(missing_ok=True)
            if mask_path is not None:
                mask_path.unlink(missing_ok=True)

    async def _run_images(request: Request, params: SamplingParams) -> JSONResponse:
        _note(request, quality=params.quality.value, prompt=params.prompt)
        images = await engine.submit(params, is_disconnected=request.is_disconnected)
        batch_sizes = {g.batch_id: g.batch_size for g in images}  # one entry per batch it ran in
        _note(request, batch_sizes=list(batch_sizes.values()), images=len(images))
        data = await asyncio.to_thread(
            lambda: [
                {
                    "b64_json": encode_image(g.image, g.params, g.index, engine.model_name, g.close_sites),
                    "revised_prompt": None,
                    "seed": g.seed,
                }
                for g in images
            ]
        )
        return JSONResponse(
            {
                "created": int(time.time()),
                "data": data,
                "size": params.size,
                "quality": params.quality.value,
                "quality_applied": quality_applied(images),
                "output_format": params.output_format,
            }
        )

    observed = ObservedApp(
        GuardMiddleware(app, api_key=api_key, max_body_bytes=max_body_bytes),
        engine.metrics,
        access_log=access_log,
        log_prompts=log_prompts,
    )
    return observed


def build_engine(
    model: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    accelerate: bool = True,
    default_quality: str = "lossless",
    devices: list[str] | None = None,
    worker_options: dict[str, Any] | None = None,
    parallel: str = "data",
    parallel_mode: str = "ulysses",
    cuda_graph: "bool | str" = False,
    max_cuda_graphs: int = 4,
    loras: "tuple[Any, ...] | list[Any]" = (),
    fuse_lora: bool = False,
    **engine_kwargs: Any,
) -> tuple[Engine, str]:
    """Load ``model``, mount ditfuse (unless ``accelerate=False``), wrap it in an Engine.
    ``cuda_graph``: lossless CUDA graphs for each transformer's step (``accelerate(cuda_graph=)``),
    at most ``max_cuda_graphs`` input shapes each: True / "on", False / "off", or "auto" (what
    ``ditfuse serve`` uses: on for image models, off for video models,
    :func:`~ditfuse.runtime.presets.cuda_graphs_for`).

    With two or more ``devices`` the model is loaded by one worker process per device instead
    (:class:`~ditfuse.runtime.workers.WorkerPool`, ``worker_options`` passed to it; data
    parallel) and the engine schedules batches onto them; the summary then has one block per
    worker. ``parallel="context"``: the devices form one context-parallel group instead
    (:class:`~ditfuse.runtime.workers.ContextPool`, attention ``parallel_mode``), one lane whose
    every batch runs on all of them. Raises WorkerStartupError (a RuntimeError) if a worker cannot start.

    ``loras`` (presets.LoraSpec) are loaded into the pipeline (each worker's) before it is
    accelerated; ``fuse_lora`` merges them into the weights.

    Returns the engine and the acceleration summary (for logging)."""
    from .presets import cuda_graphs_for, load_model

    if devices is not None and len(devices) > 1:
        from .workers import ContextPool, WorkerPool

        graphs = dict(cuda_graph=cuda_graph, max_cuda_graphs=max_cuda_graphs, loras=tuple(loras), fuse_lora=fuse_lora)
        if parallel == "context":
            pool = ContextPool(model, devices, mode=parallel_mode, dtype=dtype, accelerate=accelerate,
                               default_quality=default_quality, **graphs, **(worker_options or {}))
        else:
            pool = WorkerPool(
                model, devices, dtype=dtype, accelerate=accelerate, default_quality=default_quality, **graphs,
                **(worker_options or {})
            )
        pool.start()
        try:
            engine = Engine(pool.loaded, None, default_quality=default_quality, pool=pool, **engine_kwargs)
        except BaseException:
            pool.close()
            raise
        return engine, pool.summary()
    if devices is not None:
        device = devices[0]

    loaded = load_model(model, device=device, dtype=dtype, loras=loras, fuse_lora=fuse_lora)
    handle = None
    summary = "nothing (acceleration disabled)"
    if accelerate:
        from ..models import accelerate as _accelerate

        graphs = cuda_graphs_for(cuda_graph, loaded)
        handle = _accelerate(loaded.pipe, quality=default_quality, cuda_graph=graphs, max_cuda_graphs=max_cuda_graphs)
        summary = handle.report().summary()
        if cuda_graph == "auto" and not graphs:
            why = "a video model" if loaded.is_video else f"{loaded.spec.label}, whose forward syncs with the host"
            summary += f"\nCUDA graphs: off for {why} (--cuda-graph auto; --cuda-graph on captures them)"
    summary = loaded.lora_lines() + summary
    engine = Engine(loaded, handle, default_quality=default_quality, **engine_kwargs)
    return engine, summary


def make_server(app: ObservedApp, host: str, port: int, **config: Any) -> Any:
    """A ``uvicorn.Server`` for ``app`` that tells it when shutdown begins (before uvicorn waits
    for open connections), so the shutdown line can count the requests that were in flight then.

    Graceful by default: in-flight requests finish, however long they take (``--request-timeout``
    bounds them)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.begin_shutdown()
            n = app.in_flight
            if n:
                server_logger.info(f"shutting down: waiting for {n} in-flight request{'s' if n != 1 else ''}")
            await super().shutdown(sockets)

    config.setdefault("log_level", "warning")
    config.setdefault("access_log", False)  # ObservedApp writes the access log
    config.setdefault("timeout_graceful_shutdown", None)
    return _Server(uvicorn.Config(app, host=host, port=port, lifespan="on", **config))


def configure_logging(level: int = logging.INFO) -> None:
    """Send ditfuse's server and access logs to stderr (uvicorn's own stay at warning): the CLI's
    set-up; an embedding application configures logging itself."""
    logger = logging.getLogger("ditfuse")
    if not any(getattr(h, "_ditfuse", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._ditfuse = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)


def _worker_threads(devices: list[str]) -> int | None:
    """Intra-op threads for CPU workers: the machine's cores shared among them (N workers x all
    cores of OpenMP threads each would spin against each other); None for GPU workers."""
    import os

    cpu = sum(1 for d in devices if d == "cpu")
    if not cpu:
        return None
    return max(1, (os.cpu_count() or 1) // cpu)


def run(args: Any) -> int:
    import sys

    from .presets import lora_specs

    store = None
    engine = None
    try:
        Quality.parse(args.default_quality)
        from .workers import plan_devices

        devices = plan_devices(getattr(args, "gpus", 1), getattr(args, "devices", None), args.device)
        parallel = getattr(args, "parallel", "data")
        if parallel == "context" and (devices is None or len(devices) < 2):
            raise ValueError("--parallel context spreads each request over several devices: give --gpus N "
                             "(N >= 2) or --devices LIST")
        store = _video_store(args)  # before the (slow) model load: a locked data dir fails fast
        engine, summary = build_engine(
            args.model,
            devices=devices,
            worker_options={"threads": _worker_threads(devices)} if devices and len(devices) > 1 else None,
            parallel=parallel,
            parallel_mode=getattr(args, "parallel_mode", "ulysses"),
            device=args.device,
            dtype=args.dtype,
            accelerate=not args.no_accelerate,
            default_quality=args.default_quality,
            cuda_graph="off" if getattr(args, "no_cuda_graph", False) else getattr(args, "cuda_graph", "auto"),
            max_cuda_graphs=getattr(args, "max_cuda_graphs", 4),
            loras=lora_specs(args),
            fuse_lora=getattr(args, "fuse_lora", False),
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
            quality_switch_wait_ms=args.quality_switch_wait_ms,
            max_queue=args.max_queue,
            request_timeout_s=args.request_timeout,
            pad_batches=not args.no_pad_batches,
            max_video_batch_size=getattr(args, "max_video_batch_size", 1),
            image_batches_per_video=getattr(args, "image_batches_per_video", 4),
        )
        videos = _video_jobs(engine, args, store)
    except (ValueError, RuntimeError, OSError) as e:
        if store is not None:
            store.close()
        if engine is not None and engine.pool is not None:
            engine.pool.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(args, engine, summary, videos)
    finally:
        if engine.pool is not None:  # normally closed by the engine's shutdown; never leave workers
            engine.pool.close()


def _serve(args: Any, engine: Engine, summary: str, videos: Any) -> int:
    import sys

    pool = engine.pool
    if pool is None:
        print(f"device: {engine.loaded.device} ({str(engine.loaded.dtype).replace('torch.', '')})")
    else:
        kind = (f"context parallel ({pool.mode}): every request on all {len(pool.devices)} devices"
                if hasattr(pool, "mode") else f"data parallel: {len(pool.workers)} worker processes")
        print(f"devices: {', '.join(pool.devices)} ({kind}, {str(engine.loaded.dtype).replace('torch.', '')})")
    print(f"model: {engine.model_name}")
    if engine.loaded.note:
        print(f"NOTE: {engine.loaded.note}")
    if pool is None:
        print("accelerated:")
        for line in summary.strip().splitlines():
            print(f"  {line}")
    else:
        print("workers (device, dtype, pid; what ditfuse mounted there):")
        for line in summary.strip().splitlines():
            print(f"  {line}")
    lanes = "" if pool is None or len(pool.workers) == 1 else f" on each of {len(pool.workers)} workers"
    print(
        f"batching: up to {engine.max_batch_size} images per call{lanes}, wait {engine.batch_wait_s * 1000:g} ms, "
        f"queue {engine.max_queue}, {'padded' if engine.pad_batches else 'unpadded'} batches"
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"WARNING: listening on {args.host} without --api-key", file=sys.stderr)
    # an image-to-video model's images route answers every request with a 400 (it needs an image)
    spec = engine.loaded.spec
    routes = "" if spec.check_image(False) is not None else "POST /v1/images/generations"
    if spec.takes_image and not spec.is_video:
        routes += ", POST /v1/images/edits"
    if videos is not None:
        print(
            f"videos: data dir {videos.data_dir}, up to {engine.max_video_batch_size} per call, "
            f"{engine.image_batches_per_video} image batches per video batch while videos wait, "
            f"timeout {videos.job_timeout_s:g} s, keep {videos.max_stored or 'all'} finished jobs"
            f"{'' if videos.max_age_s is None else f' for {videos.max_age_s:g} s'}"
        )
        routes += ", POST /v1/videos" if routes else "POST /v1/videos"
    if spec.takes_image:
        from .inputs import MAX_INPUT_BYTES

        limit = args.max_body_bytes if args.max_body_bytes is not None else default_max_body_bytes(engine)
        how = (("jobs may bring input_reference" if spec.image_optional else "every job needs input_reference")
               if spec.is_video else f"{EDITS_PATH} takes the image to edit" + ("" if spec.image_optional else " (required)"))
        if spec.size_from_image is not None:
            how += ", whose aspect sets the output size (a named size must be one the pipeline makes)"
        if spec.takes_mask:
            how += " and its mask (required: alpha 0, or white without an alpha channel, is repainted)"
        from .pipelines import LAST_IMAGE_NONE, LAST_IMAGE_REQUIRED

        last = getattr(engine.loaded, "capabilities", None)
        if last is not None and last.last_image != LAST_IMAGE_NONE:
            how += (", and last_input_reference (the last frame)" if last.last_image == LAST_IMAGE_REQUIRED
                    else "; last_input_reference (the last frame) is optional")
        print(f"input images: {how} (up to {MAX_INPUT_BYTES >> 20} MiB, 4096x4096 px); "
              f"request bodies up to {limit} bytes")
    print(f"serving on http://{args.host}:{args.port}  ({routes})", flush=True)
    configure_logging()
    app = create_app(
        engine,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        access_log=not args.no_access_log,
        log_prompts=args.log_prompts,
        videos=videos,
    )
    try:
        make_server(app, args.host, args.port).run()
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it handled once the graceful shutdown is done (as
        # uvicorn.run does, exit 0: the shutdown was the one asked for).
        pass
    return 0


def _video_store(args: Any) -> Any:
    """For a video model: its job store, opened now (which locks the data dir), so that a second
    server on the same dir fails before loading the model or binding a port. None otherwise."""
    from .presets import is_video_model

    if not is_video_model(args.model):
        return None
    from .jobs import JobStore
    from .videos import default_data_dir

    data_dir = getattr(args, "data_dir", None)
    return JobStore(data_dir if data_dir is not None else default_data_dir())


def _video_jobs(engine: Engine, args: Any, store: Any) -> Any:
    """The video job manager for a video model (None for an image model)."""
    if not getattr(engine.loaded, "is_video", False):
        return None
    from .videos import VideoJobs

    return VideoJobs(
        engine,
        store.data_dir if store is not None else getattr(args, "data_dir", None),
        job_timeout_s=getattr(args, "video_timeout", 3600.0),
        max_stored=getattr(args, "max_stored_videos", 1000),
        max_age_s=getattr(args, "video_ttl", 7 * 24 * 3600.0),
        store=store,
    )
