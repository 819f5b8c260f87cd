"""``ditfuse generate``: one request, from the command line, with timings.

Loads the model (a built-in preset, ``tiny-flux`` or ``tiny-wan``, or a local diffusers directory),
mounts ditfuse with ``ditfuse.models.accelerate``, runs the pipeline with a progress bar over the
denoising steps and writes PNGs carrying the sampling parameters as PNG text metadata. With
``--n 2 --out out.png`` the files are ``out-0.png`` and ``out-1.png``.

A video model (``tiny-wan``, ``tiny-wan-i2v``, ``tiny-hunyuanvideo15``, ``tiny-hunyuanvideo15-i2v``, ``tiny-ltx``,
``tiny-hunyuanvideo``, ``tiny-skyreels-v2``, ``tiny-skyreels-v2-i2v``, or a directory of a video pipeline class:
runtime/pipelines.py) writes one clip instead: ``--frames`` (4k+1;
LTX-Video 8k+1) or ``--seconds``, ``--out clip.mp4`` (H.264; the sampling parameters in the MP4's ``comment`` tag),
``clip.webp`` or ``clip.gif``; its progress bar covers the denoising steps and the VAE decode. An
image-to-video model (``tiny-wan-i2v``, ``tiny-ltx-i2v``, ``tiny-hunyuanvideo15-i2v``, ``tiny-skyreels-v2-i2v``, or a
directory of an image-to-video pipeline class) needs ``--image`` (LTX-Video's condition pipeline,
``tiny-ltx-condition``, takes one optionally: its first frame); an image-editing model
(``tiny-flux-kontext``, a FluxKontextPipeline directory) takes one: the picture to edit (without
it, text-to-image); an inpainting model (``tiny-flux-fill``, a FluxFillPipeline directory) needs
``--image`` and ``--mask``: where to repaint, an image of the same size (with an alpha channel, its
fully transparent pixels, as OpenAI's ``images.edit`` mask; without one, its white pixels, as
diffusers' ``mask_image``; runtime/inputs.mask_from_image). Either way the output takes the image's aspect ratio when no ``--size`` is
given (a pipeline that derives its size from the image, HunyuanVideo 1.5 I2V: the size it makes,
and a ``--size`` it cannot make exits 2), and its metadata carries the image's pixel SHA-256.
``--last-image`` adds the image the clip ends on (first-last-frame-to-video, on a checkpoint that
takes one: Wan 2.2 I2V-A14B, Wan2.1-FLF2V-14B; exit 2 elsewhere), sized as the first.
``--guidance-scale-2`` is Wan 2.2 A14B's low-noise expert's guidance scale (exit 2 on a checkpoint
without two experts).

``--gpus N`` (or ``--devices``) spreads the one generation over N devices with diffusers' context
parallelism: the command re-runs itself under torchrun, one process per device, and rank 0 prints
and writes the output (ditfuse/runtime/distributed.py, docs/parallel.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import IO, Any


def output_paths(out: Path, n: int) -> list[Path]:
    if n == 1:
        return [out]
    suffix = out.suffix or ".png"
    return [out.with_name(f"{out.stem}-{i}{suffix}") for i in range(n)]


def save_image(image: Any, path: "Path | IO[bytes]", fmt: str, metadata: dict[str, str]) -> None:
    """Write ``image`` to a path or binary file; PNGs carry ``metadata`` as tEXt chunks (plus
    ``parameters``: all of them on one line)."""
    from PIL.PngImagePlugin import PngInfo

    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "png":
        info = PngInfo()
        for k, v in metadata.items():
            info.add_text(k, v)
        info.add_text("parameters", "; ".join(f"{k}={v}" for k, v in metadata.items()))
        image.save(path, format="PNG", pnginfo=info)
    elif fmt == "jpeg":
        # JPEG has no alpha channel (Qwen-Image 2.1's pipeline returns RGBA images)
        image = image.convert("RGB") if image.mode not in ("RGB", "L") else image
        image.save(path, format="JPEG", quality=95)
    else:
        image.save(path, format=fmt.upper())


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    # Validate what can be checked before the (slow) model load.
    from .distributed import finish, in_launched_rank, init_rank, launch, plan_from_args

    try:
        from ..contracts.quality import Quality

        Quality.parse(args.quality)
        plan = plan_from_args(getattr(args, "gpus", None), getattr(args, "devices", None),
                              getattr(args, "parallel_mode", "ulysses"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plan is None:
        return _run(args, None, t_start)
    if not in_launched_rank():
        argv = getattr(args, "argv", None)
        if argv is None:
            print("error: --gpus/--devices re-run the command under torchrun: call it through the "
                  "ditfuse command line (ditfuse.runtime.cli.main)", file=sys.stderr)
            return 2
        from .presets import PRESET_TABLE, ensure_preset

        if args.model in PRESET_TABLE:
            # Build a preset once, here: inside torchrun's ranks transformers' save_pretrained
            # writes no weights on ranks other than 0, and a rank's empty build could win the race.
            ensure_preset(args.model)
        return launch(plan, argv)
    rank = init_rank(plan)
    try:
        if rank.main:
            return _run(args, rank, t_start)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # rank 0 reports
            return _run(args, rank, t_start)
    finally:
        finish(rank)


def _run(args: argparse.Namespace, rank: Any, t_start: float) -> int:
    """One generation in this process; ``rank`` (distributed.Rank) when it is one of several."""
    from .params import ParamError, SamplingParams
    from .presets import PRESET_TABLE, load_model, lora_specs, video_models_hint

    def out_path(info: Any) -> Path:
        if getattr(args, "out", None) is not None:
            return args.out
        return Path("out.mp4") if info.kind == "video" else Path("out.png")

    # --image / --last-image / --mask, decoded and fingerprinted once
    decoded: dict[Any, tuple[Any, str]] = {}

    def read_image(path: Any, param: str, flag: str) -> tuple[Any, str]:
        """``path``'s image (RGB; for ``param`` "mask" the mask in diffusers' convention) and the
        SHA-256 of its pixels."""
        from .inputs import decode_image, decode_mask, pixel_sha256

        if (param, path) not in decoded:  # make_params runs twice for a preset (before and after loading)
            try:
                data = Path(path).expanduser().read_bytes()
            except OSError as e:
                raise ParamError(param, f"{flag} {str(path)!r}: {e.strerror or e}") from None
            img = decode_mask(data, param) if param == "mask" else decode_image(data, param)
            decoded[param, path] = (img, pixel_sha256(img))
        return decoded[param, path]

    def make_params(info: Any) -> SamplingParams:
        """``info``: a Preset or LoadedModel (geometry, defaults, kind)."""
        video = info.kind == "video"
        frames, seconds = getattr(args, "frames", None), getattr(args, "seconds", None)
        if not video and (frames is not None or seconds is not None):
            raise ParamError("frames", f"--frames/--seconds need a video model ({video_models_hint()}); {args.model} makes images")
        out = out_path(info)
        if video:
            video_format(out)  # ValueError for anything but .mp4/.webp/.gif
            if args.n != 1:
                raise ParamError("n", "--n must be 1 for a video model (one clip per run)")
            fmt = "png"
        else:
            fmt = out.suffix.lower().lstrip(".") or "png"
            fmt = {"jpg": "jpeg"}.get(fmt, fmt)
        spec = info.spec
        image_path = getattr(args, "image", None)
        why = spec.check_image(image_path is not None)
        if why is not None:
            raise ParamError("image", f"{why} (--image PATH)" if image_path is None else why)
        mask_path = getattr(args, "mask", None)
        if mask_path is not None or image_path is not None:
            why = spec.check_mask(mask_path is not None)
            if why is not None:
                raise ParamError("mask", f"{why} (--mask PATH)" if mask_path is None else f"--mask: {why}")
        # a Preset (before loading) has no capabilities: the checkpoint's checks wait for the load
        capabilities = getattr(info, "capabilities", None)
        last_path = getattr(args, "last_image", None)
        why = spec.check_last_image(capabilities, last_path is not None)
        if why is not None:
            raise ParamError("last_image", why if last_path is not None else f"{why} (--last-image PATH)")
        image = image_sha = default_size = None
        if image_path is not None:
            from .inputs import default_size_for_image

            image, image_sha = read_image(image_path, "image", "--image")
            default_size = default_size_for_image(info, image)
        last_sha = None if last_path is None else read_image(last_path, "last_image", "--last-image")[1]
        mask_sha = None
        if mask_path is not None:
            from .inputs import check_mask_size

            mask, mask_sha = read_image(mask_path, "mask", "--mask")
            check_mask_size(mask, image, "mask")
        true_cfg = getattr(args, "true_cfg_scale", None)
        guidance_2 = getattr(args, "guidance_scale_2", None)
        named = {f for f, v in (("guidance_scale", args.guidance), ("guidance_scale_2", guidance_2),
                                ("true_cfg_scale", true_cfg), ("negative_prompt", args.negative_prompt))
                 if v is not None}
        refused = spec.check_request(named, capabilities)
        if refused:
            raise ParamError(*refused)
        steps = args.steps if args.steps is not None else (info.default_steps or spec.default_steps)
        default_guidance = info.default_guidance if info.default_guidance is not None else spec.default_guidance
        guidance = args.guidance if args.guidance is not None else (
            default_guidance if default_guidance is not None else 3.5
        )
        params = SamplingParams.create(
            args.prompt,
            size=args.size,
            num_inference_steps=steps,
            guidance_scale=guidance,
            guidance_scale_2=guidance_2,
            seed=args.seed,
            n=args.n,
            quality=args.quality,
            negative_prompt=args.negative_prompt,
            true_cfg_scale=spec.default_true_cfg if true_cfg is None else true_cfg,
            output_format=fmt,
            default_size=default_size or info.default_size,
            size_multiple=info.size_multiple,
        )
        if image is not None:
            from .inputs import fit_image_to_size

            fit_image_to_size(info, image, params.width, params.height)  # a size it cannot make: exit 2
            params = params.with_(image=str(Path(image_path).expanduser().resolve()), image_sha256=image_sha)
        if mask_sha is not None:
            # the user's file: the engine converts it again when it opens it (inputs.open_mask)
            params = params.with_(mask=str(Path(mask_path).expanduser().resolve()), mask_sha256=mask_sha)
        if last_path is not None:
            params = params.with_(last_image=str(Path(last_path).expanduser().resolve()), last_image_sha256=last_sha)
        if video:
            params = params.with_(num_frames=resolve_num_frames(
                seconds=seconds, num_frames=frames, fps=info.fps,
                frame_multiple=info.frame_multiple, default_frames=info.default_frames,
            ))
            if last_path is not None and params.num_frames < 2:
                # the call puts the last image after num_frames - 2 empty frames
                raise ParamError("frames", f"a clip with a last image has at least 2 frames "
                                           f"({info.frame_multiple + 1} or more), got {params.num_frames}")
        return params

    from .params import resolve_num_frames
    from .video_io import video_format

    try:
        # A preset's geometry is known without loading it, so bad arguments fail fast.
        if args.model in PRESET_TABLE:
            make_params(PRESET_TABLE[args.model])
        from .engine import run_batch

        loaded = load_model(args.model, device=args.device if rank is None else rank.device, dtype=args.dtype,
                            loras=lora_specs(args), fuse_lora=getattr(args, "fuse_lora", False))
        params = make_params(loaded)
        if rank is not None:
            from .distributed import enable_context_parallel

            parallel = enable_context_parallel(loaded.pipe, rank)
    except (ParamError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = out_path(loaded)

    print(f"device: {loaded.device} ({str(loaded.dtype).replace('torch.', '')})")
    if rank is not None:
        print(f"parallel: context parallelism ({rank.plan.mode}) over {rank.world} ranks "
              f"({', '.join(rank.plan.devices)}) on {', '.join(parallel)}; rank 0 writes the output")
    print(f"model: {loaded.name} ({type(loaded.pipe).__name__})")
    print(loaded.lora_lines(), end="")
    if loaded.note:
        print(f"NOTE: {loaded.note}")
    if args.no_accelerate:
        print("accelerated: nothing (--no-accelerate)")
    else:
        from ..models import accelerate

        handle = accelerate(loaded.pipe, quality=params.quality)
        summary = handle.report().summary().strip().splitlines()
        print("accelerated:")
        for line in summary:
            print(f"  {line}")
    t_loaded = time.perf_counter()
    quiet = rank is not None and not rank.main
    # what the call will run: the tier is fixed by accelerate() above, so the sites running
    # close kernels now are the ones every step runs (0 without accelerate: diffusers' own forward)
    from .engine import mounted_sites

    close_sites = 0 if args.no_accelerate else len(mounted_sites(loaded.pipe))
    if params.num_frames is not None:
        return _run_video(loaded, params, out, t_start, t_loaded, quiet, close_sites)

    from tqdm import tqdm

    stamps: list[float] = []
    bar = tqdm(total=params.num_inference_steps, desc="denoising", unit="step", file=sys.stderr, disable=quiet)

    def on_step(i: int, total: int) -> None:
        stamps.append(time.perf_counter())
        bar.update(1)

    t_call = time.perf_counter()
    try:
        images = run_batch(loaded, [(params, i) for i in range(params.n)], on_step=on_step)
    finally:
        bar.close()
    t_done = time.perf_counter()

    paths = output_paths(out, params.n)
    for i, (img, path) in enumerate(zip(images, paths)):
        if not quiet:  # every rank computed the same images; rank 0 writes them
            save_image(img, path, params.output_format, params.metadata(i, model=loaded.name, close_sites=close_sites))
    t_saved = time.perf_counter()

    print(
        f"sampling: {params.size}, {params.num_inference_steps} steps, guidance {params.guidance_scale:g}, "
        f"seed {params.seed}{'..' + str(params.seed + params.n - 1) if params.n > 1 else ''}, "
        f"n {params.n}, {_quality_line(params, close_sites)}"
    )
    if params.image is not None:
        print(f"image: {params.image} (pixels sha256 {params.image_sha256})")
    if params.mask is not None:
        print(f"mask: {params.mask} (repainted where white once converted; its pixels sha256 {params.mask_sha256})")
    print("timings:")
    print(f"  load + accelerate : {t_loaded - t_start:8.3f} s")
    if stamps:
        # step 0 includes text encoding and latent preparation; later steps are pure denoising
        print(f"  encode + step 0   : {stamps[0] - t_call:8.3f} s")
        if len(stamps) > 1:
            diffs = [b - a for a, b in zip(stamps, stamps[1:])]
            print(f"  per step (median) : {statistics.median(diffs) * 1000:8.1f} ms  (steps 1..{len(stamps) - 1})")
        print(f"  VAE decode + post : {t_done - stamps[-1]:8.3f} s")
    else:
        print(f"  pipeline call     : {t_done - t_call:8.3f} s")
    print(f"  save              : {t_saved - t_done:8.3f} s")
    print(f"  total             : {t_saved - t_start:8.3f} s")
    for path in paths:
        print(f"wrote {path}")
    if loaded.note:
        print(f"NOTE: {loaded.note}")
    return 0


def _quality_line(params: Any, close_sites: int) -> str:
    """``quality <asked>`` and, where it differs or needs saying, what ran (``applied_quality``)."""
    from .params import applied_quality

    applied = applied_quality(close_sites)
    ran = f"close kernels on {close_sites} sites" if close_sites else "no site runs a close kernel"
    if applied == params.quality.value:
        return f"quality {applied}" + (f" ({ran})" if close_sites else "")
    return f"quality {params.quality.value} (ran {applied}: {ran})"


def _run_video(loaded: Any, params: Any, out: Path, t_start: float, t_loaded: float, quiet: bool = False,
               close_sites: int = 0) -> int:
    """One clip: progress over the denoising steps and the decode, then the video file (not
    written when ``quiet``: another rank of a parallel run writes it)."""
    from tqdm import tqdm

    from .engine import run_batch
    from .params import seconds_for_frames
    from .video_io import video_format, write_video

    steps = params.num_inference_steps
    stamps: list[float] = []
    bar = tqdm(total=steps + 1, desc="denoising", unit="step", file=sys.stderr, disable=quiet)

    def on_step(i: int, total: int) -> None:
        stamps.append(time.perf_counter())
        bar.update(1)
        if len(stamps) == steps:
            bar.set_description("VAE decode")

    t_call = time.perf_counter()
    try:
        clip = run_batch(loaded, [(params, 0)], on_step=on_step)[0]
        bar.update(1)
    finally:
        bar.close()
    t_done = time.perf_counter()
    fmt = video_format(out)
    if quiet:
        return 0
    size = write_video(out, clip, loaded.fps, fmt, params.metadata(0, model=loaded.name, close_sites=close_sites))
    t_saved = time.perf_counter()

    n, h, w = clip.shape[:3]
    print(
        f"sampling: {params.size}, {params.num_frames} frames ({seconds_for_frames(params.num_frames, loaded.fps)} s "
        f"at {loaded.fps} fps), {steps} steps, guidance {params.guidance_scale:g}"
        f"{'' if params.guidance_scale_2 is None else f' (low-noise expert {params.guidance_scale_2:g})'}, "
        f"seed {params.seed}, "
        f"{_quality_line(params, close_sites)}"
    )
    if params.image is not None:
        print(f"image: {params.image} (pixels sha256 {params.image_sha256})")
    if params.last_image is not None:
        print(f"last image: {params.last_image} (pixels sha256 {params.last_image_sha256})")
    print("timings:")
    print(f"  load + accelerate : {t_loaded - t_start:8.3f} s")
    if stamps:
        print(f"  encode + step 0   : {stamps[0] - t_call:8.3f} s")
        if len(stamps) > 1:
            diffs = [b - a for a, b in zip(stamps, stamps[1:])]
            print(f"  per step (median) : {statistics.median(diffs) * 1000:8.1f} ms  (steps 1..{len(stamps) - 1})")
        print(f"  VAE decode + post : {t_done - stamps[-1]:8.3f} s")
    else:
        print(f"  pipeline call     : {t_done - t_call:8.3f} s")
    print(f"  {fmt} encode + save : {t_saved - t_done:6.3f} s")
    print(f"  total             : {t_saved - t_start:8.3f} s")
    codec = {"mp4": "H.264 MP4", "webp": "animated WebP", "gif": "GIF"}[fmt]
    print(f"wrote {out} ({n} frames, {w}x{h}, {loaded.fps} fps, {codec}, {size} bytes)")
    if loaded.note:
        print(f"NOTE: {loaded.note}")
    return 0
