"""The images server, live on loopback, driven by the real ``openai`` client (tiny preset, CPU)."""

from __future__ import annotations

import asyncio
import base64
import io
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
from PIL import Image

KEY = "sk-ditfuse-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "ditfuse-cache"
    old = os.environ.get("DITFUSE_CACHE")
    os.environ["DITFUSE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DITFUSE_CACHE", None)
    else:
        os.environ["DITFUSE_CACHE"] = old


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
    import uvicorn

    from ditfuse.contracts import admission, ops
    from ditfuse.runtime.server import build_engine, create_app

    # Admission records injected for the whole module: quality="high" really mounts here (close
    # kernels under the interpreter), so the batch log shows which tier each batch ran with.
    records = admission.override_records([admission.admitted_record(op) for op in ops.CLOSE])
    records.__enter__()
    # bf16: the close kernels' dtype guard wants a half-precision model
    engine, summary = build_engine("tiny-flux", dtype="bf16", accelerate=True, max_batch_size=4, batch_wait_ms=100,
                                   max_queue=256)
    probe = engine.handle is not None and "transformer" in engine.handle._mounted
    app = create_app(engine, api_key=KEY, max_body_bytes=64 * 1024)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
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


@pytest.mark.parametrize("size", ["64x64", "96x48", "32x80"])
def test_b64_png_decodes_at_requested_size(server, size):
    res = gen(client(server), prompt="a lighthouse", size=size, steps=2, seed=11)
    assert len(res.data) == 1
    img = decode(res.data[0])
    w, h = map(int, size.split("x"))
    assert img.format == "PNG" and img.size == (w, h) and img.mode == "RGB"
    assert img.text["prompt"] == "a lighthouse" and img.text["seed"] == "11" and img.text["size"] == size
    assert res.data[0].model_extra["seed"] == 11


def test_n_images_have_consecutive_seeds_and_match_lone_requests(server):
    c = client(server)
    res = gen(c, prompt="two birds", n=3, seed=40, steps=2)
    assert [d.model_extra["seed"] for d in res.data] == [40, 41, 42]
    raw = [base64.b64decode(d.b64_json) for d in res.data]
    assert len(set(raw)) == 3
    lone = gen(c, prompt="two birds", seed=41, steps=2)
    # same prompt, size, steps and seed (so the same PNG text too) -> identical bytes
    assert base64.b64decode(lone.data[0].b64_json) == raw[1]


def test_same_seed_gives_identical_bytes_alone_or_in_a_batch(server):
    c = client(server)
    alone = gen(c, prompt="a red fox", seed=1234, steps=2).data[0].b64_json
    before = len(batches(server))

    async def burst():
        ac = aclient(server)
        prompts = ["zebra", "a red fox", "blue sky", "green hill"]
        seeds = [1, 1234, 2, 3]
        return await asyncio.gather(
            *[
                ac.images.generate(model="tiny-flux", prompt=p, size="64x64", extra_body={"seed": s, "num_inference_steps": 2})
                for p, s in zip(prompts, seeds)
            ]
        )

    res = asyncio.run(burst())
    assert res[1].data[0].b64_json == alone
    assert res[0].data[0].b64_json != alone
    new = batches(server)[before:]
    assert max(b["size"] for b in new) > 1, new  # the fox really had batch-mates


def test_mixed_quality_requests_run_in_separate_batches_with_their_mount_state(server):
    m0 = metrics(server)
    before = len(batches(server))
    qualities = ["high", "lossless", "hd", "standard", "high", "low", "lossless", "high"]

    async def burst():
        ac = aclient(server)
        return await asyncio.gather(
            *[
                ac.images.generate(model="tiny-flux", prompt=f"q{i}", size="64x64", quality=q, extra_body={"seed": i, "num_inference_steps": 1})
                for i, q in enumerate(qualities)
            ]
        )

    res = asyncio.run(burst())
    assert all(decode(r.data[0]).size == (64, 64) for r in res)
    assert [decode(r.data[0]).text["quality"] for r in res] == ["high", "lossless", "high", "lossless", "high", "lossless", "lossless", "high"]
    new = batches(server)[before:]
    assert {b["quality"] for b in new} == {"high", "lossless"}
    assert sum(b["size"] for b in new) == len(qualities)
    for b in new:
        assert b["handle_quality"] == b["quality"], b
        assert b["signature"][5] == b["quality"]
        if server.probe:
            assert bool(b["mounted"]) == (b["quality"] == "high"), b
    m1 = metrics(server)
    assert m1["ditfuse_quality_mounts_total"] > m0["ditfuse_quality_mounts_total"]
    assert m1["ditfuse_quality_unmounts_total"] >= m0["ditfuse_quality_unmounts_total"]


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


def test_api_key_required_everywhere_but_health(server):
    with pytest.raises(openai.AuthenticationError) as e:
        gen(client(server, api_key="wrong"))
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    for method, path in [("POST", "/v1/images/generations"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/debug/batches")]:
        r = httpx.request(method, server.url + path, json={"prompt": "x"} if method == "POST" else None)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200


def test_queue_full_gives_429(server):
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
    while metrics(server).get('ditfuse_requests_total{outcome="dropped_disconnected"}', 0) <= m0.get(
        'ditfuse_requests_total{outcome="dropped_disconnected"}', 0
    ):
        assert time.monotonic() < deadline, "the disconnected request was not dropped"
        time.sleep(0.05)
    m1 = metrics(server)
    assert m1["ditfuse_images_total"] - m0["ditfuse_images_total"] == 1  # only "long" ran


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
    ok = 'ditfuse_requests_total{outcome="ok"}'
    assert m1[ok] - m0[ok] == 200
    assert m1["ditfuse_images_total"] - m0["ditfuse_images_total"] == sum(n for *_, n in plan)
    assert m1["ditfuse_queue_depth"] == 0 and m1["ditfuse_images_in_flight"] == 0
    assert m1["ditfuse_batches_total"] - m0["ditfuse_batches_total"] < 200  # batching happened
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    print(f"soak: 200 requests in {time.monotonic() - t0:.1f} s, {m1['ditfuse_batches_total'] - m0['ditfuse_batches_total']:.0f} batches")


def test_metrics_are_prometheus_text(server):
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
        "ditfuse_queue_depth",
        "ditfuse_batches_total",
        "ditfuse_batch_size_total",
        "ditfuse_request_latency_seconds",
        "ditfuse_quality_mounts_total",
        "ditfuse_quality_unmounts_total",
    ):
        assert required in names
    assert 'ditfuse_request_latency_seconds_bucket{le="+Inf"}' in r.text


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
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        result = {}

        def call():
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            result["r"] = c.images.generate(prompt="last one", size="64x64", extra_body={"num_inference_steps": 40, "seed": 9})

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 30
        while "ditfuse_images_in_flight 1" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        t.join(120)
        assert decode(result["r"].data[0]).size == (64, 64)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "serving on http://127.0.0.1:" in out
        assert "noise" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
