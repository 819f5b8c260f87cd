"""How the runtime calls each diffusers pipeline class: one declarative row per class.

diffusers' text-to-image / text-to-video pipelines agree on ``prompt``, ``height``, ``width``,
``num_inference_steps`` and ``generator``, and disagree on the rest: where the guidance scale goes
(a ``guidance_scale`` argument, FLUX's, FLUX.2's and HunyuanVideo's distilled guidance
embedding, HunyuanVideo 1.5's ``guider`` component, or nowhere: Qwen-Image guides only through
``true_cfg_scale``), what a negative prompt needs (classifier-free guidance above 1, or
``true_cfg_scale`` above 1: FLUX.1, Qwen-Image, HunyuanVideo), the sizes they accept (and, for
video, the frame-count rule and whether the call takes the frame rate: LTX-Video's
``frame_rate``), and whether they report steps (``callback_on_step_end``). A :class:`PipelineSpec`
says this for one class; :data:`PIPELINE_SPECS` lists every class ``generate`` / ``serve`` know.
Some arguments depend on the checkpoint as well as the class (Wan 2.2 A14B's second guidance scale,
a first-last-frame checkpoint's last image): the row names the argument and a function of the
loaded pipeline says what this checkpoint takes (:class:`Capabilities`).

A directory holding a class not listed loads as a text-to-image pipeline called the FLUX way
(``guidance_scale``, a negative prompt through ``true_cfg_scale``), with a log line saying so.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

log = logging.getLogger("ditfuse.runtime")

# Where a request's guidance_scale goes.
GUIDANCE_KWARG = "kwarg"  # the pipeline's guidance_scale argument
GUIDANCE_GUIDER = "guider"  # pipe.guider.guidance_scale, for the duration of the call
# What a negative prompt needs.
NEGATIVE_CFG = "cfg"  # used whenever the guidance scale is above 1 (SD3, Wan, Z-Image, Chroma, ...)
NEGATIVE_TRUE_CFG = "true_cfg"  # used only with true_cfg_scale above 1 (FLUX.1, Qwen-Image, HunyuanVideo)


def _flux_packed_multiple(pipe: Any) -> int:
    # 2x2 latent patches packed into tokens: sides are multiples of 2 x the VAE's factor.
    return int(getattr(pipe, "vae_scale_factor", 8)) * 2


def _square_default(pipe: Any) -> tuple[int, int]:
    side = int(getattr(pipe, "default_sample_size", 128)) * int(getattr(pipe, "vae_scale_factor", 8))
    return side, side


def _wan_multiple(pipe: Any) -> int:
    transformer = pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.transformer_2
    patch = tuple(transformer.config.patch_size)
    return int(pipe.vae_scale_factor_spatial) * max(patch[1], patch[2])


def _wan_fps(pipe: Any) -> int:
    # The frame rate a Wan checkpoint was trained for: Wan 2.2 TI2V-5B's clips are 24 fps (121
    # frames = 5 s: its model card and diffusers' example export), every other Wan checkpoint's
    # 16 (Wan 2.1, Wan 2.2 A14B: 81 frames = 5 s). TI2V-5B is the Wan checkpoint diffusers runs
    # with expand_timesteps (per-token timesteps; "Wan2.2 ti2v" in WanPipeline.__init__), in both
    # its text and its image mode.
    return 24 if getattr(pipe.config, "expand_timesteps", False) else 16


def _hunyuanvideo15_default(pipe: Any) -> tuple[int, int]:
    # diffusers' own default: the crop bucket nearest 16:9 at the transformer's target size
    h, w = pipe.video_processor.calculate_default_height_width(
        pipe.default_aspect_ratio[1], pipe.default_aspect_ratio[0], pipe.target_size
    )
    return int(w), int(h)


def _hunyuanvideo15_multiple(pipe: Any) -> int:
    patch = int(getattr(pipe.transformer.config, "patch_size", 1))
    return int(pipe.vae_scale_factor_spatial) * patch


def _hunyuanvideo15_sizing(pipe: Any) -> Any:
    # what the two functions below read of the pipeline: its video processor (the bucket list's
    # patch size, the resize) and the target size; picklable, so serve --gpus N's server process,
    # which holds no pipeline, sizes requests as the workers' pipelines will
    return SimpleNamespace(video_processor=pipe.video_processor, target_size=int(pipe.target_size))


def _hunyuanvideo15_image_size(pipe: Any, width: int, height: int) -> tuple[int, int]:
    # what HunyuanVideo15ImageToVideoPipeline.__call__ makes of a width x height image: the crop
    # bucket whose aspect is nearest the image's at the transformer's target size (its own call).
    # ``pipe``: the pipeline or its _hunyuanvideo15_sizing
    h, w = pipe.video_processor.calculate_default_height_width(height=height, width=width,
                                                               target_size=pipe.target_size)
    return int(w), int(h)


def _hunyuanvideo15_fit_image(pipe: Any, image: Any, width: int, height: int) -> Any:
    # The image to call with so that the call makes width x height. An image whose own bucket that
    # is goes as it is: the call fits it itself, as diffusers does for any caller. Another is fitted
    # first with the call's own resize (scale to cover, centre-crop) to width x height, which the
    # call then keeps as it is (its resize of an image of the bucket's size is the identity). But
    # the bucket search compares aspect ratios rounded to 5 decimals, and for a third or more of
    # the buckets the rounded ratio lies on the far side of the exact one, so their own aspect picks a
    # neighbour: those are made from an image one pixel wider (landscape) or taller (portrait),
    # which the call centre-crops by that pixel without resampling. The runtime checks the size
    # the fitted image makes (inputs.fit_image_to_size) and refuses any other.
    if _hunyuanvideo15_image_size(pipe, image.width, image.height) == (width, height):
        return image
    for w, h in ((width, height), (width + 1, height), (width, height + 1)):
        if _hunyuanvideo15_image_size(pipe, w, h) == (width, height):
            break
    else:
        w, h = width, height  # no bucket of this size: the check refuses it
    return pipe.video_processor.resize(image, height=h, width=w, resize_mode="crop")


def _hunyuanvideo15_i2v_default(pipe: Any) -> tuple[int, int]:
    # what a 16:9 image gives (the image-to-video pipeline has no default_aspect_ratio: every call
    # has an image); the text-to-video pipeline's default size too
    return _hunyuanvideo15_image_size(pipe, 16, 9)


def _vae_temporal(pipe: Any) -> int:
    # Wan, HunyuanVideo 1.5: frames after the first that the VAE packs into one latent frame
    return int(pipe.vae_scale_factor_temporal)


def _ltx_multiple(pipe: Any) -> int:
    # LTXPipeline.check_inputs refuses sides that are not multiples of 32 whatever its VAE; the
    # latent grid also needs whole patches (32 x 1 for every LTX-Video checkpoint)
    grid = int(pipe.vae_spatial_compression_ratio) * int(pipe.transformer_spatial_patch_size)
    return math.lcm(32, grid)


def _ltx_temporal(pipe: Any) -> int:
    # LTX names it vae_temporal_compression_ratio (8): prepare_latents floors (frames - 1) / 8, so
    # a count that is not 8k + 1 would silently lose its last frames; the runtime refuses it instead
    return int(pipe.vae_temporal_compression_ratio)


def _hunyuanvideo_multiple(pipe: Any) -> int:
    # HunyuanVideoPipeline.check_inputs refuses sides that are not multiples of 16; the latent grid
    # needs whole patches: the VAE's 8x times the transformer's patch 2 (16 for the released model)
    grid = int(pipe.vae_scale_factor_spatial) * int(pipe.transformer.config.patch_size)
    return math.lcm(16, grid)


def _skyreels_v2_multiple(pipe: Any) -> int:
    # SkyReelsV2Pipeline.check_inputs refuses sides that are not multiples of 16 whatever its VAE;
    # the latent grid needs whole patches: the VAE's 8x times the transformer's 2x2 (16 for every
    # released checkpoint)
    return math.lcm(16, _wan_multiple(pipe))


def _hunyuanvideo15_prepare(pipe: Any) -> None:
    # diffusers 0.42.1's AutoencoderKLHunyuanVideo15 decode fails for more than one video (its
    # mid-block attention mask is [B, S, S] against [B, 1, S, S] queries); slicing decodes the
    # batch one video at a time, which is what a batch of one computes.
    vae = getattr(pipe, "vae", None)
    if vae is not None and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()


# Whether a loaded checkpoint takes a last image (first-last-frame-to-video): Capabilities.last_image.
LAST_IMAGE_NONE = "none"  # refused (the reason in Capabilities.last_image_why)
LAST_IMAGE_OPTIONAL = "optional"  # the call conditions on the first image alone, or on both
LAST_IMAGE_REQUIRED = "required"  # the checkpoint is trained on two images and cannot run on one


def _wan_guidance_2(pipe: Any) -> str | None:
    # diffusers' Wan calls take guidance_scale_2 only with boundary_ratio (check_inputs raises
    # otherwise): the scale of transformer_2, which denoises the steps below the boundary. Without
    # both the call would refuse it or have no second expert to give it to.
    if getattr(pipe.config, "boundary_ratio", None) is not None and getattr(pipe, "transformer_2", None) is not None:
        return None
    return ("this checkpoint has one transformer (no boundary_ratio and transformer_2): guidance_scale_2 is the "
            "low-noise expert's scale of Wan 2.2's two-expert A14B checkpoints")


def _wan_last_image(pipe: Any) -> tuple[str, str]:
    # What WanImageToVideoPipeline / SkyReelsV2ImageToVideoPipeline (diffusers 0.42.1) do with
    # last_image, by checkpoint layout:
    # - expand_timesteps (Wan 2.2 TI2V-5B's image mode): prepare_latents conditions on the first
    #   frame only and drops last_image without a word, so a request with one is refused.
    # - no image encoder tokens (image_dim None: Wan 2.2 I2V-A14B): the last image's latents fill
    #   the last frame and its mask; optional.
    # - CLIP tokens (Wan 2.1 I2V, SkyReels-V2 I2V): the call encodes [image, last_image] as two rows
    #   of CLIP tokens, which only a first-last-frame transformer (Wan2.1-FLF2V-14B-720P:
    #   pos_embed_seq_len = 2 x 257) folds into one sequence per video; a plain I2V transformer fails
    #   on the batch mismatch, and an FLF2V one fails on a single image. So an FLF2V checkpoint
    #   requires the last image and an I2V one refuses it.
    if getattr(pipe.config, "expand_timesteps", False):
        return LAST_IMAGE_NONE, ("Wan 2.2 TI2V-5B's image mode conditions on the first frame only (diffusers' call "
                                 "ignores last_image when expand_timesteps is set)")
    transformer = pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.transformer_2
    cfg = transformer.config
    if getattr(cfg, "image_dim", None) is None:
        return LAST_IMAGE_OPTIONAL, ""
    if getattr(cfg, "pos_embed_seq_len", None) is None:
        return LAST_IMAGE_NONE, ("this image-to-video checkpoint's transformer reads one image's CLIP tokens (no "
                                 "pos_embed_seq_len); a last image needs a first-last-frame checkpoint such as "
                                 "Wan2.1-FLF2V-14B-720P")
    return LAST_IMAGE_REQUIRED, ("this first-last-frame checkpoint's transformer reads two images' CLIP tokens "
                                 "(pos_embed_seq_len): it needs a last image as well as the first")


@dataclass(frozen=True)
class Capabilities:
    """What one loaded checkpoint accepts where its class's row leaves it to the checkpoint (Wan's
    second guidance scale, a last image): read from the pipeline at load
    (:meth:`PipelineSpec.capabilities`) and kept on the LoadedModel, so the server process of
    ``serve --gpus N``, which holds no pipeline, checks requests as the workers' pipelines would."""

    guidance_2: bool = False  # the call takes guidance_scale_2 (spec.guidance_2_kwarg)
    guidance_2_why: str = ""  # why not, for the refusal
    last_image: str = LAST_IMAGE_NONE  # LAST_IMAGE_NONE / _OPTIONAL / _REQUIRED
    last_image_why: str = ""  # why refused or required


