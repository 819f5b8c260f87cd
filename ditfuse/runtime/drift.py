"""``ditfuse drift``: how far quality="high" (and torch.compile) drift from eager over a denoising run.

The same seed is sampled under several modes — ``eager`` (plain diffusers, the reference),
``lossless`` (ditfuse's bit-exact kernels), ``high`` (+ the request-gated close kernels) and, with
``--compile``, ``compile`` (``torch.compile`` of the plain transformer). For every step the latent
of each mode is compared with eager's: PSNR (peak = eager latent's value range) and max abs
difference; at the end the decoded images (pipeline mode) or the unpacked final latents
(transformer-only mode) are compared by PSNR and SSIM (gaussian window 11, sigma 1.5, computed
here in torch). lossless must come out bitwise identical: PSNR ``inf``. A PNG plots PSNR vs step
(matplotlib if installed) and a JSON holds every number.

Two ways to run:

- pipeline (default): ``--model tiny-flux`` or a local diffusers FLUX directory; a full
  ``FluxPipeline`` call per mode (text encoders, scheduler, VAE decode);
- ``--transformer-only``: the transformer alone with random prompt embeddings and a flow-matching
  Euler loop (shift 3), so that it runs on a random-weight model too: ``--model FAMILY-CONFIG``
  builds that family's config (``flux-dev`` — also spelled ``flux-dev-size`` — is FLUX.1-dev
  size, ``wan-dev`` Wan2.1-1.3B size; ``--layers`` shrinks it, as in ``ditfuse bench``), a path
  loads ``PATH/transformer`` of any supported family.

This module imports torch only inside functions (``ditfuse --help`` stays light).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("eager", "lossless", "high", "compile")


# ------------------------------------------------------------------------------ metrics


def psnr(x: Any, ref: Any, data_range: float | None = None) -> float:
    """PSNR of ``x`` against ``ref`` in dB (``inf`` when equal); peak = ``data_range`` or ref's range."""
    import torch

    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    mse = float((x - ref).pow(2).mean())
    if mse == 0.0:
        return math.inf
    peak = float(data_range) if data_range is not None else float(ref.max() - ref.min())
    if peak <= 0:
        peak = max(float(ref.abs().max()), 1e-12)
    return 10.0 * math.log10(peak * peak / mse)


