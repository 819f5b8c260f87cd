"""Argument definitions for ``ditfuse generate`` and ``ditfuse serve``.

Kept apart from generate.py / server.py so that building the parser (``ditfuse --help``) imports
neither torch nor triton; the handlers import their modules only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 1 << 20


from .presets import model_help

MODEL_HELP = model_help()


def _lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (needs peft: pip install 'ditfuse[lora]')")
    g.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="load a LoRA (diffusers/PEFT format: a directory with pytorch_lora_weights.safetensors, or "
                        "the .safetensors file) at SCALE (default 1); repeat for several")
    g.add_argument("--fuse-lora", action="store_true",
                   help="merge the LoRAs into the weights at startup (no per-step LoRA cost; the mix is then fixed)")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-flux", help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="what to generate (the tiny presets ignore its meaning)")
    p.add_argument("--negative-prompt", default=None,
                   help="CFG pipelines (SD3, Wan, Z-Image, Chroma, HunyuanVideo 1.5) use it when guidance > 1; "
                        "FLUX.1, Qwen-Image and HunyuanVideo only with --true-cfg-scale > 1")
    p.add_argument("--true-cfg-scale", type=float, default=None,
                   help="FLUX.1 / Qwen-Image / HunyuanVideo: > 1 with --negative-prompt runs true CFG (2 passes per step); "
                        "default: the pipeline's (1.0; Qwen-Image 4.0)")
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT, multiples of 16 (default: the model's default)")
    p.add_argument("--steps", type=int, default=None, dest="steps", help="denoising steps (default: the pipeline's: FLUX.1 / SD3 28, Chroma 35, Qwen-Image 2.1 40, "
                        "FLUX.2 / Qwen-Image / Z-Image / Wan / HunyuanVideo / HunyuanVideo 1.5 / SkyReels-V2 50; tiny-wan 8)")
    p.add_argument("--guidance", type=float, default=None, dest="guidance", help="guidance scale (default: the pipeline's: FLUX.1 3.5, SD3 7.0, Wan / Z-Image / Chroma 5.0, "
                        "HunyuanVideo 6.0 (its distilled guidance embedding), SkyReels-V2 6.0, HunyuanVideo 1.5 its guider's; "
                        "Qwen-Image takes none)")
    p.add_argument("--guidance-scale-2", type=float, default=None, dest="guidance_scale_2",
                   help="Wan 2.2 A14B (two experts): the low-noise expert's guidance scale (default: --guidance's); "
                        "other checkpoints refuse it")
    p.add_argument("--seed", type=int, default=0, help="seed of output 0; output i uses seed + i")
    p.add_argument("--n", type=int, default=1, help="outputs to generate (out.png -> out-0.png, out-1.png, ...)")
    p.add_argument("--quality", default="lossless", help="lossless (bit-exact kernels only, default) or high")
    p.add_argument("--out", type=Path, default=None,
                   help="output file (default out.png; video models: out.mp4). Videos: .mp4 (H.264), .webp or .gif")
    p.add_argument("--frames", type=int, default=None, dest="frames",
                   help="video models: number of frames, 4k+1 (Wan, HunyuanVideo, HunyuanVideo 1.5, SkyReels-V2) or "
                        "8k+1 (LTX-Video) (default: the tiny video presets 17, Wan 81, HunyuanVideo 129, "
                        "HunyuanVideo 1.5 121, LTX-Video 161, SkyReels-V2 97)")
    p.add_argument("--seconds", type=float, default=None,
                   help="video models: clip length instead of --frames (the 4k+1 or 8k+1 frame count nearest to seconds*fps+1)")
    p.add_argument("--image", type=Path, default=None,
                   help="image-to-video models (tiny-wan-i2v, tiny-ltx-i2v, tiny-hunyuanvideo15-i2v, tiny-skyreels-v2-i2v; "
                        "required; tiny-ltx-condition: optional, at frame 0): the "
                        "image the clip starts from; image-editing models (tiny-flux-kontext; tiny-flux-fill with --mask): the image to "
                        "edit. "
                        "Without --size the output takes its aspect ratio at the model's default area (HunyuanVideo "
                        "1.5: the aspect bucket nearest the image's)")
    p.add_argument("--last-image", type=Path, default=None, dest="last_image",
                   help="first-last-frame-to-video: the image the clip ends on, resized to the clip's size as --image "
                        "is (checkpoints that take one: Wan 2.2 I2V-A14B (tiny-wan22-a14b-i2v), Wan2.1-FLF2V-14B "
                        "(required there))")
    p.add_argument("--mask", type=Path, default=None,
                   help="inpainting models (tiny-flux-fill, a FluxFillPipeline directory; required there): where to "
                        "repaint --image, an image of its size. With an alpha channel, OpenAI's convention: fully "
                        "transparent pixels (alpha 0) are repainted; without one (black and white), diffusers': white "
                        "is repainted, black kept")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--no-accelerate", action="store_true", help="run plain diffusers (for comparison)")
    _lora_args(p)
    par = p.add_argument_group("several GPUs (one generation spread over them: diffusers' context parallelism, "
                               "one process per device under torchrun; docs/parallel.md)")
    par.add_argument("--gpus", type=int, default=1, help="GPUs to spread the generation over (cuda:0..N-1)")
    par.add_argument("--devices", default=None, metavar="LIST",
                     help="comma-separated devices instead of --gpus, e.g. cuda:0,cuda:2 (or cpu,cpu: gloo, for testing)")
    par.add_argument("--parallel-mode", choices=("ulysses", "ring"), default="ulysses",
                     help="attention across the devices: ulysses (all-to-all over heads) or ring (GPUs only)")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-flux", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="TCP port")
    p.add_argument("--default-quality", default="lossless", help="quality for requests that send none/auto/standard")
    p.add_argument("--max-batch-size", type=int, default=4, help="most images per pipeline call")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="how long the oldest request waits for batch-mates")
    p.add_argument("--quality-switch-wait-ms", type=float, default=500.0,
                   help="how long the oldest request of the other quality tier may wait while work of the "
                        "mounted tier runs first (avoids a mount/unmount before every batch)")
    p.add_argument("--max-queue", type=int, default=256, help="most waiting requests; more get 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request fails with 504")
    p.add_argument("--no-pad-batches", action="store_true", help="run partial batches unpadded (faster at low load; an image may then depend on its batch size)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but /health)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"largest accepted request body (default {DEFAULT_MAX_BODY_BYTES}; an image-to-video model "
                        "adds room for one 32 MiB input image)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    par = p.add_argument_group("several GPUs (data parallel: one worker process and pipeline per device, one "
                               "queue; context parallel: every request spread over all devices; docs/serving.md)")
    par.add_argument("--gpus", type=int, default=1,
                     help="GPUs to serve on: N > 1 starts one worker process per GPU (cuda:0..N-1), each with its "
                          "own copy of the pipeline, fed from one queue")
    par.add_argument("--devices", default=None, metavar="LIST",
                     help="comma-separated devices, one worker process each (e.g. cuda:0,cuda:2 or cpu,cpu); "
                          "overrides --gpus")
    par.add_argument("--parallel", choices=("data", "context"), default="data",
                     help="how several GPUs share the work: data (one pipeline per GPU, whole requests each, "
                          "N at once) or context (one group: each request's transformer sequence split over "
                          "all devices with diffusers' context parallelism; for long videos)")
    par.add_argument("--parallel-mode", choices=("ulysses", "ring"), default="ulysses",
                     help="--parallel context: attention across the devices, ulysses (all-to-all over heads) "
                          "or ring (GPUs only)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--no-accelerate", action="store_true", help="serve plain diffusers")
    _lora_args(p)
    p.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="capture each transformer step as a CUDA graph after one eager call per input shape "
                        "(which verifies the kernels) and replay it: bitwise equal, ~1 ms of host time. auto "
                        "(default): on for image models, off for video models (measured slower there, and each "
                        "graph keeps a video step's activations)")
    p.add_argument("--no-cuda-graph", action="store_true", help="same as --cuda-graph off")
    p.add_argument("--max-cuda-graphs", type=int, default=4,
                   help="input shapes per transformer that keep a captured graph (each holds about one step's "
                        "activations); the least recently used is released for a new shape")
    p.add_argument("--no-access-log", action="store_true", help="no per-request log line (ditfuse.access logger, stderr)")
    p.add_argument("--log-prompts", action="store_true", help="include the prompt (first 200 characters) in access-log lines")
    v = p.add_argument_group("videos (video models: POST /v1/videos and the other /v1/videos routes)")
    v.add_argument("--data-dir", type=Path, default=None,
                   help="video job store: SQLite rows + MP4s (default: $DITFUSE_CACHE/videos, i.e. ~/.cache/ditfuse/videos)")
    v.add_argument("--max-video-batch-size", type=int, default=1,
                   help="most video jobs per pipeline call (same shape, steps, guidance and quality)")
    v.add_argument("--image-batches-per-video", type=int, default=4,
                   help="while video jobs wait, at most this many image batches run before the next video batch")
    v.add_argument("--video-timeout", type=float, default=3600.0, help="seconds from creation before a video job fails (queue + run)")
    v.add_argument("--max-stored-videos", type=int, default=1000, help="finished video jobs kept (oldest deleted first); 0: no limit")
    v.add_argument("--video-ttl", type=float, default=7 * 24 * 3600.0,
                   help="seconds a finished video job is kept (its expires_at); 0: forever")

def _cmd_generate(args: argparse.Namespace) -> int:
    from .generate import run

    return run(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import run

    return run(args)


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="generate images or videos from a prompt (the tiny-* presets: random weights, outputs are noise)",
        description="Generate images (or, with a video model, an MP4/WebP/GIF clip) with a diffusers pipeline "
        "accelerated by ditfuse. The built-in tiny-flux and tiny-wan presets have random weights: their images "
        "and videos are noise (they exercise the code path).",
    )
    _generate_arguments(g)
    g.set_defaults(func=_cmd_generate)
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (POST /v1/images/generations; video models also /v1/videos)",
        description="Serve POST /v1/images/generations (and, for a video model, the /v1/videos job API) with "
        "dynamic batching and per-request quality. The built-in tiny-flux and tiny-wan presets have random "
        "weights: their images and videos are noise.",
    )
    _serve_arguments(s)
    s.set_defaults(func=_cmd_serve)
