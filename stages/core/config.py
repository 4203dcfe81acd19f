"""Typed run configuration: TOML file -> dataclasses, validated before any model loads.

    from stages.core.config import load_config
    cfg = load_config("configs/flux-dev.toml", overrides={"train.steps": 200})

Every key is declared here with its default and meaning. An unknown key is an error that names the
nearest valid key; every error in a file is collected and reported at once (torchtune's habit), so a
user fixes a config in one round trip instead of one GPU start per typo.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from stages.core.config_values import FORMS, value_errors
from stages.core.ranges import AT_LEAST_ONE, FRACTION, MIN_RESOLUTION, NON_NEGATIVE, POSITIVE, Range, SEED_MAX
from stages.core.errors import ConfigError


@dataclass
class DataConfig:
    path: str = "data"
    """Folder of images with same-stem .txt captions, or holding a metadata.jsonl (file_name, text)."""
    resolution: Annotated[int, Range(MIN_RESOLUTION)] = 1024
    """Target side: buckets have an area near resolution**2."""
    bucket_step: Annotated[int, NON_NEGATIVE] = 0
    """Bucket sides are multiples of this (0: the family's own, e.g. 16 for FLUX)."""
    max_aspect: Annotated[float, Range(1)] = 3.0
    """Widest bucket aspect ratio (long side / short side)."""
    cache_variants: Annotated[int, AT_LEAST_ONE] = 4
    """Crop/flip variants cached per image; each training step samples one at random."""
    random_flip: bool = True
    """Odd-numbered variants are horizontally flipped."""
    crop: Literal["random", "center"] = "random"
    """Where each variant's crop box sits when the resized image overhangs its bucket."""
    crop_zoom: Annotated[float, NON_NEGATIVE] = 0.1
    """Variants after the first are resized up to this much larger than needed, then cropped."""
    caption_ext: str = ".txt"
    """Extension of the same-stem caption files."""
    on_bad_image: Literal["error", "skip"] = "error"
    """What cache-latents does with an unreadable image: stop with its name, or skip and list it."""
    background: str = "white"
    """Colour that transparency is composited on (a PIL colour name or #rrggbb)."""
    follow_symlinks_outside: bool = False
    """Read images and captions that are symlinks to files outside data.path (off: such a file is an error)."""
    bucket_merge: bool = False
    """Move the images of aspect buckets holding fewer than train.batch_size images to the nearest bucket
    that holds enough, so batches fill (those images are cropped more); rebuilds latents.zarr."""
    repeats: Annotated[int, AT_LEAST_ONE] = 1
    """Times each image is trained per epoch (a [[datasets]] table sets its own)."""
    weight: Annotated[float, NON_NEGATIVE] = 0.0
    """Fractional repeats instead of `repeats` (0: off): each epoch trains every image floor(weight) times
    plus a seeded, fresh share frac(weight) of the images once more (0.5: a random half per epoch)."""
    caption_dropout: Annotated[float, Range(0, 1)] = 0.0
    """Probability that a step trains an item on the empty caption (its encoding is cached once, or once per
    control set when the text encoder sees the control images)."""
    caption_lines: Literal["whole", "variants"] = "whole"
    """whole: a caption file is one caption; variants: each non-empty line is a caption, one drawn per step.
    Files <stem>.1<ext>, <stem>.2<ext>, ... beside the caption are always further variants."""
    shuffle_tags: bool = False
    """Shuffle a caption's comma-separated tags: caption_variants seeded orders per caption are cached."""
    keep_tokens: Annotated[int, NON_NEGATIVE] = 0
    """With shuffle_tags: the first N tags stay in place (e.g. a trigger word)."""
    caption_variants: Annotated[int, AT_LEAST_ONE] = 8
    """With shuffle_tags: tag orders cached per caption (distinct ones; one is drawn per step)."""
    role: Literal["train", "regularization"] = "train"
    """train: learn the images. regularization (with train.preservation = "dataset"): its items train toward the
    base model's own prediction on their caption (adapter off), not toward their image."""
    frames: Annotated[int, AT_LEAST_ONE] = 33
    """Frames each clip trains on (video families; Wan: 4k + 1, e.g. 33 or 81; LTX-2: 8k + 1); images are
    1-frame clips. More frames cost memory and time in proportion: lower it before data.resolution."""
    fps: Annotated[float, NON_NEGATIVE] = 0.0
    """Frame rate the clips are sampled at (0: each clip's own frames, one after another). Wan 2.2 TI2V-5B makes
    24 fps video, T2V-A14B 16; LTX-2 takes 24 or 0. A clip shorter than data.frames at this rate is a bad
    input: lower data.frames or data.fps."""


# Keys a [[datasets]] table may set; any it leaves out come from [data]. The rest of [data]
# (bucket_step, max_aspect, bucket_merge, on_bad_image, background) applies to the whole run.
DATASET_KEYS = ("path", "name", "resolution", "cache_variants", "random_flip", "crop", "crop_zoom", "caption_ext",
                "follow_symlinks_outside", "repeats", "weight", "caption_dropout", "caption_lines", "shuffle_tags",
                "keep_tokens", "caption_variants", "role", "frames", "fps")
DATASET_DOCS = {"path": "A dataset folder (required in each [[datasets]] table; relative to the config file).",
                "name": "Prefix of the dataset's item keys ('<name>/<file>'); default: the folder's name."}


@dataclass
class CaptionsConfig:
    max_sequence_length: Annotated[int, AT_LEAST_ONE] = 512
    """Text tokens kept per caption (FLUX's T5: 512 for dev, 256 for schnell; longer is truncated)."""
    text_encoder_precision: Literal["auto", "fp32", "bf16", "nf4"] = "auto"
    """auto: on CUDA bf16 if it fits the stage's memory budget, else nf4 (else bf16 with layer offload);
    fp32 on CPU. nf4 needs CUDA (bitsandbytes)."""
    batch_size: Annotated[int, AT_LEAST_ONE] = 8
    """Captions per text-encoder forward."""


@dataclass
class LatentsConfig:
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """Storage dtype of the posterior mean and logvar (zarr has no bfloat16: stored as raw bits)."""
    vae_precision: Literal["auto", "fp32", "bf16"] = "fp32"
    """VAE dtype while caching (fp32 default: SDXL's VAE overflows in fp16)."""


@dataclass
class TrainConfig:
    steps: Annotated[int, AT_LEAST_ONE] = 1000
    """Optimizer steps."""
    batch_size: Annotated[int, AT_LEAST_ONE] = 1
    """Samples per step, all from one aspect bucket, in one denoiser forward."""
    learning_rate: Annotated[float, POSITIVE] = 1e-4
    """Peak LR of the LoRA parameters (prodigy, prodigy_schedulefree: ~1.0, a multiplier of their own estimate)."""
    lr_scheduler: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = "constant"
    """LR schedule after warmup (diffusers get_scheduler)."""
    lr_warmup_steps: Annotated[int, NON_NEGATIVE] = 0
    """Linear warmup steps of the LR schedule (diffusers get_scheduler)."""
    lr_num_cycles: Annotated[int, AT_LEAST_ONE] = 1
    """Hard restarts of cosine_with_restarts ("cosine" is always one half cosine)."""
    lr_power: Annotated[float, POSITIVE] = 1.0
    """Exponent of the polynomial schedule."""
    optimizer: Literal["adamw", "adamw8bit", "prodigy", "prodigy_schedulefree", "adamw_schedulefree", "adafactor"] = "adamw"
    """adamw (torch, fused on CUDA), adamw8bit (bitsandbytes), prodigy and prodigy_schedulefree (their own step
    size: learning_rate ~1.0 scales it), adamw_schedulefree, adafactor (transformers; the smallest state). Schedule-free
    ones need lr_scheduler constant or constant_with_warmup: docs/configuration.md#optimizers."""
    adam_beta1: Annotated[float, FRACTION] = 0.9
    """First-moment decay of the AdamW and Prodigy optimizers."""
    adam_beta2: Annotated[float, FRACTION] = 0.999
    """Second-moment decay of the AdamW and Prodigy optimizers."""
    adam_epsilon: Annotated[float, POSITIVE] = 1e-8
    """Denominator epsilon of the AdamW and Prodigy optimizers."""
    weight_decay: Annotated[float, NON_NEGATIVE] = 1e-4
    """Decoupled weight decay of the LoRA parameters (every optimizer)."""
    max_grad_norm: Annotated[float, NON_NEGATIVE] = 1.0
    """Gradient clipping of the LoRA parameters (0: off)."""
    rank: Annotated[int, AT_LEAST_ONE] = 16
    """LoRA rank r."""
    alpha: Annotated[float, POSITIVE] = 16.0
    """LoRA alpha (scale = alpha / rank); stored in the exported file's metadata."""
    dropout: Annotated[float, FRACTION] = 0.0
    """LoRA dropout."""
    target_modules: list[str] = field(default_factory=list)
    """Module names for LoRA (empty: the family's default, e.g. FLUX attention q/k/v/out)."""
    adapter: Literal["lora", "dora", "lokr", "loha"] = "lora"
    """Adapter type (peft): lora; dora (LoRA plus a learned magnitude; diffusers loads it); lokr (Kronecker
    product) and loha (Hadamard product), exported for ComfyUI (docs/exporting.md)."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Rank of the modules whose path ends in a regex, e.g. {"to_out.0" = 4} (peft rank_pattern); others: rank."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Alpha of the modules whose path ends in a regex (peft alpha_pattern); others: alpha."""
    ema_decay: Annotated[float, FRACTION] = 0.0
    """EMA of the adapter weights, ema = decay * ema + (1 - decay) * weights after every step (0: off;
    e.g. 0.999). Saved and resumed with checkpoints; `export-lora --ema` exports it."""
    timestep_density: Literal["logit_normal", "mode", "uniform"] = "logit_normal"
    """Flow families: how training timesteps are drawn (SD3 paper, sec. 3.1)."""
    logit_mean: float = 0.0
    """logit_normal density: mean of the normal before the sigmoid."""
    logit_std: Annotated[float, POSITIVE] = 1.0
    """logit_normal density: standard deviation of the normal before the sigmoid."""
    mode_scale: Annotated[float, NON_NEGATIVE] = 1.29
    """mode density: how strongly timesteps gather at mid-range (SD3's default 1.29)."""
    shift: Annotated[float, POSITIVE] = 1.0
    """Flow-matching timestep shift s' = shift*s / (1 + (shift-1)*s); 1.0 leaves sigmas as drawn."""
    dynamic_shift: bool = False
    """Shift by image token count as FLUX's scheduler does at inference (overrides shift)."""
    guidance_scale: Annotated[float, NON_NEGATIVE] = 1.0
    """Guidance embedding value during training, for models with one (FLUX.1-dev, FLUX.2 dev); ignored
    by the others."""
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = "auto"
    """DDPM families only (SDXL): auto reads the scheduler config."""
    snr_gamma: Annotated[float, NON_NEGATIVE] = 5.0
    """DDPM families only: min-SNR-gamma loss weighting; 0 turns it off."""
    noise_offset: Annotated[float, NON_NEGATIVE] = 0.0
    """DDPM families only."""
    base_precision: Literal["auto", "nf4", "bf16", "fp32", "fp8"] = "auto"
    """auto: on CUDA the memory planner picks the first precision that fits the budget without block
    swap (bf16, then fp8 where the GPU has fp8 tensor cores (a single file: and the host can hold its bf16
    read); fp8 first where the family's fp8 step was measured faster at that step size; then nf4: measured,
    stages/core/memory.AUTO_BASE_PRECISIONS), else nf4 with blocks swapped; on CPU fp32.
    fp8: e4m3 weights, fp8 matmuls (CUDA, compute capability >= 8.9)."""
    fp8_blocks: int | str = "auto"
    """With an fp8 base: how many of the denoiser's repeated blocks (the first ones, in forward order) are fp8,
    the rest of the base nf4. auto: all of them where the budget holds the whole fp8 base, else the most that
    fit (fp8 blocks before un-checkpointed ones under gradient_checkpointing = "auto"). A number fixes it."""
    nf4_double_quant: bool = True
    """bitsandbytes double quantization of the nf4 scales."""
    loraplus_ratio: Annotated[float, NON_NEGATIVE] = 0.0
    """LoRA+: the lora_B matrices train at learning_rate x this (e.g. 16), the rest at learning_rate (0: off;
    lora and dora adapters only)."""
    timestep_min: Annotated[float, Range(0, 1)] = 0.0
    """Flow families: lowest training timestep, as a fraction of the schedule (0 clean, 1 pure noise), before
    the shift; the density is squeezed into [timestep_min, timestep_max], its shape kept."""
    timestep_max: Annotated[float, Range(0, 1)] = 1.0
    """Flow families: highest training timestep (see timestep_min); e.g. 0.5 trains only the less noisy half."""
    timestep_buckets: Annotated[int, NON_NEGATIVE] = 0
    """Flow families: stratified timesteps (0: off): the density is cut into this many equally likely ranges
    and consecutive draws (within a batch and across steps) take them in turn, so few steps still cover it."""
    weighting_scheme: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    """Flow families: loss weight per sample by its sigma, as diffusers' SD3 weighting: sigma_sqrt 1/sigma^2,
    cosmap 2/(pi(1-2 sigma+2 sigma^2)). (diffusers' logit_normal and mode are train.timestep_density here.)"""
    loss: Literal["mse", "huber", "smooth_l1"] = "mse"
    """Per-element loss of d = prediction - target: mse d^2; huber (pseudo-Huber) 2c(sqrt(d^2+c^2)-c), d^2
    near 0 and linear beyond c; smooth_l1 the same / c. c = huber_c. As sd-scripts' loss_type."""
    huber_c: Annotated[float, POSITIVE] = 0.1
    """c of train.loss = huber / smooth_l1: errors much larger than c count linearly instead of squared."""
    preservation: Literal["off", "blank_prompt", "dataset"] = "off"
    """Differential output preservation: blank_prompt adds a loss pulling the adapter's prediction on the empty
    caption (same noisy latents) to the base model's (adapter off); dataset trains the items of [[datasets]] with
    role = "regularization" toward the base model's prediction on their own caption. docs/configuration.md#regularization."""
    preservation_weight: Annotated[float, NON_NEGATIVE] = 1.0
    """Weight of the preservation loss (blank_prompt: of the extra term; dataset: of each regularization item)."""
    assistant_adapter: str = ""
    """A diffusers LoRA (.safetensors file or its folder) merged into the frozen base for training only, e.g. a
    de-distill adapter for turbo/schnell checkpoints; never exported, and not used by sample ('': none)."""
    expert: Literal["", "high", "low", "both"] = ""
    """Two-expert models (wan2.2-14b): "high" trains the high-noise expert's LoRA (transformer), "low" the low-noise
    one's (transformer_2), each on its own side of the pipeline's boundary_ratio; "both" trains high, then low, in
    one run (train.steps each, one expert in memory at a time) and exports both. "" for one-denoiser families."""


@dataclass
class RuntimeConfig:
    """How the stages run: speed, memory placement, logging and saving. None of it changes what is
    learned or cached (same loss and gradients), so none of it is in a fingerprint."""

    gradient_checkpointing: bool | str = True
    """Recompute activations in backward: much less memory, ~30% more compute. "auto": on CUDA the memory
    planner checkpoints the fewest repeated blocks that fit the budget (the first ones in forward order; the
    rest keep their activations), never swapping blocks or lowering the precision to do so; on CPU, all.
    Same loss and gradients either way."""
    compile_transformer: Literal["off", "on", "auto"] = "auto"
    """Regional torch.compile of the repeated blocks; auto: on on CUDA (bf16, fp8 and nf4 bases), off on CPU.
    Any compile failure, at setup or in the first compiled step, falls back to eager with a warning."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Replay the denoiser's forward+backward as CUDA graphs per batch shape (same kernels, less
    host overhead); auto: on CUDA when train.dropout is 0, and under a memory plan that swaps blocks only
    where the budget has 2x the eager step's activations free at the capture (capturing needs memory a
    swap plan may not have; else eager; the planner swaps more blocks where that leaves the room).
    LORAPIPE_CUDA_GRAPHS overrides it."""
    caption_tokens_multiple: Annotated[int, AT_LEAST_ONE] = 1
    """Families that cut a batch's captions to its longest (Qwen-Image and its edit models, Krea 2,
    Chroma, ERNIE-Image, Ideogram 4): round that length up to a multiple of this many tokens, the padding
    masked. Same loss; fewer batch shapes (each caption length is one, and a shape past the 8th runs without
    a CUDA graph), at the cost of masked attention for captions shorter than the rounded length. 1: cut to
    the longest."""
    block_swap_layout: Literal["last", "spread"] = "last"
    """Which blocks a memory plan that swaps N blocks keeps in host memory: the last N in execution order,
    or N spread evenly among all blocks, so their copies overlap the compute of the resident blocks
    between them (at small images a copy outlasts a block's compute). Same loss either way. "last" is
    measured (docs/performance.md); "spread" not yet on a GPU, and refused for SDXL (its
    UNet runs its blocks in another order than it lists them)."""
    keep_attention: bool = False
    """Checkpointed blocks keep their attention output (and its softmax statistics) for the backward instead
    of recomputing attention with the rest of the block: the same math, one more activation of a block's
    width per checkpointed block (the memory planner counts it), and the recompute's attention saved, the op
    that grows with the square of the tokens (long sequences: FLUX.1 Kontext's 8,704 tokens at 1024 px).
    Not for SDXL (its UNet blocks hold several attentions at other widths)."""
    enable_tf32: bool = True
    """TF32 matmul/cuDNN and float32_matmul_precision("high") during the stage, restored after."""
    cudnn_attention: bool = False
    """Let train use cuDNN attention (off: flash / memory-efficient): faster on Hopper GPUs. Turn it on for
    speed; turn it off again if a step dies with a CUDA error or the loss turns NaN."""
    cudnn_benchmark: bool = False
    """cuDNN autotuning; off by default (it doubled the fp32 VAE's peak VRAM)."""
    ema_device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the EMA copy lives: auto beside the adapter (the training device); cpu keeps GPU memory free
    at the cost of copying the adapter to the host every step."""
    checkpoint_every: Annotated[int, NON_NEGATIVE] = 500
    """Write a resumable checkpoint every N steps (0: only at the end or on stop)."""
    keep_checkpoints: Annotated[int, NON_NEGATIVE] = 2
    """Newest checkpoints kept (0: keep all)."""
    resume: Literal["never", "auto"] = "never"
    """auto: continue from the newest matching checkpoint (as train --resume)."""
    log_every: Annotated[int, AT_LEAST_ONE] = 1
    """Emit a step event every N steps."""
    warmup_steps_excluded: Annotated[int, NON_NEGATIVE] = 3
    """Steps left out of samples_per_second (first steps pay for allocation and compile)."""
    profile_steps: Annotated[int, NON_NEGATIVE] = 0
    """Profile this many steps right after the warm-up steps (torch.profiler) and write profile.json
    beside the LoRA: GPU kernels by time per step, host-to-device copies apart (CPU: operators). 0: off."""


@dataclass
class ValidationConfig:
    path: str = ""
    """Folder of held-out images with captions (as data.path), never trained on ('': none)."""
    split: Annotated[float, FRACTION] = 0.0
    """Fraction of data.path's items held out instead, chosen by content id (0: none)."""
    every_n_steps: Annotated[int, NON_NEGATIVE] = 0
    """Validation loss every N steps and at the last step, with fixed noise per item (0: never)."""


@dataclass
class ExportConfig:
    format: Literal["diffusers", "kohya"] = "diffusers"
    """kohya also writes lora_kohya.safetensors (LoKr/LoHa: lora_lycoris.safetensors; a Wan 2.2 A14B expert's is named
    for it: lora_high_noise_kohya.safetensors) for sd-scripts-style tools."""
    comfyui: bool = True
    """Also write <run>_comfyui.safetensors, the file to load in ComfyUI (LoKr/LoHa: always written)."""
    verify: bool = False
    """Check every file against the trained adapter: through the pipeline's own loader, and the ComfyUI
    file through ComfyUI's key map (every key loads, every module at its trained strength)."""
    ema: bool = False
    """Export the EMA of the adapter weights (trained with train.ema_decay > 0) instead of the weights."""


@dataclass
class SampleConfig:
    prompts: list[str] = field(default_factory=list)
    """Prompts the `sample` stage renders (empty: the first 3 captions of the dataset)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """One image per prompt and seed, the same seeds for the base model and for the LoRA."""
    steps: Annotated[int, AT_LEAST_ONE] = 28
    """Inference steps per image."""
    guidance_scale: float = -1.0
    """Passed to the pipeline; negative: the pipeline's own default."""
    width: Annotated[int, NON_NEGATIVE] = 0
    """Image width (0: data.resolution)."""
    height: Annotated[int, NON_NEGATIVE] = 0
    """Image height (0: data.resolution)."""
    lora_scale: float = 1.0
    """Adapter strength when rendering with the LoRA."""
    every_n_checkpoints: Annotated[int, NON_NEGATIVE] = 0
    """Also render every Nth kept checkpoint (lora/checkpoint-<step>) as its own column (0: final only)."""
    after_train: bool = False
    """`run` renders samples after export-lora (off: only `lorapipe sample` does)."""
    precision: Literal["auto", "fp32", "bf16", "nf4"] = "auto"
    """auto: on CUDA bf16, or nf4 (denoiser and text encoders) where bf16 does not fit the budget even
    offloaded; fp32 on CPU. nf4 needs CUDA."""
    cpu_offload: bool = False
    """diffusers' enable_model_cpu_offload: one component on the GPU at a time (CUDA only); the memory
    planner also turns it on where the pipeline does not fit the budget whole."""
    frames: Annotated[int, NON_NEGATIVE] = 0
    """Frames of each sample clip (video families; 0: data.frames). Wan: 4k + 1; LTX-2: 8k + 1."""


@dataclass
class GpuConfig:  # read by stages/core/memory/budget.py
    vram_budget_gb: Literal["auto"] | float = "auto"
    """GPU memory each stage may use: auto (free memory at stage start less a margin) or GB (a hard cap on the
    whole process as nvidia-smi shows it, CUDA context included)."""


@dataclass
class Config:
    run: str = "default"
    """Run name: artifacts go to <artifacts>/<run>/."""
    family: str = "flux"
    """Model family: the architecture the stages load and train (the README's family table)."""
    model: str = ""
    """A local diffusers pipeline folder, a hub id (e.g. black-forest-labs/FLUX.1-dev), or a single-file
    denoiser checkpoint (.safetensors; fp8_scaled files are converted once into <artifacts>/.model-cache)."""
    model_base: str = ""
    """For a single-file model: the pipeline folder or hub id that supplies the other components and the
    configs (empty: the repo diffusers infers from the file's keys, which must be in the local HF cache)."""
    revision: str = ""
    """Hub revision (branch, tag or commit) when model is a hub id."""
    artifacts: str = "artifacts"
    """Root folder of all runs' artifacts."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when torch sees a GPU, else CPU."""
    seed: Annotated[int, Range(0, SEED_MAX)] = 0
    """Seeds the crop/flip plan, the batch order and every training draw."""
    data: DataConfig = field(default_factory=DataConfig)
    datasets: list[dict[str, Any]] = field(default_factory=list)
    """[[datasets]] tables: several datasets in one run (empty: data.path is the one dataset)."""
    captions: CaptionsConfig = field(default_factory=CaptionsConfig)
    latents: LatentsConfig = field(default_factory=LatentsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.artifacts) / self.run

    def section(self, dotted: str) -> Any:
        obj: Any = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dataset_configs(self) -> list[DataConfig]:
        """One DataConfig per dataset: each [[datasets]] table over [data] (its keys win), or [data] alone."""
        out = []
        for t in self.datasets or [{}]:
            given = {k: v for k, v in t.items() if k != "name"}
            if "weight" in given and "repeats" not in given:  # a table's own choice of the two wins over [data]'s
                given["repeats"] = 1
            elif "repeats" in given and "weight" not in given:
                given["weight"] = 0.0
            out.append(dataclasses.replace(self.data, **given))
        return out

    def dataset_names(self) -> list[str]:
        """Item-key prefixes of the [[datasets]] tables ('' for a plain data.path): its `name` or its
        folder's name, made unique by a '-<n>' suffix."""
        if not self.datasets:
            return [""]
        names: list[str] = []
        for i, t in enumerate(self.datasets):
            name = t.get("name") or Path(t.get("path", f"dataset{i}")).name or f"dataset{i}"
            names.append(name if name not in names else f"{name}-{i}")
        return names


SECTIONS = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)}  # type: ignore[arg-type]