def ssim(x: Any, ref: Any, data_range: float | None = None, window: int = 11, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004) of [N, C, H, W] tensors, gaussian window, 'valid' borders."""
    import torch
    import torch.nn.functional as F

    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if x.dim() == 3:
        x, ref = x[None], ref[None]
    if x.shape != ref.shape or x.dim() != 4:
        raise ValueError(f"ssim needs two [N, C, H, W] tensors of one shape, got {tuple(x.shape)}, {tuple(ref.shape)}")
    if torch.equal(x, ref):
        return 1.0
    L = float(data_range) if data_range is not None else float(ref.max() - ref.min())
    if L <= 0:
        L = 1.0
    win = min(window, x.shape[-1], x.shape[-2])
    win -= (win + 1) % 2  # odd
    coords = torch.arange(win, dtype=torch.float64, device=x.device) - (win - 1) / 2
    g = torch.exp(-(coords ** 2) / (2 * sigma * sigma))
    g = g / g.sum()
    C = x.shape[1]
    kernel = (g[:, None] * g[None, :]).expand(C, 1, win, win).contiguous()
    f = lambda t: F.conv2d(t, kernel, groups=C)  # noqa: E731
    mu_x, mu_y = f(x), f(ref)
    sxx = f(x * x) - mu_x ** 2
    syy = f(ref * ref) - mu_y ** 2
    sxy = f(x * ref) - mu_x * mu_y
    c1, c2 = (0.01 * L) ** 2, (0.03 * L) ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return float(s.mean())


def bitwise_equal(a: Any, b: Any) -> bool:
    from ..kernels.compare import first_mismatch

    return a.shape == b.shape and a.dtype == b.dtype and first_mismatch(a, b) is None


# ------------------------------------------------------------------------------ runs


@dataclass
class DriftConfig:
    model: str = "tiny-flux"
    steps: int = 28
    size: str | None = None
    seed: int = 0
    compile: bool = False
    transformer_only: bool = False
    layers: tuple[int, int] | None = None
    txt_tokens: int = 512
    device: str | None = None
    dtype: str = "auto"
    guidance: float = 3.5
    prompt: str = "a photo of a lighthouse at dusk, detailed, 35mm"
    out_dir: Path | None = Path("out/drift")
    modes: tuple[str, ...] = ("eager", "lossless", "high")


@dataclass
class ModeRun:
    latents: list[Any]
    final: Any  # image [N, 3, H, W] in [0, 1] (pipeline) or unpacked latent [N, C, h, w]
    step_ms: float
    note: str = ""


@dataclass
class DriftResult:
    config: dict[str, Any]
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, list):
                return [clean(x) for x in v]
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        return clean({"config": self.config, "modes": self.modes})


def _parse_size(size: str | None, default: tuple[int, int]) -> tuple[int, int]:
    if not size:
        return default
    w, _, h = size.lower().partition("x")
    W, H = int(w), int(h or w)
    if W % 16 or H % 16 or W <= 0 or H <= 0:
        raise ValueError(f"--size {size}: width and height must be positive multiples of 16")
    return W, H


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class _PipelineRunner:
    def __init__(self, cfg: DriftConfig) -> None:
        from .presets import load_model

        self.cfg = cfg
        self.loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        self.pipe = self.loaded.pipe
        self.device = self.loaded.device
        self.dtype = self.loaded.dtype
        self.size = _parse_size(cfg.size, self.loaded.default_size)
        self.target = self.pipe  # what accelerate() mounts on
        self.transformer = self.pipe.transformer

    def __call__(self) -> ModeRun:
        import torch

        latents: list[Any] = []
        stamps: list[float] = []

        def on_step(pipe, i, t, kw):
            _sync(self.device)
            stamps.append(time.perf_counter())
            latents.append(kw["latents"].detach().clone())
            return kw

        W, H = self.size
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.seed)
        with torch.no_grad():
            out = self.pipe(
                self.cfg.prompt, height=H, width=W, num_inference_steps=self.cfg.steps,
                guidance_scale=self.cfg.guidance, generator=gen, output_type="pt",
                callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"],
                **self.loaded.call_kwargs,
            )
        diffs = [b - a for a, b in zip(stamps, stamps[1:])]
        step_ms = statistics.median(diffs) * 1000 if diffs else float("nan")
        return ModeRun(latents, out.images.detach().float(), step_ms)


_TINY_SIZES = {"flux": "256x256", "wan": "64x48x9"}


def _transformer_target(model: str) -> tuple[str, str] | None:
    """``<family>-<config>`` (``flux-dev``, ``wan-dev``, ``wan-ti2v-5b``; ``flux-dev-size`` and
    ``tiny-flux`` are kept as names for ``flux-dev`` / ``flux-tiny``) -> (family, config)."""
    from ..models import families

    aliases = {"flux-dev-size": "flux-dev", "tiny-flux": "flux-tiny", "tiny-wan": "wan-tiny", "wan-dev-size": "wan-dev"}
    model = aliases.get(model, model)
    fam, _, cfg = model.partition("-")
    if fam in families.names() and cfg in families.get(fam).configs:
        return fam, cfg
    return None


class _TransformerRunner:
    """The transformer alone: random prompt embeddings, flow-matching Euler steps (shift 3), for
    any family (ditfuse/models/families.py) or a local diffusers transformer directory."""

    def __init__(self, cfg: DriftConfig) -> None:
        import torch

        from ..models import families
        from .presets import default_device, resolve_dtype

        self.cfg = cfg
        self.device = cfg.device or default_device()
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        target = _transformer_target(cfg.model)
        if target is not None:
            self.family = families.get(target[0])
            model = self.family.build(target[1], cfg.layers, device=self.device, dtype=self.dtype, seed=cfg.seed,
                                      load="pretrained")
            default_size = self.family.default_size if target[1] != "tiny" else _TINY_SIZES[target[0]]
        else:
            path = Path(cfg.model).expanduser()
            sub = path / "transformer" if (path / "transformer").is_dir() else path
            cls_name = json.loads((sub / "config.json").read_text()).get("_class_name", "")
            fam = next((families.get(n) for n in families.names() if families.get(n).model_class.endswith(":" + cls_name)), None)
            if fam is None:
                raise ValueError(f"{sub}: transformer class {cls_name!r} belongs to no supported family")
            self.family = fam
            model = fam.load_class().from_pretrained(str(sub), torch_dtype=self.dtype)
            default_size = fam.default_size
        self.transformer = model.to(self.device).eval().requires_grad_(False)
        self.target = self.transformer
        self.size_str = cfg.size or default_size
        self.inputs = self.family.make_inputs(self.transformer, 1, self.size_str, seed=cfg.seed, device=self.device,
                                              dtype=self.dtype, txt_tokens=cfg.txt_tokens)
        dims = [int(v) for v in self.size_str.lower().split("x")]
        self.size = (dims[0], dims[1])
        self.x0 = self.inputs[self.family.latent].float()
        shift = 3.0
        s = torch.linspace(1.0, 1.0 / cfg.steps, cfg.steps, dtype=torch.float64)
        s = shift * s / (1 + (shift - 1) * s)
        self.sigmas = [float(v) for v in s] + [0.0]

    def __call__(self) -> ModeRun:
        import torch

        x = self.x0.clone()  # fp32, as the flow-matching schedulers step in fp32
        latents, times = [], []
        with torch.no_grad():
            for i in range(self.cfg.steps):
                _sync(self.device)
                t0 = time.perf_counter()
                sig = self.sigmas[i]
                kw = dict(self.inputs)
                kw[self.family.latent] = x.to(self.dtype)
                kw["timestep"] = self.family.timestep(sig, 1, self.device, self.dtype)
                v = self.transformer(**kw)[0]
                x = x + (self.sigmas[i + 1] - sig) * v.float()
                _sync(self.device)
                times.append(time.perf_counter() - t0)
                latents.append(x.clone())
        later = times[1:] or times
        return ModeRun(latents, self.family.to_images(x), statistics.median(later) * 1000)


def run_drift(cfg: DriftConfig, log=print) -> DriftResult:
    """Sample ``cfg``'s seed under every mode and compare each with eager."""
    import torch

    from ..models import accelerate

    runner = _TransformerRunner(cfg) if cfg.transformer_only else _PipelineRunner(cfg)
    modes = list(dict.fromkeys(["eager", *cfg.modes, *(["compile"] if cfg.compile else [])]))
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    runs: dict[str, ModeRun] = {}
    handle = None
    for mode in modes:
        note = ""
        if mode == "eager":
            pass
        elif mode in ("lossless", "high"):
            if handle is None:
                handle = accelerate(runner.target, quality="lossless")
            res = handle.set_quality(mode)
            failed = [str(r.failed) for r in res.values() if r.failed is not None]
            if mode == "high":
                if failed:
                    note = "high NOT mounted (ran lossless): " + "; ".join(failed)
                elif not any(r.mounted for r in res.values()):
                    note = "high NOT mounted: no request-gated site (fused ops unavailable here?)"
                else:
                    note = f"high mounted: {sum(len(r.mounted) for r in res.values())} sites"
        elif mode == "compile":
            if handle is not None:
                handle.unmount()
                handle = None
            torch._dynamo.reset()
            runner.transformer.compile()
        log(f"[drift] {mode}: sampling {cfg.steps} steps{' — ' + note if note else ''}")
        t0 = time.perf_counter()
        run = runner()
        run.note = note
        runs[mode] = run
        log(f"[drift] {mode}: done in {time.perf_counter() - t0:.1f}s, step {run.step_ms:.2f} ms")
        if mode == "compile":
            runner.transformer._compiled_call_impl = None  # back to the plain forward
    if handle is not None:
        handle.unmount()

    size = getattr(runner, "size_str", None) or "x".join(str(v) for v in runner.size)
    config = dict(model=cfg.model, steps=cfg.steps, size=size, seed=cfg.seed,
                  transformer_only=cfg.transformer_only, layers=list(cfg.layers) if cfg.layers else None,
                  device=str(runner.device), dtype=str(runner.dtype).replace("torch.", ""),
                  torch=torch.__version__)
    if str(runner.device).startswith("cuda"):
        config["gpu"] = torch.cuda.get_device_name()
    result = DriftResult(config)
    ref = runs["eager"]
    final_range = 1.0 if not cfg.transformer_only else None
    for mode, run in runs.items():
        step_psnr = [psnr(a, b) for a, b in zip(run.latents, ref.latents)]
        step_max = [float((a.double() - b.double()).abs().max()) for a, b in zip(run.latents, ref.latents)]
        identical = all(bitwise_equal(a, b) for a, b in zip(run.latents, ref.latents)) and bitwise_equal(run.final, ref.final)
        result.modes[mode] = dict(
            step_psnr=step_psnr,
            step_max_abs=step_max,
            final_psnr=psnr(run.final, ref.final, final_range),
            final_ssim=ssim(run.final, ref.final, final_range),
            bitwise_identical=identical,
            step_ms=run.step_ms,
            note=run.note,
        )
    return result