@dataclass(frozen=True)
class PipelineSpec:
    """How to call one diffusers pipeline class (see the module docstring)."""

    name: str  # the pipeline class name, as model_index.json's _class_name says it
    label: str  # what users call it, in messages ("Qwen-Image")
    kind: str = "image"  # "image" | "video"
    guidance: str | None = GUIDANCE_KWARG  # GUIDANCE_KWARG, GUIDANCE_GUIDER or None (takes none)
    negative: str | None = NEGATIVE_CFG  # NEGATIVE_CFG, NEGATIVE_TRUE_CFG or None (takes none)
    default_steps: int = 28
    # None: read from the loaded pipeline (the guider's scale for GUIDANCE_GUIDER)
    default_guidance: float | None = 3.5
    # true_cfg_scale when a request names none (diffusers' own default for the class)
    default_true_cfg: float = 1.0
    # (width, height), or a module-level function of the loaded pipeline giving it (module-level:
    # a spec travels to worker processes pickled)
    default_size: "tuple[int, int] | Callable[[Any], tuple[int, int]]" = _square_default
    size_multiple: Callable[[Any], int] = _flux_packed_multiple
    # video: frames per second of the clips (or a module-level function of the loaded pipeline
    # giving it: Wan 2.2 TI2V-5B is 24 fps where other Wan checkpoints are 16) and the default
    # clip length (frame counts are frame_multiple(pipe) * k + 1)
    fps: "int | Callable[[Any], int] | None" = None
    default_frames: int | None = None
    # video: how many frames the loaded pipeline's VAE packs into one latent frame (after the first)
    frame_multiple: Callable[[Any], int] = _vae_temporal
    # video: the call argument that takes the clip's frame rate, for a pipeline whose output
    # depends on it (LTX-Video: frame_rate sets its RoPE's temporal scale); the runtime passes fps
    # so the frames are generated for the rate they are written at. None: the call takes none.
    fps_kwarg: str | None = None
    known: bool = True  # False: the fallback for a class not in the table
    # Called once on the loaded pipeline (a module-level function): what it needs before the
    # runtime's batched calls work.
    prepare: Callable[[Any], None] | None = None
    # Whether cuda_graph="auto" captures its transformer steps: False where the forward syncs
    # with the host (capture would fail on every new shape, and the step run eager anyway).
    cuda_graphs: bool = True
    # Image-conditioned pipelines (image-to-video, image editing): the call argument that takes
    # the input image (every request must bring one unless image_optional). None: it takes none.
    image_kwarg: str | None = None
    # True: the call takes one image per prompt (a list; LTX-Video), so requests on different
    # images share a batch. False: one image conditions the whole call (Wan repeats its CLIP
    # tokens and latents over the batch), so only requests on the same image share one.
    image_per_sample: bool = False
    # True: the image is optional (FLUX.1 Kontext edits an image, or makes one from text alone).
    image_optional: bool = False
    # True: a call with an input image holds one video, unpadded. The call samples the image's
    # latents once for the whole batch, with the first video's generator
    # (LTXConditionPipeline: vae.encode(image).latent_dist.sample(generator) on a batch of one
    # takes generator[0]), so a clip would depend on which video ran first in its batch. The
    # engine caps such batches at one video (Engine._batch_cap, which padding also fills up to:
    # every such clip is then a batch of one, served or generated alike) and run_batch refuses more.
    image_alone: bool = False
    # The call argument that caps the output's area (FLUX.1 Kontext's max_area: it rescales the
    # requested height x width to that area); the runtime passes the requested area, so the
    # requested size is what comes out. None: the call takes none.
    area_kwarg: str | None = None
    # Image-conditioned pipelines whose call takes no height / width: the output's size follows
    # from the input image (HunyuanVideo 1.5 image-to-video: the aspect bucket nearest the image's).
    # A module-level function (pipe, image width, image height) -> the (width, height) the call
    # makes of such an image. A request naming no size gets that size, and reports it; a request
    # naming one has its image fitted first (fit_image) so that the call makes the named size, and
    # a size the fitted image would not make is refused (inputs.fit_image_to_size): the size a
    # job reports is always the clip's. None: the call takes the size it is given.
    size_from_image: Callable[[Any, int, int], tuple[int, int]] | None = None
    # With size_from_image: a module-level function (pipe, image, width, height) -> the image to
    # call with so that the call makes width x height (the image itself where it already does),
    # fitted the way the pipeline fits its input (HunyuanVideo 1.5: scale to cover, centre-crop).
    fit_image: Callable[[Any, Any, int, int], Any] | None = None
    # With size_from_image: a module-level function pipe -> the picklable part of the pipeline the
    # two functions above read, which they then get instead of the pipeline (LoadedModel.sizing:
    # serve --gpus N's server process sizes requests without holding the pipeline). None: they
    # get the pipeline.
    sizing: Callable[[Any], Any] | None = None
    # The call argument that takes a second guidance scale (Wan 2.2 A14B's guidance_scale_2: the
    # low-noise expert's), and a module-level function of the loaded pipeline giving None when this
    # checkpoint takes it, else why not (one expert). None: the class takes none.
    guidance_2_kwarg: str | None = None
    guidance_2_rule: Callable[[Any], str | None] | None = None
    # Image-to-video: the call argument that takes a last image (first-last-frame-to-video: the
    # clip ends on it), and a module-level function of the loaded pipeline giving (LAST_IMAGE_*,
    # why) for the checkpoint. One last image conditions the whole call, as the first does. None:
    # the class takes none.
    last_image_kwarg: str | None = None
    last_image_rule: Callable[[Any], tuple[str, str]] | None = None
    # Inpainting (FLUX.1 Fill): the call argument that takes the mask of the input image, in
    # diffusers' convention (white = repaint, black = keep; the runtime converts OpenAI's
    # alpha-channel masks to it: inputs.mask_from_image). Every request on such a pipeline must
    # bring one with its image, the size of its image; it is passed the way the image is (one per
    # prompt where image_per_sample, else one per call: then part of the batch signature). None:
    # the call takes no mask, and a request with one is refused.
    mask_kwarg: str | None = None

    @property
    def is_video(self) -> bool:
        return self.kind == "video"

    @property
    def takes_image(self) -> bool:
        return self.image_kwarg is not None

    @property
    def takes_mask(self) -> bool:
        return self.mask_kwarg is not None

    def batch_signature(self, params: Any, model: str) -> tuple:
        """The key under which requests may share one call of this pipeline: the params'
        signature, without the image's fingerprint where each prompt takes its own image."""
        return params.signature(model, by_image=not self.image_per_sample)

    def check_image(self, given: bool) -> str | None:
        """Why a request with (``given``) or without an input image cannot run here, else None."""
        if self.takes_image and not given and not self.image_optional:
            return f"{self.label} ({self.name}) generates from an image: the request needs one"
        if given and not self.takes_image:
            with_image = ", ".join(s.name for s in PIPELINE_SPECS.values() if s.takes_image)
            return (f"{self.label} ({self.name}) is text-only and takes no input image; an input image "
                    f"needs a pipeline that takes one ({with_image})")
        return None

    def check_mask(self, given: bool) -> str | None:
        """Why a request with (``given``) or without a mask cannot run here, else None. A mask
        comes only with an input image (the caller checks that with :meth:`check_image`)."""
        if given and not self.takes_mask:
            with_mask = ", ".join(s.name for s in PIPELINE_SPECS.values() if s.takes_mask)
            how = ("edits the whole image from the prompt" if self.takes_image and not self.is_video
                   else "takes no image to inpaint")
            return (f"mask is not supported by {self.label} ({self.name}): it {how}; a mask needs an inpainting "
                    f"pipeline ({with_mask})")
        if not given and self.takes_mask:
            return (f"{self.label} ({self.name}) inpaints: the request needs a mask with its image (where to repaint: "
                    "transparent pixels of an image with an alpha channel, else white pixels)")
        return None

    def capabilities(self, pipe: Any) -> Capabilities:
        """What the loaded ``pipe`` accepts of what this row leaves to the checkpoint."""
        guidance_2, guidance_2_why = False, f"{self.label} ({self.name}) takes no guidance_scale_2"
        if self.guidance_2_kwarg is not None:
            why = self.guidance_2_rule(pipe) if self.guidance_2_rule is not None else None
            guidance_2, guidance_2_why = why is None, why or ""
        last, last_why = LAST_IMAGE_NONE, f"{self.label} ({self.name}) takes no last image"
        if self.last_image_kwarg is not None:
            last, last_why = self.last_image_rule(pipe) if self.last_image_rule is not None else (LAST_IMAGE_OPTIONAL, "")
        return Capabilities(guidance_2=guidance_2, guidance_2_why=guidance_2_why, last_image=last,
                            last_image_why=last_why)

    def check_last_image(self, capabilities: "Capabilities | None", given: bool) -> str | None:
        """Why a request with (``given``) or without a last image cannot run on a checkpoint of
        these ``capabilities``, else None. ``capabilities`` None (a preset not loaded yet): only
        what the row says is checked."""
        if given and self.last_image_kwarg is None:
            with_last = ", ".join(s.name for s in PIPELINE_SPECS.values() if s.last_image_kwarg is not None)
            return (f"{self.label} ({self.name}) takes no last image (first-last-frame-to-video needs "
                    f"{with_last})")
        if capabilities is None or self.last_image_kwarg is None:
            return None
        if given and capabilities.last_image == LAST_IMAGE_NONE:
            return f"{self.label} ({self.name}) takes no last image here: {capabilities.last_image_why}"
        if not given and capabilities.last_image == LAST_IMAGE_REQUIRED:
            return f"{self.label} ({self.name}): {capabilities.last_image_why}"
        return None

    @property
    def takes_true_cfg(self) -> bool:
        return self.negative == NEGATIVE_TRUE_CFG

    def size_for(self, pipe: Any) -> tuple[int, int]:
        """The (width, height) a request gets when it names no size."""
        return self.default_size(pipe) if callable(self.default_size) else tuple(self.default_size)

    def fps_for(self, pipe: Any) -> int | None:
        """The frame rate the loaded pipeline's clips are written at (None: an image pipeline)."""
        return int(self.fps(pipe)) if callable(self.fps) else self.fps

    def guidance_for(self, pipe: Any) -> float | None:
        """The guidance scale a request gets when it names none."""
        if self.guidance == GUIDANCE_GUIDER:
            return float(pipe.guider.guidance_scale)
        return self.default_guidance

    def check_request(self, fields: "set[str] | frozenset[str]",
                      capabilities: "Capabilities | None" = None) -> tuple[str, str] | None:
        """``(field, why)`` when a request naming ``fields`` cannot run on this pipeline (and, given
        the loaded checkpoint's ``capabilities``, on that checkpoint), else None. Only the fields a
        caller set explicitly count: a default never makes a request fail."""
        if "guidance_scale_2" in fields:
            if self.guidance_2_kwarg is None:
                return "guidance_scale_2", (f"{self.label} ({self.name}) takes no guidance_scale_2 (one guidance "
                                            "scale: guidance_scale)")
            if capabilities is not None and not capabilities.guidance_2:
                return "guidance_scale_2", (f"{self.label} ({self.name}) takes no guidance_scale_2 here: "
                                            f"{capabilities.guidance_2_why}")
        if "guidance_scale" in fields and self.guidance is None:
            return "guidance_scale", (f"{self.label} ({self.name}) takes no guidance_scale: its classifier-free "
                                      "guidance is negative_prompt with true_cfg_scale above 1")
        if "true_cfg_scale" in fields and not self.takes_true_cfg:
            how = "guidance_scale" if self.guidance else "none"
            return "true_cfg_scale", f"{self.label} ({self.name}) takes no true_cfg_scale (its guidance: {how})"
        if "negative_prompt" in fields and self.negative is None:
            return "negative_prompt", f"{self.label} ({self.name}) takes no negative_prompt"
        return None


