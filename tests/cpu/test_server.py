"""The images server, live on loopback, driven by the real ``openai`` client (tiny preset, CPU)."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.support.serve_process import wait_healthy

# One pytest-xdist worker runs this whole file (`--dist loadgroup`). Not for correctness: every
# worker process would start its own server (the fixture is module-scoped per process) and run its
# tests one at a time, so the metric-delta tests would still see only their own traffic. But the
# server (tiny FLUX mounted through the Triton interpreter) costs seconds to start, and spreading
# the file measured slower (58 s vs 49 s for `make test-quick` on 2 cores).
pytestmark = pytest.mark.xdist_group("server")

KEY = "sk-ditfuse-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are far too small to gain from intra-op threads, and on a busy 2-core
    CI machine OpenMP's spinning threads make each batch several times slower."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def server(tiny_cache, one_thread):
    from ditfuse.contracts import admission, ops
    from ditfuse.runtime.server import build_engine, create_app, make_server

    # Admission records injected for the whole module, so that the only thing keeping quality="high"
    # from mounting here is the model itself: the CPU preset runs in fp32, which the close kernels'
    # dtype guard refuses (tests/cpu/test_engine.py runs a bf16 pipeline where high does mount).
    records = admission.override_records([admission.admitted_record(op) for op in ops.CLOSE])
    records.__enter__()
    engine, summary = build_engine("tiny-flux", accelerate=True, max_batch_size=4, batch_wait_ms=100, max_queue=256)
    probe = (engine.handle is not None and "transformer" in engine.handle._mounted
             and engine.loaded.dtype in (torch.bfloat16, torch.float16))
    app = create_app(engine, api_key=KEY, max_body_bytes=64 * 1024)
    port = free_port()
    srv = make_server(app, "127.0.0.1", port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    yield SimpleNamespace(url=url, engine=engine, probe=probe, summary=summary)
    srv.should_exit = True
    thread.join(60)
    records.__exit__(None, None, None)
    assert not thread.is_alive()


def client(server, **kw) -> openai.OpenAI:
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", KEY), timeout=120, **kw)


def aclient(server, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", KEY), timeout=300, **kw)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def decode(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json)))


def batches(server) -> list[dict]:
    r = httpx.get(server.url + "/v1/debug/batches", params={"limit": 100000}, headers=auth())
    r.raise_for_status()
    return r.json()["data"]


def metrics(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", headers=auth())
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def gen(c, prompt="a cat", size="64x64", steps=1, seed=0, **kw):
    extra = {"num_inference_steps": steps, "seed": seed, **kw.pop("extra", {})}
    kw.setdefault("response_format", "b64_json")
    return c.images.generate(model="tiny-flux", prompt=prompt, size=size, extra_body=extra, **kw)


def test_health_and_models(server):
    r = httpx.get(server.url + "/health")  # no key needed
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-flux"]


# Each request runs the interpreter-mounted pipeline (seconds on CI); the quick loop keeps one size.
@pytest.mark.parametrize("size", ["64x64", pytest.param("96x48", marks=pytest.mark.slow), pytest.param("32x80", marks=pytest.mark.slow)])
def test_b64_png_decodes_at_requested_size(server, size):
    res = gen(client(server), prompt="a lighthouse", size=size, steps=2, seed=11)
    assert len(res.data) == 1
    img = decode(res.data[0])
    w, h = map(int, size.split("x"))
    assert img.format == "PNG" and img.size == (w, h) and img.mode == "RGB"
    assert img.text["prompt"] == "a lighthouse" and img.text["seed"] == "11" and img.text["size"] == size
    assert res.data[0].model_extra["seed"] == 11


@pytest.mark.slow  # several interpreter-mounted pipeline calls; the scheduling logic is in test_engine's quick tests
def test_n_images_have_consecutive_seeds_and_match_lone_requests(server):
    c = client(server)
    # 32x32: the interpreter-mounted pipeline costs ~20x more at 64x64, and nothing here depends on size
    res = gen(c, prompt="two birds", n=3, seed=40, steps=2, size="32x32")
    assert [d.model_extra["seed"] for d in res.data] == [40, 41, 42]
    raw = [base64.b64decode(d.b64_json) for d in res.data]
    assert len(set(raw)) == 3
    lone = gen(c, prompt="two birds", seed=41, steps=2, size="32x32")
    # same prompt, size, steps and seed (so the same PNG text too) -> identical bytes
    assert base64.b64decode(lone.data[0].b64_json) == raw[1]


@pytest.mark.slow  # several interpreter-mounted pipeline calls; the scheduling logic is in test_engine's quick tests
def test_same_seed_gives_identical_bytes_alone_or_in_a_batch(server):
    c = client(server)
    alone = gen(c, prompt="a red fox", seed=1234, steps=2, size="32x32").data[0].b64_json
    before = len(batches(server))

    async def burst():
        ac = aclient(server)
        prompts = ["zebra", "a red fox", "blue sky", "green hill"]
        seeds = [1, 1234, 2, 3]
        return await asyncio.gather(
            *[
                ac.images.generate(model="tiny-flux", prompt=p, size="32x32", extra_body={"seed": s, "num_inference_steps": 2})
                for p, s in zip(prompts, seeds)
            ]
        )

    res = asyncio.run(burst())
    assert res[1].data[0].b64_json == alone
    assert res[0].data[0].b64_json != alone
    new = batches(server)[before:]
    assert max(b["size"] for b in new) > 1, new  # the fox really had batch-mates


@pytest.mark.slow  # several interpreter-mounted pipeline calls; the scheduling logic is in test_engine's quick tests
def test_mixed_quality_requests_run_in_separate_batches_with_their_mount_state(server):
    m0 = metrics(server)
    before = len(batches(server))
    qualities = ["high", "lossless", "hd", "standard", "high", "low", "lossless", "high"]

    async def burst():
        ac = aclient(server)
        return await asyncio.gather(
            *[
                ac.images.generate(model="tiny-flux", prompt=f"q{i}", size="32x32", quality=q, extra_body={"seed": i, "num_inference_steps": 1})
                for i, q in enumerate(qualities)
            ]
        )

    res = asyncio.run(burst())
    assert all(decode(r.data[0]).size == (32, 32) for r in res)
    assert [decode(r.data[0]).text["quality"] for r in res] == ["high", "lossless", "high", "lossless", "high", "lossless", "lossless", "high"]
    # what ran: close kernels only in high batches, and only where the high tier mounts (the probe)
    applied = [getattr(r, "quality_applied") for r in res]
    asked = [r.quality for r in res]
    assert applied == [("high" if server.probe else "lossless") if q == "high" else "lossless" for q in asked], (asked, applied)
    # the PNG says the same as the response (one image per request here)
    assert [decode(r.data[0]).text["quality_applied"] for r in res] == applied
    new = batches(server)[before:]
    assert {b["quality"] for b in new} == {"high", "lossless"}
    assert sum(b["size"] for b in new) == len(qualities)
    for b in new:
        assert b["handle_quality"] == b["quality"], b
        assert b["signature"][5] == b["quality"]
        if server.probe:
            assert bool(b["mounted"]) == (b["quality"] == "high"), b
    m1 = metrics(server)
    mounts = m1["ditfuse_quality_mounts_total"] - m0["ditfuse_quality_mounts_total"]
    unmounts = m1["ditfuse_quality_unmounts_total"] - m0["ditfuse_quality_unmounts_total"]
    if server.probe:  # the FLUX high tier really mounts here (admission records injected)
        assert mounts >= 1 and unmounts >= mounts - 1
    else:  # nothing can mount (fp32 model, or no fused ops at all): the tier switches count nothing
        assert (mounts, unmounts) == (0, 0)
        assert all(b["mounted"] == [] for b in new)
        # Components without a high tier (the VAE) report no failure; the transformer's says why.
        failed = [r["failed"] for b in new if b["transition"] for r in b["transition"]["result"].values()
                  if b["quality"] == "high" and r["failed"] is not None]
        assert "fused ops unavailable" in server.summary or (failed and all("dtype" in f for f in failed)), failed
    switches = [b for b in new if b["transition"] is not None]
    assert switches  # the tier did switch; what it mounted is what the counters say
    mounted_any = sum(1 for b in switches if any(r["mounted"] for r in b["transition"]["result"].values()))
    assert mounts == mounted_any


@pytest.mark.parametrize(
    "kw,param,needle",
    [
        (dict(size="65x64"), "size", "multiples of 16"),
        (dict(size="64"), "size", "WIDTHxHEIGHT"),
        (dict(size="8192x8192"), "size", "2048"),
        (dict(quality="ultra"), "quality", "lossless, high"),
        (dict(steps=0), "num_inference_steps", "between 1 and 200"),
        (dict(steps=500), "num_inference_steps", "between 1 and 200"),
        (dict(n=9), "n", "between 1 and 8"),
        (dict(response_format="url"), "response_format", "b64_json"),
        (dict(extra=dict(guidance_scale="high")), "guidance_scale", "number"),
        (dict(prompt=""), "prompt", "non-empty"),
    ],
)
def test_bad_requests_get_400_with_openai_error_body(server, kw, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        gen(client(server), **kw)
    assert e.value.status_code == 400
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert needle in body["message"]


def test_unknown_quality_message_lists_allowed_values(server):
    with pytest.raises(openai.BadRequestError) as e:
        gen(client(server), quality="ultra")
    for allowed in ("lossless", "high", "auto", "standard", "hd", "low", "medium"):
        assert allowed in e.value.body["message"]


def test_malformed_json_unknown_model_and_body_limit(server):
    r = httpx.post(server.url + "/v1/images/generations", content=b"{not json", headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/images/generations", json=["a list"], headers=auth())
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError) as e:
        client(server).images.generate(model="dall-e-3", prompt="x", size="64x64")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "x" * 70000}, headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nope", headers=auth())
    assert r.status_code == 404 and "error" in r.json()


GEN = "/v1/images/generations"


def post(server, body: bytes | dict, content_type: str | None = "application/json", **headers) -> httpx.Response:
    data = body if isinstance(body, bytes) else __import__("json").dumps(body).encode()
    h = {**auth(), **headers}
    if content_type is not None:
        h["content-type"] = content_type
    return httpx.post(server.url + GEN, content=data, headers=h, timeout=120)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"style": "vivid"}, "style"),  # OpenAI's, but not implemented here
        ({"num_inference_step": 2}, "num_inference_step"),  # a typo of ours
        ({"cfg": 7, "sampler": "euler"}, "cfg"),
    ],
)
def test_unknown_field_is_a_400_naming_it(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        gen(client(server), extra=extra)
    body = e.value.body
    assert e.value.status_code == 400
    assert body["type"] == "invalid_request_error" and body["code"] == "unknown_parameter"
    assert body["param"] == param
    for name in extra:
        assert repr(name) in body["message"]
    assert "num_inference_steps" in body["message"]  # says what is accepted


def test_mask_on_generations_points_to_edits(server):
    with pytest.raises(openai.BadRequestError) as e:
        gen(client(server), extra={"mask": "x"})
    body = e.value.body
    assert body["param"] == "mask" and body["code"] == "unknown_parameter"
    assert "/v1/images/edits" in body["message"] and "FluxFillPipeline" in body["message"]


def test_documented_fields_are_all_accepted(server):
    body = {
        "model": "tiny-flux", "prompt": "a fox", "n": 1, "quality": "standard", "response_format": "b64_json",
        "output_format": "png", "user": "user-1234", "seed": 3, "num_inference_steps": 1, "guidance_scale": 2.0,
        "negative_prompt": "blur", "true_cfg_scale": 1.0, "width": 32, "height": 48,
    }
    from ditfuse.runtime.server import REQUEST_FIELDS

    # every accepted field, in one request; but guidance_scale_2, which only a two-expert Wan 2.2
    # checkpoint takes (tests/cpu/test_videos_wan22_guidance2.py)
    assert set(body) == REQUEST_FIELDS - {"size", "guidance_scale_2"}
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert decode(SimpleNamespace(**r.json()["data"][0])).size == (32, 48)


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
def test_body_must_be_sent_as_json(server, content_type):
    r = post(server, {"prompt": "x", "size": "32x32", "num_inference_steps": 1}, content_type=content_type)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"
    assert "application/json" in err["message"]


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", pytest.param("Application/JSON", marks=pytest.mark.slow), pytest.param("application/merge+json", marks=pytest.mark.slow)],
)
def test_json_content_types_with_parameters_are_accepted(server, content_type):
    r = post(server, {"prompt": "x", "size": "32x32", "num_inference_steps": 1, "seed": 1}, content_type=content_type)
    assert r.status_code == 200, r.text


def _requests_by_label(m: dict[str, float]) -> dict[tuple[str, str], float]:
    out = {}
    for k, v in m.items():
        if k.startswith("ditfuse_requests_total{"):
            labels = dict(kv.split("=", 1) for kv in k[len("ditfuse_requests_total{"):-1].split(","))
            out[(labels["outcome"].strip('"'), labels["status"].strip('"'))] = v
    return out


def _wait_for(pred, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_metrics_count_good_and_rejected_requests_by_outcome_and_status(server):
    before = _requests_by_label(metrics(server))
    dropped0 = metrics(server).get('ditfuse_queue_dropped_total{reason="timeout"}', 0)
    ok = {"prompt": "counted", "size": "32x32", "num_inference_steps": 1, "seed": 2}
    assert post(server, ok).status_code == 200
    assert post(server, ok).status_code == 200
    assert post(server, {**ok, "style": "vivid"}).status_code == 400
    assert post(server, {**ok, "size": "33x32"}).status_code == 400
    assert post(server, b"{broken").status_code == 400
    assert post(server, ok, content_type="text/plain").status_code == 415
    assert post(server, {**ok, "model": "dall-e-3"}).status_code == 404
    assert post(server, ok, Authorization="Bearer wrong").status_code == 401
    assert post(server, {"prompt": "x" * 70000}).status_code == 413
    eng = server.engine
    old = eng.request_timeout_s
    eng.request_timeout_s = 0.02  # shorter than the batch wait (100 ms): times out in the queue
    try:
        assert post(server, ok).status_code == 504
    finally:
        eng.request_timeout_s = old
    httpx.get(server.url + "/health")  # other routes are not image requests: not counted
    httpx.get(server.url + "/v1/models", headers=auth())
    expected = {
        ("ok", "200"): 2,
        ("unknown_parameter", "400"): 1,
        ("invalid_value", "400"): 1,
        ("invalid_json", "400"): 1,
        ("unsupported_media_type", "415"): 1,
        ("model_not_found", "404"): 1,
        ("invalid_api_key", "401"): 1,
        ("request_too_large", "413"): 1,
        ("timeout", "504"): 1,
    }
    # the response reaches the client just before the server counts it
    _wait_for(lambda: sum(_requests_by_label(metrics(server)).values()) - sum(before.values()) >= sum(expected.values()), "not counted")
    after = _requests_by_label(metrics(server))
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert delta == expected
    # the timed-out request was dropped from the queue before it ran
    _wait_for(lambda: metrics(server).get('ditfuse_queue_dropped_total{reason="timeout"}', 0) == dropped0 + 1, "not dropped")


def test_access_log_has_one_line_per_request_without_the_prompt(server, caplog):
    import re

    caplog.set_level(logging.INFO, logger="ditfuse.access")
    secret = "a secret prompt about zebras"
    res = gen(client(server), prompt=secret, n=2, quality="hd", steps=1, size="32x32")
    assert len(res.data) == 2
    with pytest.raises(openai.BadRequestError):
        gen(client(server), prompt=secret, extra={"style": "vivid"})
    httpx.get(server.url + "/health")

    def lines():
        # the previous test's last GET /metrics poll can be logged after its response reached the
        # client, i.e. once this test's capture is on: this test makes no /metrics request
        return [m for m in (r.getMessage() for r in caplog.records if r.name == "ditfuse.access")
                if " GET /metrics " not in m]

    _wait_for(lambda: len(lines()) >= 3, f"access log lines missing: {lines()}")
    got = lines()
    assert len(got) == 3, got
    ok, bad, health = got
    assert re.fullmatch(r"127\.0\.0\.1:\d+ POST /v1/images/generations 200 \d+\.\dms quality=high batch=[1-4](\+[1-4])? images=2", ok), ok
    assert re.fullmatch(
        r"127\.0\.0\.1:\d+ POST /v1/images/generations 400 \d+\.\dms quality=- batch=- images=0 error=unknown_parameter", bad
    ), bad
    assert re.fullmatch(r"127\.0\.0\.1:\d+ GET /health 200 \d+\.\dms", health), health
    assert not any("zebra" in line for line in got)


def test_api_key_required_everywhere_but_health(server):
    with pytest.raises(openai.AuthenticationError) as e:
        gen(client(server, api_key="wrong"))
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    for method, path in [("POST", "/v1/images/generations"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/debug/batches")]:
        r = httpx.request(method, server.url + path, json={"prompt": "x"} if method == "POST" else None)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_queue_full_gives_429(server):
    before = _requests_by_label(metrics(server))
    eng = server.engine
    old = eng.max_queue
    eng.max_queue = 2
    try:

        async def burst():
            ac = aclient(server)
            return await asyncio.gather(
                *[
                    ac.images.generate(model="tiny-flux", prompt=f"slow {i}", size="64x64", extra_body={"seed": i, "num_inference_steps": 40})
                    for i in range(10)
                ],
                return_exceptions=True,
            )

        res = asyncio.run(burst())
    finally:
        eng.max_queue = old
    limited = [r for r in res if isinstance(r, openai.RateLimitError)]
    ok = [r for r in res if not isinstance(r, Exception)]
    assert limited, res
    assert len(limited) + len(ok) == len(res), [r for r in res if isinstance(r, Exception) and r not in limited]
    assert all(e.status_code == 429 and e.body["code"] == "queue_full" for e in limited)
    assert ok
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    _wait_for(lambda: sum(_requests_by_label(metrics(server)).values()) - sum(before.values()) >= len(res), "not counted")
    after = _requests_by_label(metrics(server))
    assert after[("queue_full", "429")] - before.get(("queue_full", "429"), 0) == len(limited)
    assert after[("ok", "200")] - before.get(("ok", "200"), 0) == len(ok)


@pytest.mark.slow
def test_request_of_a_disconnected_client_is_dropped_before_it_runs(server):
    m0 = metrics(server)
    busy = threading.Thread(target=lambda: gen(client(server), prompt="long", steps=60, seed=5))
    busy.start()
    deadline = time.monotonic() + 30
    while server.engine.in_flight == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.url + "/v1/images/generations",
            json={"prompt": "gone", "size": "32x32", "num_inference_steps": 1, "seed": 1},
            headers=auth(),
            timeout=0.3,
        )
    busy.join(120)
    deadline = time.monotonic() + 10
    dropped = 'ditfuse_queue_dropped_total{reason="disconnected"}'
    while metrics(server).get(dropped, 0) <= m0.get(dropped, 0):
        assert time.monotonic() < deadline, "the disconnected request was not dropped"
        time.sleep(0.05)
    m1 = metrics(server)
    assert m1["ditfuse_images_total"] - m0["ditfuse_images_total"] == 1  # only "long" ran


@pytest.mark.slow
def test_soak_200_concurrent_mixed_requests(server):
    m0 = metrics(server)
    t0 = time.monotonic()
    plan = []
    for i in range(200):
        size = ["32x32", "64x64", "48x32"][i % 3]
        quality = ["lossless", "high", "auto", "hd"][i % 4]
        n = 2 if i % 10 == 0 else 1
        plan.append((i, size, quality, n))

    async def soak():
        ac = aclient(server)
        return await asyncio.gather(
            *[
                ac.images.generate(model="tiny-flux", prompt=f"soak {i}", size=size, quality=quality, n=n, extra_body={"seed": i, "num_inference_steps": 1})
                for i, size, quality, n in plan
            ],
            return_exceptions=True,
        )

    res = asyncio.run(soak())
    errors = [r for r in res if isinstance(r, Exception)]
    assert not errors, errors[:3]
    for (i, size, _, n), r in zip(plan, res):
        assert len(r.data) == n
        w, h = map(int, size.split("x"))
        img = decode(r.data[0])
        assert img.size == (w, h) and img.text["prompt"] == f"soak {i}"
    m1 = metrics(server)
    ok = 'ditfuse_requests_total{outcome="ok",status="200"}'
    assert m1[ok] - m0[ok] == 200
    assert m1["ditfuse_images_total"] - m0["ditfuse_images_total"] == sum(n for *_, n in plan)
    assert m1["ditfuse_queue_depth"] == 0 and m1["ditfuse_images_in_flight"] == 0
    assert m1["ditfuse_batches_total"] - m0["ditfuse_batches_total"] < 200  # batching happened
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    print(f"soak: 200 requests in {time.monotonic() - t0:.1f} s, {m1['ditfuse_batches_total'] - m0['ditfuse_batches_total']:.0f} batches")


def test_metrics_are_prometheus_text(server):
    gen(client(server), prompt="for the histograms", size="32x32")  # self-contained under any test order
    r = httpx.get(server.url + "/metrics", headers=auth())
    assert r.headers["content-type"].startswith("text/plain")
    names = set()
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
            assert line.split()[3] in ("counter", "gauge", "histogram")
        elif line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
    for required in (
        "ditfuse_requests_total",
        "ditfuse_queue_depth",
        "ditfuse_images_in_flight",
        "ditfuse_batches_total",
        "ditfuse_batch_size_total",
        "ditfuse_queue_wait_seconds",
        "ditfuse_generation_seconds",
        "ditfuse_request_latency_seconds",
        "ditfuse_quality_mounts_total",
        "ditfuse_quality_unmounts_total",
        "ditfuse_quality_current",
    ):
        assert required in names
    for hist in ("ditfuse_request_latency_seconds", "ditfuse_queue_wait_seconds"):
        assert f'{hist}_bucket{{le="+Inf"}}' in r.text
    m = metrics(server)
    # every image request so far ran in some batch: the histograms agree with the counters
    assert m["ditfuse_queue_wait_seconds_count"] >= 1
    gen_count = sum(v for k, v in m.items() if k.startswith("ditfuse_generation_seconds_count"))
    assert gen_count == m["ditfuse_batches_total"]
    assert sum(v for k, v in m.items() if k.startswith("ditfuse_batch_size_total{")) == m["ditfuse_batches_total"]


def server_quality(url: str) -> str:
    return httpx.get(url + "/health").json()["quality"]


@pytest.mark.slow
def test_serve_cli_binds_loopback_and_shuts_down_gracefully(tiny_cache, tmp_path):
    """`ditfuse serve` in its own process: SIGINT while a request runs -> the request still gets
    its image, then the process exits 0."""
    port = free_port()
    env = {**os.environ, "DITFUSE_CACHE": str(tiny_cache)}
    env.pop("TRITON_INTERPRET", None)
    exe = Path(sys.executable).with_name("ditfuse")
    cmd = [str(exe), "serve", "--model", "tiny-flux", "--port", str(port), "--max-batch-size", "2", "--default-quality", "lossless"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 90)
        # A plain CPU process (no interpreter): quality=high switches the tier but mounts nothing.
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        c.images.generate(prompt="tier switch", size="32x32", quality="high", extra_body={"num_inference_steps": 1, "seed": 1})
        result = {}

        def call():
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            # Long enough (~5 s on 2 cores) that SIGINT, sent after the checks below, finds it running:
            # at 64x64 x 40 steps it took ~50 ms and sometimes finished first.
            result["r"] = c.images.generate(prompt="last one", size="1024x1024",
                                            extra_body={"num_inference_steps": 200, "seed": 9})

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 30
        while "ditfuse_images_in_flight 1" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        text = httpx.get(url + "/metrics").text
        # both switches happened (to high; back to lossless before "last one" started running,
        # which the batch log lists once it finishes), and neither mounted anything
        log = httpx.get(url + "/v1/debug/batches").json()["data"]
        assert [b["transition"]["to"] for b in log if b["transition"]] == ["high"], log
        assert server_quality(url) == "lossless"
        assert "ditfuse_quality_mounts_total 0.0" in text and "ditfuse_quality_unmounts_total 0.0" in text, text
        proc.send_signal(signal.SIGINT)
        t.join(120)
        assert decode(result["r"].data[0]).size == (1024, 1024)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "serving on http://127.0.0.1:" in out
        assert "noise" in out
        # the access log (the prompt left out) and the shutdown line
        assert " POST /v1/images/generations 200 " in out and "quality=lossless batch=1 images=1" in out, out
        assert "last one" not in out
        assert "shutdown: 1 of 1 in-flight request finished (1 ok, 0 failed)" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# ObservedApp on its own (no pipeline): prompt logging is opt-in; the shutdown report counts
# what was in flight when shutdown began and how it ended.


async def _asgi_call(app, path: str) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "client": ("127.0.0.1", 5)}
    try:
        await app(scope, receive, send)
    except RuntimeError:
        return -1
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_observed_app_logs_prompts_when_asked_and_reports_shutdown(caplog):
    from ditfuse.runtime.metrics import EngineMetrics
    from ditfuse.runtime.server import GENERATIONS_PATH, SCOPE_KEY, ObservedApp

    caplog.set_level(logging.INFO, logger="ditfuse.access")
    release = asyncio.Event()

    async def inner(scope, receive, send):
        scope[SCOPE_KEY].update(quality="high", prompt="a fox in snow", batch_sizes=[3, 1], images=2)
        await release.wait()
        if scope["path"] == "/boom":
            raise RuntimeError("handler bug")  # no response at all
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    m = EngineMetrics()
    app = ObservedApp(inner, m, log_prompts=True)

    async def main():
        calls = [asyncio.create_task(_asgi_call(app, p)) for p in (GENERATIONS_PATH, "/boom")]
        await asyncio.sleep(0.05)
        assert app.in_flight == 2
        app.begin_shutdown()
        late = asyncio.create_task(_asgi_call(app, GENERATIONS_PATH))  # arrived after: not counted
        await asyncio.sleep(0.05)
        release.set()
        statuses = await asyncio.gather(*calls, late)
        return statuses, app.shutdown_report()

    statuses, report = asyncio.run(main())
    assert statuses == [200, -1, 200]
    assert (report.in_flight, report.finished, report.ok) == (2, 1, 1)
    assert report.line().startswith("shutdown: 1 of 2 in-flight requests finished (1 ok, 0 failed, 1 did not finish)")
    lines = [r.getMessage() for r in caplog.records if r.name == "ditfuse.access"]
    assert any("quality=high batch=3+1 images=2 prompt='a fox in snow'" in line for line in lines), lines
    assert any(" POST /boom 500 " in line for line in lines), lines
    assert m.value("ditfuse_requests_total", outcome="ok", status=200) == 2
    assert m.value("ditfuse_requests_total", outcome="internal_error", status=500) == 0  # not the image route


def test_cuda_graph_options_reach_accelerate_and_workers(monkeypatch):
    """serve's --cuda-graph / --no-cuda-graph / --max-cuda-graphs: build_engine hands them to
    accelerate() in process and to every worker's spec; the default ``auto`` is on for image
    models and off for video models; on a machine without CUDA accelerate says it ignored them."""
    import argparse

    from ditfuse.runtime import commands
    from ditfuse.runtime.presets import LoadedModel, cuda_graphs_for
    from ditfuse.runtime.server import build_engine
    from ditfuse.runtime.workers import WorkerPool

    p = argparse.ArgumentParser()
    commands._serve_arguments(p)
    default, off = p.parse_args([]), p.parse_args(["--no-cuda-graph", "--max-cuda-graphs", "2"])
    assert (default.cuda_graph, default.no_cuda_graph, default.max_cuda_graphs) == ("auto", False, 4)
    assert (off.no_cuda_graph, off.max_cuda_graphs) == (True, 2)
    assert p.parse_args(["--cuda-graph", "on"]).cuda_graph == "on"
    with pytest.raises(SystemExit):
        p.parse_args(["--cuda-graph", "sometimes"])

    image = LoadedModel("m", None, "cpu", None, True)
    video = LoadedModel("m", None, "cpu", None, True, kind="video")
    assert cuda_graphs_for("auto", image) and not cuda_graphs_for("auto", video)
    assert cuda_graphs_for("on", video) and not cuda_graphs_for("off", image)
    assert cuda_graphs_for(True, video) and not cuda_graphs_for(False, image)
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        cuda_graphs_for("yes", image)

    _engine, summary = build_engine("tiny-flux", device="cpu", accelerate=True, cuda_graph=True, max_cuda_graphs=2)
    assert "cuda_graph=True ignored: no CUDA device" in summary
    _engine, summary = build_engine("tiny-flux", device="cpu", accelerate=True, cuda_graph="auto")
    assert "cuda_graph=True ignored: no CUDA device" in summary  # auto: on for an image model
    _engine, summary = build_engine("tiny-wan", device="cpu", accelerate=True, cuda_graph="auto")
    assert "CUDA graphs: off for a video model" in summary and "ignored" not in summary, summary
    pool = WorkerPool("tiny-flux", ["cpu"], cuda_graph=True, max_cuda_graphs=3)
    assert (pool.specs[0].cuda_graph, pool.specs[0].max_cuda_graphs) == (True, 3)
    pool = WorkerPool("tiny-flux", ["cpu"], cuda_graph="auto")
    assert pool.specs[0].cuda_graph == "auto"  # resolved by the worker once it has loaded the model
    with pytest.raises(ValueError, match="max_cuda_graphs"):
        WorkerPool("tiny-flux", ["cpu"], max_cuda_graphs=0)


@pytest.mark.parametrize("close_sites, expected", [([0], "lossless"), ([3], "high"), ([3, 3], "high"),
                                                   ([0, 0], "lossless"), ([3, 0], "mixed"), ([], "lossless")])
def test_quality_applied_from_the_batches_close_sites(close_sites, expected):
    """The response's ``quality_applied``: "high" only when every batch of the request ran close
    kernels (a high request on a model without them, or refused by its guards, ran lossless)."""
    from ditfuse.runtime.server import quality_applied

    assert quality_applied([SimpleNamespace(close_sites=n) for n in close_sites]) == expected