def format_report(res: DriftResult) -> str:
    c = res.config
    lines = [f"drift vs eager: {c['model']}, {c['steps']} steps, {c['size']}, seed {c['seed']}, "
             f"{c['dtype']} on {c.get('gpu', c['device'])}{' (transformer only)' if c['transformer_only'] else ''}",
             f"{'mode':<10} {'last-step PSNR':>15} {'min PSNR':>10} {'max |diff|':>11} {'final PSNR':>11} "
             f"{'final SSIM':>11} {'step ms':>9}  bitwise"]
    fmt = lambda v: "inf" if v == math.inf else f"{v:.2f}"  # noqa: E731
    for mode, m in res.modes.items():
        if mode == "eager":
            lines.append(f"{mode:<10} {'(reference)':>15} {'':>10} {'':>11} {'':>11} {'':>11} {m['step_ms']:>9.2f}")
            continue
        lines.append(
            f"{mode:<10} {fmt(m['step_psnr'][-1]):>15} {fmt(min(m['step_psnr'])):>10} {max(m['step_max_abs']):>11.3e} "
            f"{fmt(m['final_psnr']):>11} {m['final_ssim']:>11.5f} {m['step_ms']:>9.2f}  "
            f"{'identical' if m['bitwise_identical'] else 'differs'}"
        )
        if m["note"]:
            lines.append(f"{'':<10} {m['note']}")
    return "\n".join(lines)