PIPELINE_SPECS: dict[str, PipelineSpec] = {
    s.name: s
    for s in (
        # FLUX.1: guidance_scale feeds the distilled guidance embedding (dev); true CFG is
        # negative_prompt + true_cfg_scale > 1 (two transformer passes per step).
        PipelineSpec("FluxPipeline", "FLUX.1", negative=NEGATIVE_TRUE_CFG, default_steps=28, default_guidance=3.5),
        # FLUX.2 dev: distilled guidance embedding, no negative prompt.
        PipelineSpec("Flux2Pipeline", "FLUX.2", negative=None, default_steps=50, default_guidance=4.0),
        # FLUX.2 Klein: real CFG on the base models, against an empty negative prompt (its call
        # takes negative_prompt_embeds only, no negative_prompt text).
        PipelineSpec("Flux2KleinPipeline", "FLUX.2 Klein", negative=None, default_steps=50, default_guidance=4.0),
        PipelineSpec("StableDiffusion3Pipeline", "Stable Diffusion 3", default_steps=28, default_guidance=7.0),
        # FLUX.1 Kontext: FLUX.1's call (distilled guidance, true CFG with a negative prompt) plus
        # an optional image to edit; defaults from diffusers 0.42.1's __call__ signature (28 steps,
        # guidance 3.5). One image conditions the whole call (a list would be resized to the first
        # one's resolution), so requests share a call only on the same image. The call rescales
        # height x width to max_area (1024² by default): the runtime passes the requested area.
        # The input image itself is resized to Kontext's preferred resolution nearest its aspect
        # (_auto_resize, as diffusers does by default).
        PipelineSpec("FluxKontextPipeline", "FLUX.1 Kontext", negative=NEGATIVE_TRUE_CFG, default_steps=28,
                     default_guidance=3.5, image_kwarg="image", image_optional=True, area_kwarg="max_area"),
        # FLUX.1 Fill (inpainting / outpainting): every default from diffusers 0.42.1's
        # FluxFillPipeline.__call__ signature: 50 steps, guidance_scale 30.0 (the distilled
        # guidance embedding; FLUX.1 Fill dev is guidance-distilled and the call has no
        # negative_prompt / true_cfg_scale), height / width default_sample_size (128) x the VAE's 8
        # = 1024, sides in 16s (2x2 packed latents). It takes an image and its mask_image (white =
        # repaint), both resized to height x width by its processors. One image and mask per
        # prompt (lists): with one image for a batch, _encode_vae_image and the masked image's
        # latent sample draw from generator[0] only (the first image's noise comes after that draw,
        # the others' not), so an image would depend on its place in the batch; as lists every
        # generator draws the same for its own image, and requests on different images and masks
        # share a call. strength stays at its 1.0 (the latents start from pure noise).
        PipelineSpec("FluxFillPipeline", "FLUX.1 Fill", negative=None, default_steps=50, default_guidance=30.0,
                     image_kwarg="image", image_per_sample=True, mask_kwarg="mask_image"),
        # Qwen-Image: guidance_scale exists only for guidance-distilled checkpoints; CFG is
        # negative_prompt + true_cfg_scale (diffusers' default 4.0, used only with a negative prompt).
        PipelineSpec("QwenImagePipeline", "Qwen-Image", guidance=None, negative=NEGATIVE_TRUE_CFG,
                     default_steps=50, default_guidance=None, default_true_cfg=4.0),
        # Its transformer's forward reads tensors on the host (the RoPE positions' tolist, the
        # image-token count): no CUDA graph can be captured of it.
        PipelineSpec("QwenImage21Pipeline", "Qwen-Image 2.1", guidance=None, negative=NEGATIVE_TRUE_CFG,
                     default_steps=40, default_guidance=None, default_size=(1024, 1024), cuda_graphs=False),
        PipelineSpec("ZImagePipeline", "Z-Image", default_steps=50, default_guidance=5.0,
                     default_size=(1024, 1024)),
        # Chroma's timestep embedder copies a CPU tensor to the GPU every forward, which capture
        # refuses (round 19); the chroma.timestep_embed site keeps it on the device, and the graph
        # captured and replayed bitwise in round 20 (H100: tests/gpu/test_chroma_gpu.py, B=1 and 2).
        PipelineSpec("ChromaPipeline", "Chroma", default_steps=35, default_guidance=5.0),
        # Wan 2.1 / 2.2 text-to-video: 81 frames at 832x480 by default (diffusers' __call__), 16 fps
        # (5 s), or 24 fps for Wan 2.2 TI2V-5B (_wan_fps). Sides in multiples of the VAE's factor
        # times the patch (16; 32 on TI2V-5B's 16x VAE). Wan 2.2 A14B's two experts are the
        # pipeline's own business (transformer / transformer_2 by step); guidance_scale goes to
        # both unless a request names guidance_scale_2 (transformer_2's: the call's
        # guidance_scale_2, which defaults to guidance_scale), taken only by two-expert checkpoints.
        PipelineSpec("WanPipeline", "Wan", kind="video", default_steps=50, default_guidance=5.0,
                     default_size=(832, 480), size_multiple=_wan_multiple, fps=_wan_fps, default_frames=81,
                     guidance_2_kwarg="guidance_scale_2", guidance_2_rule=_wan_guidance_2),
        # Wan 2.1 / 2.2 image-to-video (WanImageToVideoPipeline): every default from diffusers
        # 0.42.1's __call__ signature (50 steps, guidance 5.0 with CFG above 1, 832x480, 81 frames
        # at Wan's 16 fps). A request's image is resized to the clip's size (video_processor); a
        # request naming no size gets the image's aspect ratio at the default's area (diffusers'
        # I2V example does the same). Wan 2.1 I2V encodes the image with CLIP as well (one image
        # per call: image_embeds.repeat(batch_size)); Wan 2.2 A14B / TI2V-5B use only its latents
        # (the same ones for every video of a call). Frame rate and sides as WanPipeline's, and its
        # guidance_scale_2 (I2V-A14B). A last image (last_image: the clip ends on it, resized to the
        # clip's size by the same video_processor as the first) where the checkpoint takes one
        # (_wan_last_image: optional on I2V-A14B, required on Wan2.1-FLF2V-14B, refused elsewhere).
        PipelineSpec("WanImageToVideoPipeline", "Wan image-to-video", kind="video", default_steps=50,
                     default_guidance=5.0, default_size=(832, 480), size_multiple=_wan_multiple, fps=_wan_fps,
                     default_frames=81, image_kwarg="image", guidance_2_kwarg="guidance_scale_2",
                     guidance_2_rule=_wan_guidance_2, last_image_kwarg="last_image", last_image_rule=_wan_last_image),
        # HunyuanVideo 1.5 text-to-video: its guidance scale lives on the guider component; 24 fps,
        # 121 frames (5 s) by default.
        PipelineSpec("HunyuanVideo15Pipeline", "HunyuanVideo 1.5", kind="video", guidance=GUIDANCE_GUIDER,
                     default_steps=50, default_guidance=None, default_size=_hunyuanvideo15_default,
                     size_multiple=_hunyuanvideo15_multiple, fps=24, default_frames=121,
                     prepare=_hunyuanvideo15_prepare),
        # HunyuanVideo 1.5 image-to-video (HunyuanVideo15ImageToVideoPipeline): text-to-video's
        # guider, VAE-slicing hook and defaults (its __call__ has the same: 50 steps, 121 frames;
        # 24 fps), plus the image. One image conditions the whole call (its SigLIP tokens are
        # repeated over the batch, its latents too), so only requests on the same image share one.
        # The call takes no height / width: it crops the image to the aspect bucket nearest its own
        # at the transformer's target_size (848x480 for 16:9 at 480p's 640), and that is the clip's
        # size: size_from_image says which, fit_image fits a request's image to a named bucket first.
        # The default size (for the tables) is what a 16:9 image gives.
        PipelineSpec("HunyuanVideo15ImageToVideoPipeline", "HunyuanVideo 1.5 image-to-video", kind="video",
                     guidance=GUIDANCE_GUIDER, default_steps=50, default_guidance=None,
                     default_size=_hunyuanvideo15_i2v_default, size_multiple=_hunyuanvideo15_multiple, fps=24,
                     default_frames=121, prepare=_hunyuanvideo15_prepare, image_kwarg="image",
                     size_from_image=_hunyuanvideo15_image_size, fit_image=_hunyuanvideo15_fit_image,
                     sizing=_hunyuanvideo15_sizing),
        # LTX-Video text-to-video; every default from diffusers 0.42.1's LTXPipeline.__call__:
        # 50 steps, guidance_scale 3 (CFG with a negative prompt, "" by default), 704x512,
        # 161 frames at frame_rate 25 (6.4 s); sides multiples of 32 (check_inputs), 8k + 1 frames.
        PipelineSpec("LTXPipeline", "LTX-Video", kind="video", default_steps=50, default_guidance=3.0,
                     default_size=(704, 512), size_multiple=_ltx_multiple, fps=25, default_frames=161,
                     frame_multiple=_ltx_temporal, fps_kwarg="frame_rate"),
        # LTX-Video image-to-video (LTXImageToVideoPipeline), with LTXPipeline's defaults (its
        # __call__ has the same: 50 steps, guidance 3, 704x512, 161 frames at 25 fps). Its call
        # takes a list of images, one per prompt (prepare_latents encodes image[i] with
        # generator[i]), so a batch may hold requests on different images.
        PipelineSpec("LTXImageToVideoPipeline", "LTX-Video image-to-video", kind="video", default_steps=50,
                     default_guidance=3.0, default_size=(704, 512), size_multiple=_ltx_multiple, fps=25,
                     default_frames=161, frame_multiple=_ltx_temporal, fps_kwarg="frame_rate",
                     image_kwarg="image", image_per_sample=True),
        # LTX-Video 0.9.5+ (LTXConditionPipeline: the 0.9.5 / 0.9.7 / 0.9.8 checkpoints' pipeline,
        # 2B and 13B); every default from diffusers 0.42.1's __call__ signature: 50 steps,
        # guidance_scale 3 (CFG with a negative prompt, "" by default), 704x512, 161 frames at
        # frame_rate 25; sides multiples of 32 (check_inputs), 8k + 1 frames. Text-to-video without
        # an image (no conditions: the plain denoising loop), or image-to-video: the request's image
        # is the call's `image`, one condition at the call's default frame_index 0 and strength 1.0
        # (its latents replace the first latent frame; per-token timesteps). A list of images would
        # be several conditions of every video, not one per prompt: one image conditions the whole
        # call, so requests share a call only on the same image, and image_alone makes that one
        # video per call (the image's latent sample takes the first video's generator).
        PipelineSpec("LTXConditionPipeline", "LTX-Video condition", kind="video", default_steps=50,
                     default_guidance=3.0, default_size=(704, 512), size_multiple=_ltx_multiple, fps=25,
                     default_frames=161, frame_multiple=_ltx_temporal, fps_kwarg="frame_rate",
                     image_kwarg="image", image_optional=True, image_alone=True),
        # HunyuanVideo (1.0) text-to-video; every default from diffusers 0.42.1's
        # HunyuanVideoPipeline.__call__: 50 steps, 1280x720, 129 frames. The released model is
        # guidance-distilled: guidance_scale (6.0) feeds the transformer's guidance embedding (one
        # pass per step), and true CFG runs only with negative_prompt and true_cfg_scale > 1
        # (default 1.0: off), the FLUX.1 way. The call takes no frame rate; clips are written at
        # 24 fps, the rate of Tencent's sample_video.py (diffusers' docstring example writes 15).
        # Frames 4k + 1 (prepare_latents floors (frames - 1) / 4); a batch of two decodes as is
        # (tests/cpu/test_videos_hunyuanvideo.py), so no prepare hook.
        PipelineSpec("HunyuanVideoPipeline", "HunyuanVideo", kind="video", negative=NEGATIVE_TRUE_CFG,
                     default_steps=50, default_guidance=6.0, default_true_cfg=1.0, default_size=(1280, 720),
                     size_multiple=_hunyuanvideo_multiple, fps=24, default_frames=129),
        # SkyReels-V2 text-to-video (SkyReelsV2Pipeline: Wan's T2V pipeline on Wan's components
        # around SkyReelsV2Transformer3DModel). Every default from diffusers 0.42.1's
        # SkyReelsV2Pipeline.__call__ signature: 50 steps, guidance_scale 6.0 (CFG whenever above 1,
        # against negative_prompt, "" by default: encode_prompt), 960x544 (540p), 97 frames.
        # Sides in 16s (check_inputs; also the latent grid's VAE 8x times the 1x2x2 patch).
        # Frames 4k + 1 from the VAE's temporal ratio (2 ** sum(temperal_downsample) = 4); the
        # pipeline itself rounds any other count down with a warning, the runtime refuses it.
        # The call takes no frame rate (the transformer's fps embedding, inject_sample_info, is
        # driven by the diffusion-forcing pipelines only); clips are written at 24 fps: the
        # SkyReels-V2 model cards' rate, the fps of diffusers' docstring example
        # (export_to_video(..., fps=24)) and SkyReelsV2DiffusionForcingPipeline's fps default.
        # A batch of two decodes as is (AutoencoderKLWan, as Wan's): no prepare hook
        # (tests/cpu/test_videos_skyreels_v2.py).
        PipelineSpec("SkyReelsV2Pipeline", "SkyReels-V2", kind="video", default_steps=50, default_guidance=6.0,
                     default_size=(960, 544), size_multiple=_skyreels_v2_multiple, fps=24, default_frames=97),
        # SkyReels-V2 image-to-video (SkyReelsV2ImageToVideoPipeline: Wan 2.1 I2V's pipeline around
        # SkyReelsV2Transformer3DModel). Every default from diffusers 0.42.1's __call__ signature:
        # 50 steps, guidance_scale 5.0 (CFG whenever above 1, as text-to-video's), 960x544, 97
        # frames; sides in 16s (check_inputs), 4k + 1 frames, 24 fps as text-to-video's (its
        # docstring example exports at 24; the call takes no frame rate). One image conditions the
        # whole call (check_inputs takes one PIL image or tensor; its CLIP tokens are repeated
        # over the batch, image_embeds.repeat(batch_size), and its latents too), so only requests
        # on the same image share one. A request naming no size gets the image's aspect ratio at
        # the default's area, as for Wan. The call's last_image (first-last-frame) as Wan 2.1's: only a
        # transformer with a position embedding for two images' CLIP tokens takes it (_wan_last_image).
        PipelineSpec("SkyReelsV2ImageToVideoPipeline", "SkyReels-V2 image-to-video", kind="video",
                     default_steps=50, default_guidance=5.0, default_size=(960, 544),
                     size_multiple=_skyreels_v2_multiple, fps=24, default_frames=97, image_kwarg="image",
                     last_image_kwarg="last_image", last_image_rule=_wan_last_image),
    )
}


def spec_for(class_name: str | None) -> PipelineSpec:
    """The row for ``class_name``; for a class not in the table, the FLUX-style image row."""
    if class_name in PIPELINE_SPECS:
        return PIPELINE_SPECS[class_name]
    return PipelineSpec(
        name=class_name or "?", label=class_name or "this pipeline", negative=NEGATIVE_TRUE_CFG, known=False
    )


def unknown_pipeline_note(spec: PipelineSpec) -> str | None:
    """The log line for a pipeline class the table does not list (None for a listed one)."""
    if spec.known:
        return None
    listed = ", ".join(sorted(PIPELINE_SPECS))
    return (f"{spec.name} is not one of the pipelines ditfuse's runtime knows ({listed}): calling it as a "
            "text-to-image pipeline with guidance_scale, and a negative prompt through true_cfg_scale")
