"""The model-family protocol: everything the stages need to know about one architecture.

The class lives in `stages/families/<family>/family.py`; beside it the family's folder holds its
torch-free config checks and demo hints (`__init__.py`), its tiny pipeline (`tiny.py`) and its
full-size architecture for bench/ (`full.py`); `stages.families` lists what each must define.

A family is a small object with no state beyond caches of shape-dependent tensors. The stages call
only these methods, so adding a family never touches a stage. A family class inherits
`FamilyTraits`, which declares every optional trait with its default, and sets only the ones that
differ; the stages read the traits as plain attributes. Shared math lives in plain functions
(`stages.core.flow`) and shared family code in `stages.families.common`.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ContextManager, Mapping, Protocol

from stages.core.batch import BatchMeta  # noqa: F401 - the families' loss takes it; core builds it

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from stages.core.comfyui import ComfyLayout
    from stages.core.config import CaptionsConfig, TrainConfig
    from stages.core.aspect_buckets import Variant
    from stages.core.kohya import Layout
    from stages.core.model_source import ModelSource
    from stages.core.runtime import Runtime


class TextEncoder(Protocol):
    def encode(self, texts: list[str]) -> dict[str, "torch.Tensor"]:
        """Per-caption conditioning, every tensor shaped (len(texts), ...) with fixed trailing dims."""

    def token_counts(self, texts: list[str]) -> list[int]:
        """Tokens each caption needs before truncation (to report captions that get cut)."""


class Family(Protocol):
    """The members every family defines; the optional ones, with their defaults, are `FamilyTraits`."""

    name: str
    pipeline_class: str
    """diffusers pipeline class that loads the exported LoRA (e.g. "FluxPipeline")."""
    lora_prefix: str
    """Top-level key of the denoiser in diffusers LoRA files: "transformer" or "unet"."""
    denoiser_class: str
    vae_class: str
    """diffusers classes of the denoiser and the VAE (the stage-isolation test checks who builds them)."""
    default_lora_targets: tuple[str, ...]
    text_component_classes: tuple[str, ...]
    """Model classes encode-captions constructs (the stage-isolation test checks the others don't)."""
    text_components: tuple[str, ...]
    """Pipeline subfolders each stage reads; they define the model identity in its fingerprint."""
    vae_components: tuple[str, ...]
    denoiser_components: tuple[str, ...]
    kohya_layout: "Layout"
    """kohya (sd-scripts) key names of the denoiser's modules (`stages.core.kohya.GENERIC`: the diffusers paths)."""
    comfyui_layout: "ComfyLayout"
    """The denoiser as ComfyUI loads it: its model class and where each diffusers module lands
    (`stages/families/<family>/comfyui.py`); the ComfyUI-ready export and its check follow it."""
    # encode-captions
    def load_text_encoder(self, src: "ModelSource", cfg: "CaptionsConfig", rt: "Runtime") -> TextEncoder: ...

    # cache-latents
    def load_vae(self, src: "ModelSource", rt: "Runtime") -> "torch.nn.Module": ...

    def pixel_multiple(self, src: "ModelSource") -> int:
        """Bucket sides must be multiples of this (VAE downsampling x latent patch size)."""

    def encode_posterior(self, vae: "torch.nn.Module", pixels: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """Pixels in [-1, 1], (B, 3, H, W) -> posterior (mean, logvar), each (B, C, h, w)."""

    def latent_normalization(self, vae: "torch.nn.Module") -> dict[str, Any]:
        """JSON-able constants that `normalize_latents` needs; stored in the latents manifest."""

    # train
    def normalize_latents(self, z: "torch.Tensor", norm: dict[str, Any]) -> "torch.Tensor": ...

    def denormalize_latents(self, x: "torch.Tensor", norm: dict[str, Any]) -> "torch.Tensor": ...

    def load_denoiser(self, src: "ModelSource", precision: str, rt: "Runtime", tcfg: "TrainConfig") -> "torch.nn.Module": ...

    def sample_timesteps(self, n: int, latent_hw: tuple[int, ...], generator: "torch.Generator", tcfg: "TrainConfig",
                         first: int | None = None) -> "torch.Tensor":
        """Training timesteps for n samples (flow families: sigmas in (0, 1], drawn by `flow.draw_u`);
        `latent_hw` is the latent's size after its channels: (h, w), or (frames', h, w) for a video family's
        5-D latents (LTX-2's shift counts every token of the clip); `first` is the run's index of the first draw, which train.timestep_buckets stratifies by (None:
        unstratified, as validation draws)."""

    def loss(
        self,
        denoiser: "torch.nn.Module",
        x0: "torch.Tensor",
        noise: "torch.Tensor",
        t: "torch.Tensor",
        cond: dict[str, "torch.Tensor"],
        meta: BatchMeta,
        tcfg: "TrainConfig",
    ) -> "torch.Tensor":
        """Per-sample training loss (B,), from one denoiser forward over the whole batch."""


class FamilyTraits:
    """Every optional family trait with its default. Declarations only: a family sets the ones that
    differ, the stages and the memory planner read them."""

    # ---- how reports name it
    title: str = ""
    """The model's name in tables and reports (e.g. "FLUX.2 [klein]"; empty: the family name)."""
    vae_downsample: int = 8
    """Pixels per latent cell along a side (the VAE's spatial downsampling; Qwen-Image 2.1: 16)."""

    # ---- memory planner (stages/core/memory/)
    auto_base_precisions: tuple[str, ...] | None = None
    """train.base_precision = "auto" tries these whole, fastest first (None: the planner's
    `stages.core.memory.AUTO_BASE_PRECISIONS`: bf16, fp8, nf4)."""
    fp8_faster_from_tokens: int | None = None
    """The smallest step (batch x (image + text tokens)) measured faster in fp8 than bf16 (on the H200, or an H100
    where the family's line says so); from there "auto" tries fp8 before bf16 (None: no fp8 rows, bf16 stays first)."""
    outside_block_gb: tuple[float, float] = (0.0, 0.0)
    """(GB, GB per 512x512 sample) of train activations outside the repeated blocks, which the
    per-block model does not see (SDXL's ResNets)."""
    block_saved_units: Mapping[str, float] = MappingProxyType({})
    """Block class -> train activations one un-checkpointed block keeps for its backward, in units of
    tokens x width x 2 bytes, where not `stages.core.memory.BLOCK_SAVED_UNITS` (FLUX.1's single blocks)."""
    block_work_units: float | None = None
    """Train activations of the block being run or recomputed, in the same units (None: the planner's
    `stages.core.memory.BLOCK_WORK_UNITS`; FLUX.2's fused single blocks: 35)."""
    blocks_in_run_order: bool = True
    """False where the denoiser lists its repeated blocks in another order than it runs them (SDXL's
    UNet: listed down, up, mid): runtime.block_swap_layout = "spread" is refused there."""
    attention_per_block: bool = True
    """Each repeated block runs one attention at the block's width, what runtime.keep_attention counts;
    False (SDXL's UNet blocks) refuses runtime.keep_attention."""
    repeated_blocks: tuple[str, ...] = ()
    """The denoiser's repeated block classes where its diffusers class names none (`_repeated_blocks`), which
    the train planner's meta model then gets (HiDream-I1; its loaded denoiser names them itself)."""
    text_offload_components: tuple[str, ...] = ()
    """Text encoders loaded through `text_encoders.load_text_model`, whose layers encode-captions may
    offload to CPU memory when not even nf4 fits its budget (empty: never offloaded)."""
    text_keeps_hidden_states: bool = True
    """The text encoders run with `output_hidden_states=True` (the family reads an inner layer's states), so
    an encode holds every layer's states at once, which encode-captions' planner counts; False where only the
    last hidden state or the pooled output is read (FLUX.1's T5 and CLIP)."""
    text_whole_components: tuple[str, ...] = ()
    """Text encoders that stay in bf16 when captions.text_encoder_precision is nf4 (FLUX.1's and HiDream's
    CLIPs), which encode-captions' planner counts at their bf16 size."""
    text_tokens_beyond_max: int = 77
    """Tokens a text encoder reads beyond captions.max_sequence_length (a chat template's system prefix that
    the pipeline drops afterwards), which encode-captions' planner counts; 0 where every encoder reads at most
    max(captions.max_sequence_length, 77) tokens (FLUX.1's T5 padded to the length, its CLIP to 77)."""
    text_padded_to_longest: bool = False
    """The text encoders read a batch's captions padded to its longest (the pipeline tokenizes with padding=True
    or none), not to captions.max_sequence_length: an encode's memory follows the captions' real length, while
    encode-captions' planner, which does not read them, plans for the longest the setting allows (Qwen-Image,
    its edit models, Qwen-Image 2.1, ERNIE-Image)."""
    captions_cut_to_longest: bool = False
    """A training batch's caption rows are cut to its longest caption and the rest masked, so each caption length
    is a batch shape, which runtime.caption_tokens_multiple rounds up; False where the text has one length (FLUX.1's
    T5) or the denoiser takes each caption at its own length."""

    # ---- video families (images are 1-frame clips there)
    trains_video: bool = False
    """The family trains on clips (data.frames frames each) and on images; False: a clip in its dataset is a
    bad input, named. Its latents are (C, frames', h, w) and its loss takes x0 (B, C, frames', h, w)."""
    frame_rate: float = 0.0
    """Frames per second of the clips the model generates (video families): what sample's grid of clips plays
    at where data.fps = 0, so that it plays at real speed."""
    frames_per_latent: int = 1
    """Frames each latent frame after the first holds (the causal VAE's temporal downsampling; Wan: 4), so
    data.frames must be k x this + 1; the planners count (frames - 1) / this + 1 latent frames."""
    vae_frames_in_flight: int = 1
    """Frames the VAE encodes at once (Wan's causal encoder: 1, then 4 with cached features): what the
    latents planner counts as one encode's working set."""
    outside_rows_per_token: float = 0.0
    """fp32 rows of the model's width that each image token keeps outside the repeated blocks during a train step
    (Wan 2.2 TI2V: its per-token timestep embedding, 6 modulation rows + temb + the embedder's hidden = 8)."""
    pixels_per_token: int = 16
    """Pixels along a side per denoiser token (VAE downsampling x patch: 8 x 2 for the 2x2-patched image
    families; Wan 2.2 TI2V-5B: 16 x 2): the train and sample planners' token count."""

    # ---- two-expert models (Wan 2.2 A14B): a run trains the expert train.expert names, or each of them
    experts: tuple[str, ...] = ()
    """The denoisers train.expert picks from, in the order train.expert = "both" trains them (Wan 2.2 A14B:
    "high", "low"), each with its own adapter in lora/<expert>/ and export in export/<expert>/; () for a
    one-denoiser family (lora/ and export/)."""

    pipeline_modules: tuple[str, ...] = ()
    """Modules a pipeline folder of this family may name for a component's class (Qwen-Image-Edit's processor
    without torchvision), which diffusers loads only once they are imported: `families.pipeline_class` imports
    them before returning the pipeline's class."""

    def trained_component(self, tcfg: "TrainConfig") -> str:
        """The pipeline component whose weights the run's adapter is trained on (the export reads DoRA's base
        weights from it): the denoiser, or the expert train.expert names."""
        return self.denoiser_components[0]

    def lora_load_kwargs(self, tcfg: "TrainConfig") -> dict[str, Any]:
        """Extra arguments of `<Pipeline>.load_lora_weights` that put the exported LoRA on the denoiser it was
        trained for (default: none; the low-noise Wan expert: load_into_transformer_2)."""
        return {}

    def file_tag(self, tcfg: "TrainConfig") -> str:
        """Tag in the ComfyUI and kohya files' names where the model's denoisers load as separate models
        ("high_noise": `<run>_high_noise_comfyui.safetensors`, `lora_high_noise_kohya.safetensors`; default "")."""
        return ""

    # ---- controls: edit families (min >= 1) and those with optional references (min 0)
    control_range: tuple[int, int] = (0, 0)
    """Min and max control images per item ((0, 0): none; min 0: optional, and then the items have all
    none or all the same count)."""
    text_sees_controls: bool = False
    """The text encoder reads the controls: caption rows are keyed by both, and its encode takes
    `controls=`, one list of PIL images per text, one caption at a time (as the pipeline), whatever
    captions.batch_size is."""
    text_tokens_per_control: int = 0
    """Tokens a control adds to what the text encoder reads, where it reads the controls (their vision tokens),
    which encode-captions' planner counts."""

    def control_images(self, control: "Image.Image", size: tuple[int, int], variants: list["Variant"],
                       bucket: tuple[int, int]) -> list["Image.Image"]:
        """One PIL image per variant: the control as the family's pipeline would feed it next to that
        crop of the target. Defined by the families with a control_range."""
        raise NotImplementedError(f"{type(self).__name__} takes no control images")

    # ---- sample
    sample_components: tuple[str, ...] = ()
    """Pipeline subfolders only `sample` loads, besides the stages' own: denoisers that are not trained (Ideogram
    4's unconditional transformer), which its memory plan counts and its nf4 load quantizes."""
    distilled_ignores_guidance: bool = False
    """The pipeline turns guidance off when model_index.json says `is_distilled` (FLUX.2 klein), so
    `sample` hands it 1.0."""

    def sample_image_kwargs(self, controls: list["Image.Image"], size: tuple[int, int]) -> dict[str, Any]:
        """The pipeline call's image arguments for `sample`. Defined by the families with a control_range."""
        raise NotImplementedError(f"{type(self).__name__} takes no control images")

    def sample_kwargs(self, pipe: Any, prompts: list[str], scale: float, steps: int) -> dict[str, Any] | None:
        """The pipeline call's guidance (and other) arguments for sample.guidance_scale, sample.steps and the
        prompts, where the family's pipeline takes others than one guidance_scale (Ideogram 4: a per-step
        schedule, and its text padding cut to the prompts); None: the shared rule (`stages.sample.guidance_kwargs`)."""
        return None

    def sample_context(self, size: tuple[int, int]) -> ContextManager[Any]:
        """A context manager around each `sample` pipeline call (default: none)."""
        return contextlib.nullcontext()