def _ranges() -> dict[str, Range]:
    """dotted key -> the Range annotated on its field (`Annotated[int, AT_LEAST_ONE]`)."""
    out = {}
    for cls, prefix in [(Config, "")] + [(typing.get_type_hints(Config)[s], f"{s}.") for s in sorted(SECTIONS)]:
        for name, tp in typing.get_type_hints(cls, include_extras=True).items():
            out.update({prefix + name: m for m in getattr(tp, "__metadata__", ()) if isinstance(m, Range)})
    return out


RANGES = _ranges()


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. ``train.learning_rate``."""
    keys = []
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(f.default_factory())]  # type: ignore[misc]
        else:
            keys.append(f.name)
    return keys + [f"datasets[].{k}" for k in DATASET_KEYS]


def _nearest(key: str) -> str:
    leaf = key.rsplit(".", 1)[-1]
    same = [k for k in all_keys() if k.rsplit(".", 1)[-1] == leaf and k != key and not k.startswith("datasets[]")]
    if same:  # the key lives in another section (e.g. runtime.cuda_graphs is runtime.cuda_graphs)
        return f" (did you mean '{same[0]}'?)"
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in all_keys() if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.75)]
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one value against its annotation; raise ConfigError naming the key."""
    origin = get_origin(tp)
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"'{key}' = {value!r} is not one of {choices}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a table of name = value, got {value!r}")
        _, value_tp = get_args(tp)
        return {str(k): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"'{key}' must be {' or '.join(_type_words(a) for a in get_args(tp))}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"'{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"'{key}' must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"'{key}' must be an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"'{key}' must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"'{key}' must be a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"'{key}' must be a string, got {value!r}")
        return str(value)
    return value


def _type_words(tp: Any) -> str:
    """How a message names a type: 'a number', "'auto'", 'true or false'."""
    if get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def migrate_saved(data: dict[str, Any]) -> list[str]:
    """Move the [train] keys of a saved run config (`<run>/config.json`) that are [runtime] keys now into
    [runtime], in place; the dotted keys moved (none for a config written by this version)."""
    train, runtime = data.get("train"), data.get("runtime")
    if not isinstance(train, dict) or (runtime is not None and not isinstance(runtime, dict)):
        return []
    learned = {f.name for f in dataclasses.fields(TrainConfig)}
    moved = [k for k in train if k not in learned and k in {f.name for f in dataclasses.fields(RuntimeConfig)}]
    for k in moved:
        data.setdefault("runtime", {}).setdefault(k, train.pop(k))
    return [f"train.{k}" for k in moved]


def parse_override(text: str) -> tuple[str, Any]:
    """``train.steps=200`` -> ("train.steps", "200"); TOML literals ([..], true, 1e-4) are parsed."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value, e.g. train.steps=200")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def build_config(data: dict[str, Any], source: str = "<config>", labels: dict[str, str] | None = None) -> Config:
    """Validate a nested dict (as parsed from TOML) into a Config; type and value errors reported together.

    A key whose type is wrong keeps its default while the values are checked, so every other key's
    value error is still reported (and the wrong one only once). An error about a key in `labels`
    (key -> the flag that set it, e.g. "--set train.steps=0") is blamed on that flag, not on `source`."""
    errors: list[str] = []
    top_hints = _hints(Config)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "datasets":
            kwargs[key] = _dataset_tables(value, errors)
        elif key in SECTIONS:
            if not isinstance(value, dict):
                errors.append(f"'{key}' must be a table ([{key}])")
                continue
            kwargs[key] = top_hints[key](**_coerced(value, _hints(top_hints[key]), f"{key}.", errors))
        elif key in top_hints:
            kwargs.update(_coerced({key: value}, top_hints, "", errors))
        elif isinstance(value, dict):  # a misspelt section: name each key in it, e.g. 'trian.steps'
            errors += [f"unknown key '{key}.{sub}'{_nearest(f'{key}.{sub}')}" for sub in value]
        else:
            errors.append(f"unknown key '{key}'{_nearest(key)}")
    cfg = Config(**kwargs)
    errors += value_errors(cfg, RANGES)
    if errors:
        raise config_errors(errors, source, labels or {})
    return cfg


def config_errors(errors: list[str], source: str, labels: dict[str, str]) -> ConfigError:
    """One ConfigError for all `errors`, each under the file or the command-line flag that caused it."""
    def origin(error: str) -> str:
        return next((label for key, label in labels.items() if f"'{key}'" in error or f"'{key}." in error), source)

    by_origin: dict[str, list[str]] = {}
    for error in errors:
        by_origin.setdefault(origin(error), []).append(error)
    parts = [f"{where}: " + ("\n  " if len(errs) > 1 else "") + "\n  ".join(errs) for where, errs in by_origin.items()]
    return ConfigError("\n".join(parts))


def _dataset_tables(value: Any, errors: list[str]) -> list[dict[str, Any]]:
    """[[datasets]] tables, each key type-checked as its [data] key; run-wide and unknown keys refused."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        errors.append("'datasets' must be a list of tables ([[datasets]] with path = ...)")
        return []
    hints = _hints(DataConfig)
    tables = []
    for i, table in enumerate(value):
        where = f"datasets[{i}]"
        if not table.get("path"):
            errors.append(f"'{where}' has no 'path': each [[datasets]] table names its folder (path = \"...\")")
        known = {k: v for k, v in table.items() if k in DATASET_KEYS}
        for k in sorted(set(table) - set(known)):
            if k in hints:
                errors.append(f"'{where}.{k}' applies to the whole run: set 'data.{k}' in [data] instead")
            else:
                close = difflib.get_close_matches(k, DATASET_KEYS, n=1, cutoff=0.5)
                errors.append(f"unknown key '{where}.{k}'" + (f" (did you mean '{where}.{close[0]}'?)" if close else "")
                              + f"; a [[datasets]] table takes {', '.join(DATASET_KEYS)}")
        tables.append(_coerced(known, {**hints, "name": str}, f"{where}.", errors))
    return tables


def _coerced(values: dict[str, Any], hints: dict[str, Any], prefix: str, errors: list[str]) -> dict[str, Any]:
    """The values that pass their type check, converted; each failure appended to `errors`."""
    out = {}
    for name, value in values.items():
        dotted = prefix + name
        if name not in hints:
            errors.append(f"unknown key '{dotted}'{_nearest(dotted)}")
            continue
        try:
            out[name] = _coerce(value, hints[name], dotted)
        except ConfigError as e:
            errors.append(str(e))
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{key}': '{p}' is not a section")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None, source: str = "the defaults",
                labels: dict[str, str] | None = None) -> Config:
    """Read a TOML preset (or none) and apply dotted-key overrides (CLI flags win over the file).

    A relative `model` or `data.path` in the file is relative to the file's folder (so a config runs
    the same from any working directory); overrides stay relative to the working directory. `labels`
    names the command-line flag of each override, for errors (build_config)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist (presets are in configs/)")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        _resolve_paths(data, p.parent)
        base = data.pop("include", None)
        if base is not None:
            parent = load_config(p.parent / base).to_dict()
            data = _merge(parent, data)
    if overrides:
        data = _merge(data, _nested(overrides))
    return build_config(data, source, labels)


# A hub repo id: "name" or "namespace/name" (huggingface_hub's validate_repo_id allows [\w.-]).
HUB_ID = re.compile(r"^[\w][\w.-]*(/[\w.-]+)?$")


def _resolve_paths(data: dict[str, Any], folder: Path) -> None:
    """Make the file's relative `data.path` and local `model`/`model_base` absolute, from the file's folder."""
    for key in ("model", "model_base"):
        model = data.get(key)
        if isinstance(model, str) and model:
            local = _absolute(model, folder)
            # a relative ref that is no folder beside the config and reads as a repo id stays a hub id
            is_hub = not Path(local).exists() and not model.startswith((".", "~")) and HUB_ID.match(model)
            data[key] = model if is_hub else local
    tables = data.get("datasets")
    for section in [data.get("data"), data.get("validation")] + (tables if isinstance(tables, list) else []):
        if isinstance(section, dict) and isinstance(section.get("path"), str) and section["path"]:
            section["path"] = _absolute(section["path"], folder)


def _absolute(path: str, folder: Path) -> str:
    p = Path(path).expanduser()
    return p.as_posix() if p.is_absolute() else os.path.abspath(folder / p)


def describe_keys(registered: dict[str, list[str]] | None = None) -> list[tuple[str, str, str, str]]:
    """(dotted key, default, choices, meaning) for every key: `choices` lists an enumerated key's
    values ('a' | 'b'), a registered key's names (`registered`: the caller's registries, e.g. {"family": [...]})
    or a number's valid range (>= 1), else ''. `pipeline.py keys` prints it."""
    rows = []
    for cls, prefix in [(Config, "")] + [(_hints(Config)[s], f"{s}.") for s in sorted(SECTIONS)]:
        docs = _field_docs(cls)
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            names = (registered or {}).get(prefix + f.name)
            choices = " | ".join(repr(n) for n in names) if names else _choices(prefix + f.name, hints[f.name])
            rows.append((prefix + f.name, repr(default), choices, docs.get(f.name, "")))
    data_rows = {key.removeprefix("data."): row for key, *row in rows if key.startswith("data.")}
    for k in DATASET_KEYS:
        _, choices, meaning = data_rows.get(k, ("", "", ""))
        rows.append((f"datasets[].{k}", "(required)" if k == "path" else "(folder name)" if k == "name" else f"data.{k}",
                     choices, DATASET_DOCS.get(k, f"Per [[datasets]] table; default [data]'s. {meaning}")))
    return rows


def _choices(key: str, tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return str(RANGES[key]) if key in RANGES else FORMS.get(key, "")


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal that follows it)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


def command(cfg: Any, name: str, *flags: str) -> str:
    """A command line the user can paste for this run (stages.core.runspec.command_for)."""
    from stages.core.runspec import command_for

    return command_for(cfg.run_dir, name, *flags)