def plot(res: DriftResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[drift] matplotlib is not installed: no PNG plot (pip install matplotlib)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, m in res.modes.items():
        if mode == "eager":
            continue
        ys = [v if math.isfinite(v) else float("nan") for v in m["step_psnr"]]
        label = mode + (" (bitwise identical, inf dB)" if m["bitwise_identical"] else "")
        if m["bitwise_identical"]:
            ax.axhline(y=max([v for r in res.modes.values() for v in r["step_psnr"] if math.isfinite(v)] or [100]) + 5,
                       linestyle="--", color="gray", label=label)
        else:
            ax.plot(range(1, len(ys) + 1), ys, marker=".", label=label)
    c = res.config
    ax.set_xlabel("denoising step")
    ax.set_ylabel("latent PSNR vs eager (dB)")
    ax.set_title(f"drift vs eager: {c['model']} {c['size']} {c['steps']} steps", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-flux",
                   help="tiny-flux or a diffusers FLUX directory; with --transformer-only: FAMILY-CONFIG "
                        "(flux-dev, flux-tiny, wan-dev, wan-ti2v-5b, ...; random weights) or a transformer directory")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT (video: WIDTHxHEIGHTxFRAMES), multiples of 16 "
                                                 "(default: the model's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="also sample with torch.compile (plain transformer)")
    p.add_argument("--transformer-only", action="store_true",
                   help="the transformer alone with random prompt embeddings (works on random-weight models)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="block counts for a random-weight transformer (flux: DUAL SINGLE, 19 38; wan: BLOCKS)")
    p.add_argument("--txt-tokens", type=int, default=512, help="text tokens (transformer-only)")
    p.add_argument("--guidance", type=float, default=3.5)
    p.add_argument("--prompt", default=DriftConfig.prompt)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--out-dir", type=Path, default=Path("out/drift"), help="where drift.json and drift.png go")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")


def run(args: argparse.Namespace) -> int:
    cfg = DriftConfig(
        model=args.model, steps=args.steps, size=args.size, seed=args.seed, compile=args.compile,
        transformer_only=args.transformer_only, layers=tuple(args.layers) if args.layers else None,
        txt_tokens=args.txt_tokens, device=args.device, dtype=args.dtype, guidance=args.guidance,
        prompt=args.prompt, out_dir=args.out_dir,
    )
    if cfg.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    if _transformer_target(cfg.model) is not None and not cfg.transformer_only and not cfg.model.startswith("tiny-"):
        print(f"error: --model {cfg.model} is a random-weight transformer: add --transformer-only", file=sys.stderr)
        return 2
    try:
        res = run_drift(cfg, log=lambda s: print(s, file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = cfg.out_dir
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "drift.json").write_text(json.dumps(res.to_dict(), indent=2) + "\n")
        png = plot(res, out / "drift.png")
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(format_report(res))
        if out is not None:
            print(f"wrote {out / 'drift.json'}" + (f", {png}" if png else ""))
    lossless = res.modes.get("lossless")
    if lossless is not None and not lossless["bitwise_identical"]:
        print("ERROR: lossless is not bitwise identical to eager", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drift",
        help="per-step drift of quality=high / torch.compile vs eager (PSNR, max diff, SSIM, plot)",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(p)
    p.set_defaults(func=run)
