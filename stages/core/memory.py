"""The memory planner: every stage asks it, before loading weights, which settings fit its GPU budget.

    cfg, plan = memory.plan_stage(cfg, family, "train", log)   # the budget applied, a `plan` event logged
    lorapipe plan --config configs/flux-dev.toml --vram 8   # the same plans, as a table

`gpu.vram_budget_gb`: "auto" is the free memory when the stage starts (`torch.cuda.mem_get_info`)
less a safety margin; a number is a hard cap, enforced with `torch.cuda.set_per_process_memory_fraction`
(so a big card can act as a small one). On CPU there is no budget and nothing changes.

Sizes come from the meta device (each component built from its config.json, no weights read) and
bytes per precision. Activations come from the small models below; their constants are ESTIMATES
fitted to the figures in the H200 notes and docs/performance.md until `bench/memory.py` measures them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from stages.core import blockswap
from stages.core.errors import ConfigError, ResourceError

GB = 2**30
AUTO_MARGIN_GB = 0.75  # "auto": left free for the CUDA context's growth and other processes' jitter
FRAGMENTATION = 1.12  # reserved/allocated on the H200: FLUX nf4 train 9.00/8.10 = 1.11, fp32 VAE 3.90/3.36 = 1.16
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64  # 4-bit codes + one 8-bit absmax per 64 weights (double quant)
# Train activations of one DiT block, in units of tokens x width x 2 bytes (bf16). Estimates:
# no checkpointing, FLUX.1-dev 512 px b1 needed 8.9 GB over bf16 weights for 57 blocks x 1536 tokens
# x 3072 wide = 17 units per block; with checkpointing a block keeps its input (1 unit) and the block
# being recomputed holds ~24 units (fits FLUX nf4 1024 px b1 at 8.3 GB). 17 is a block's own in most
# families (Z-Image's compiled bf16 1024 px b4 row with no checkpointing: predicted 1.003x what it
# allocated); a family whose blocks keep less names them in `block_saved_units` (FLUX.1's single-stream).
BLOCK_SAVED_UNITS, CHECKPOINT_SAVED_UNITS, BLOCK_WORK_UNITS = 17.0, 1.0, 24.0
# train.keep_attention: a checkpointed block also keeps its attention output (tokens x heads x head dim, the
# block's width in the DiT families, bf16) and its softmax statistics (4 bytes per head and token: ~1 % more)
ATTENTION_KEPT_UNITS = 1.02
# From this many tokens a sample (FLUX.1 Kontext at 1024 px: 8,704; attention's cost grows with the square of a
# sample's sequence, not with the batch) a train plan that checkpoints blocks says
# when train.keep_attention would fit its budget too: there it took the fp8 + cuDNN step from 0.969 to 0.825 s
# (H200, bench/results/peers-kontext-1024-b1-{cudnn3,keepattn}.json); shorter sequences are not measured
KEEP_ATTENTION_HINT_TOKENS = 8704
VAE_ELEMENTS_PER_PIXEL = 780  # FLUX's fp32 VAE, 1 image at 1024 px: 3.36 GB allocated (H200; 720 predicted 3.12)
VAE_TILE_PIXELS = {"AutoencoderKL": 512, "AutoencoderKLQwenImage": 256}  # tile side when tiling
LORA_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW's two moments
# Block swap used to allocate and free each block's copies on a side stream, which the caching
# allocator could not reuse at once: Z-Image nf4 with 20 of 34 blocks swapped, predicted 3.55 GB, ran
# out of memory at a 4.00 GB cap (bench/results/memory-zimage-sdxl-h200.json). It now copies into two
# fixed slots (the 2 * largest block below). Measured with the slots and this extra (H200): Z-Image at
# 4 GB predicted 3.57 GB, allocated 3.32 and reserved the whole 4.00 (one allocator retry); Qwen-Image
# at 8 GB predicted 7.03, allocated 6.80, reserved 7.92 (memory-zimage-4gb-slots-h200.json,
# memory-qwen-image-8gb-slots-h200.json). Reserved, which the cap limits, still needs it.
SWAP_EXTRA_GB = 0.4
# train.base_precision = "auto": the precisions tried whole, in this order (a family may override). On the
# H200 (docs/performance.md, compiled, CUDA graphs on) nf4's step was 1.08-1.39x bf16's compiled (all four
# families at 512 px; FLUX.1-dev 1.806 against 1.95 samples/s and Qwen-Image 1.586 against 1.730 at 1024 px
# b1, memory-*-h200.json "auto" rows beside bench-*.json), up to 1.83x uncompiled. fp8 (compute capability
# >= 8.9 only) beat compiled nf4 in every row where both were measured (2026-12-02: 0.68-0.85x its step:
# 1024 px b1 against the memory tables' nf4-whole rows, Qwen-Image 0.521 s against 0.613, Z-Image 0.356
# against 0.436, SDXL 0.128 against 0.170; 512 px b1 Qwen-Image 0.163 against 0.220, SDXL 0.077 against
# 0.114) at about half bf16's memory, and with
# gradients closer to bf16's (step-1 cosine 0.9986 against nf4's 0.985; loss within 0.019 % over 50 steps).
# Against bf16 it depends on the family and the step's size: faster at every FLUX.1 shape (0.86-0.93x),
# Qwen-Image and Z-Image from 1024 px b1 (0.82-0.91x, ~4,100 tokens a step and up), SDXL at 512 and 1024 px
# b1 and 512 px b4 (0.87-0.94x; 1024 px b4 1.01x against a bf16 row of another run); slower at Qwen-Image
# 512 px b1 (1.11x, ~1,100 tokens: the per-row quantization outweighs the smaller matmuls). So bf16 comes
# first, except where the family's `fp8_faster_from_tokens` (the smallest step measured faster in fp8) says
# fp8 is the faster at the planned step's tokens (`_base_precisions`; the edit families take their base
# family's); a family with no fp8 rows keeps bf16 first. Swap plans use nf4 or bf16 blocks, never fp8 (below).
AUTO_BASE_PRECISIONS = ("bf16", "fp8", "nf4")


@dataclass
class Budget:
    gb: float | None  # None: no GPU budget (CPU)
    source: str  # "auto" (free memory), "cap" (a number), "cpu"


@dataclass
class StagePlan:
    stage: str
    budget: Budget
    settings: dict[str, Any]
    predicted_peak_gb: float
    fits: bool
    note: str = ""
    tried: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "budget_gb": self.budget.gb, "budget_source": self.budget.source,
                "settings": self.settings, "predicted_peak_gb": round(self.predicted_peak_gb, 3),
                "fits": self.fits, "note": self.note}


def parse_budget(value: Any) -> float | str:
    """`--vram` / gpu.vram_budget_gb: "auto" or a positive number of GB."""
    if value in (None, "auto"):
        return "auto"
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise ResourceError(f"gpu.vram_budget_gb = {value!r} must be 'auto' or a number of GB, e.g. --vram 12") from None
    if gb <= 0:
        raise ResourceError(f"gpu.vram_budget_gb = {value!r} must be > 0 GB")
    return gb


# Under a cap the caching allocator runs with expandable segments unless the user configured it: with torch's
# fixed segments FLUX.2 klein's planned fp8 run (22 of 25 blocks, 5.12 GB predicted, 5.31 measured uncapped) ran
# out of memory in its first step under the diffusers script's 5.74 GB reserved peak, with and without CUDA graphs,
# at 5.41 GB reserved: holes in segments it could not hand back (bench/results/peers-klein-1024-b1-fitreserved-fp8-why.json);
# with expandable segments the same run trained, 5.13 GB allocated and 5.72 reserved
# (peers-klein-1024-b1-fitreserved-fp8-expandable.json), and uncapped it captured CUDA graphs and ran as fast
# (0.203 s a step against 0.2055) at 5.98 GB reserved against 6.45 (peers-klein-1024-b1-fp8blocks22-expandable.json).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's names for it (the second, newer)
CAP_ALLOC_CONF = "expandable_segments:True"


def allocator_setting(env: Any = None) -> str | None:
    """The caching allocator's setting in the environment (`NAME=value`, os.environ's unless `env`), else None."""
    import os

    env = os.environ if env is None else env
    return next((f"{v}={env[v]}" for v in ALLOC_CONF_VARS if env.get(v)), None)


def allocator_for_cap(setting: Any, env: Any = None) -> str | None:
    """Under a cap (`setting` a number of GB), expandable segments for the caching allocator: set in `env`
    (os.environ) before CUDA starts, which is when torch reads it. The setting made, else None: no cap,
    the user's own allocator settings (they win), no CUDA, or CUDA already started in this process (too late)."""
    import os

    env = os.environ if env is None else env
    if (setting in (None, "auto") or allocator_setting(env) or not torch.cuda.is_available()
            or torch.cuda.is_initialized()):
        return None
    env[ALLOC_CONF_VARS[0]] = CAP_ALLOC_CONF
    return CAP_ALLOC_CONF


def allocator_summary(device: torch.device | None = None) -> str:
    """What the caching allocator runs with, for the runtime summary: the environment's setting (or torch's
    default) and, once CUDA holds memory, whether its segments are expandable."""
    conf = allocator_setting() or "torch's default"
    if device is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return conf
    segments = torch.cuda.memory_snapshot()
    if not segments:
        return conf
    return f"{conf} ({'expandable' if any(s.get('is_expandable') for s in segments) else 'fixed'} segments)"


def retries_note(retries: int, steps: int, budget: Budget) -> str | None:
    """A warning where the caching allocator hit the budget's cap more often than once a step on average over
    the `steps` this process ran: each time it frees its cache and retries, and the steps run slower (FLUX.2
    klein's 22 fp8 blocks at a 5.74 GB cap: 230 retries in 15 eager steps, 0.29 s a step against 0.20 captured,
    bench/results/peers-klein-1024-b1-fitreserved-fp8-expandable.json); else None."""
    if budget.source != "cap" or steps <= 0 or retries <= steps:
        return None
    return (f"the GPU allocator reached the {budget.gb:g} GB cap and flushed its cache {retries} times in {steps} steps, "
            f"which slows them (runtime.cuda_alloc_retries in the train manifest): a larger --vram "
            f"(gpu.vram_budget_gb) lets the plan keep more memory to spare")


def resolve_budget(setting: Any, device: torch.device, enforce: bool = True) -> Budget:
    """The stage's budget on `device`; a number is also enforced as the allocator's cap."""
    if device.type != "cuda":
        return Budget(None, "cpu")
    value = parse_budget(setting)
    free, total = torch.cuda.mem_get_info(device)
    if value == "auto":
        return Budget(round(max(free / GB - AUTO_MARGIN_GB, 0.0), 3), "auto")
    if enforce:
        index = device.index if device.index is not None else torch.cuda.current_device()  # it refuses a bare "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(value) * GB / total), index)
    return Budget(float(value), "cap")


# ---- sizes from the meta device
# (library, class, config.json) -> its meta module: one stage process plans several times before it
# loads anything (its own plan; the fingerprints of its cache and the upstream ones, each of which
# asks what the stage would plan, and under "auto" plans train as well), and a big denoiser or text
# encoder takes 0.1-0.5 s to build on the meta device each time.
_META_CACHE: dict[tuple[str, str, str], torch.nn.Module] = {}
_META_CACHE_SIZE = 8


def meta_component(src: Any, subfolder: str) -> torch.nn.Module:
    """The component's module built from its config on the meta device (no weights, no memory),
    once per process for each class and config (`_META_CACHE`). Shared: callers only read sizes
    (`offload_placement` sets its dtype first, which no other size here reads)."""
    import importlib
    import json

    library, class_name = src.component_config("", "model_index.json")[subfolder]
    config = src.component_config(subfolder)
    key = (library, class_name, json.dumps(config, sort_keys=True))
    if key in _META_CACHE:
        _META_CACHE[key] = _META_CACHE.pop(key)  # most recently used last
        return _META_CACHE[key]
    module = _build_meta(getattr(importlib.import_module(library), class_name), library, config)
    _META_CACHE[key] = module
    while len(_META_CACHE) > _META_CACHE_SIZE:
        _META_CACHE.pop(next(iter(_META_CACHE)))
    return module


def _build_meta(cls: type, library: str, config: dict[str, Any]) -> torch.nn.Module:
    with torch.device("meta"):
        return cls.from_config(config) if library == "diffusers" else cls(cls.config_class.from_dict(config))


def weight_bytes(module: torch.nn.Module, precision: str, codes_only: bool = False) -> float:
    """Bytes of `module`'s weights at `precision` (nf4: every Linear weight 4-bit, the rest bf16).
    `codes_only`: an nf4 weight's 4-bit codes without its absmax (what block swap moves to host
    memory; the quant_state stays on the GPU, stages/core/blockswap.py)."""
    if precision == "fp8":
        return _fp8_weight_bytes(module)
    if precision != "nf4":
        return sum(p.numel() for p in module.parameters()) * (4 if precision == "fp32" else 2)
    return sum(_nf4_param_bytes(module, codes_only).values())


def _nf4_param_bytes(module: torch.nn.Module, codes_only: bool = False) -> dict[int, float]:
    """Each parameter's bytes (by id) in an nf4 load of `module` (weight_bytes)."""
    # transformers leaves `_keep_in_fp32_modules` unquantized (T5's `wo`: measured 4.41 GB for FLUX's
    # nf4 text encoders on the H200 where all-4-bit predicted 2.81; bench/results/memory-flux-h200.json)
    kept = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    # nor does it quantize the output embedding (Qwen2.5-VL's lm_head: 1.09 GB bf16; the nf4 encode
    # of Qwen-Image measured 6.33 GB allocated where counting it as 4-bit predicted 4.81)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    skip = {id(head.weight)} if isinstance(head, torch.nn.Linear) else set()
    linear = {id(m.weight) for name, m in module.named_modules()
              if isinstance(m, torch.nn.Linear) and not any(k in name.split(".") for k in kept)} - skip
    per_weight = 0.5 if codes_only else NF4_BYTES_PER_WEIGHT
    return {id(p): p.numel() * (per_weight if id(p) in linear else 2) for p in module.parameters()}


def fp8_nf4_weight_bytes(model: torch.nn.Module) -> list[float]:
    """Bytes of the base with its first m repeated blocks in fp8 and the rest of it in nf4, for m = 0..n
    (stages/core/fp8.py `quantize_fp8_nf4`): m = 0 is the nf4 base; a block in fp8 counts its eligible
    Linears' weights at one byte plus a 4-byte scale per output channel, its other weights bf16."""
    nf4 = _nf4_param_bytes(model)
    sizes = [sum(nf4.values())]
    for block in blockswap.repeated_blocks(model):
        as_fp8 = _fp8_bytes_where(block, lambda name, linear: False)  # every eligible Linear of the block
        sizes.append(sizes[-1] - sum(nf4[id(p)] for p in block.parameters()) + as_fp8)
    return sizes


def _fp8_weight_bytes(module: torch.nn.Module) -> float:
    """An fp8 base as stages/core/fp8.py makes it: each eligible Linear inside the repeated blocks one
    byte per weight plus a 4-byte scale per output channel, everything else bf16 (a denoiser: fp8 blocks
    are never swapped, so no single block is sized)."""
    from stages.core import fp8

    return _fp8_bytes_where(module, fp8.inside_repeated_blocks(module))


def _fp8_bytes_where(module: torch.nn.Module, keep: Callable[[str, torch.nn.Module], bool]) -> float:
    """`module`'s bytes with each eligible Linear that `keep(name, linear)` rejects in fp8 (a byte per weight
    plus a 4-byte scale per output channel, as stages/core/fp8.py makes it) and every other weight bf16."""
    from stages.core import fp8

    quantized = {id(m.weight): m.weight.shape[0] for name, m in module.named_modules()
                 if type(m) is torch.nn.Linear and fp8.fp8_eligible(m) and not keep(name, m)}
    return sum(p.numel() + 4 * quantized[id(p)] if id(p) in quantized else 2 * p.numel() for p in module.parameters())


def fp8_host_short(host_gb: float) -> str:
    """Why "auto" leaves out an fp8 base that the GPU could run: the bf16 read an fp8 load of a single-file
    checkpoint (or of a folder whose keys diffusers converts) makes into host memory first does not fit what
    is available (a diffusers folder streams, as nf4 loads shard by shard; its host_gb is 0); "" when it
    fits or the host cannot tell."""
    available = host_available_bytes()
    if available is None or host_gb * GB <= available:
        return ""
    return f"its bf16 read ({host_gb:.1f} GB) exceeds the {available / GB:.1f} GB of host memory available"


def _width(module: torch.nn.Module) -> int:
    """The hidden width activations scale with: a text model's hidden_size (a vision-language
    encoder's first Linear is its vision tower's, 1280 wide in Qwen2.5-VL against 3584), else the
    first Linear's input width."""
    from transformers import PretrainedConfig

    config = getattr(module, "config", None)
    if isinstance(config, PretrainedConfig):
        hidden = getattr(getattr(config, "text_config", None) or config, "hidden_size", None)
        if isinstance(hidden, int):
            return hidden
    return next(m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def lora_params(model: torch.nn.Module, targets: list[str], rank: int) -> int:
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))


def _fitting(budget: Budget, candidates: list[tuple[dict[str, Any], float]], stage: str, need: str) -> StagePlan:
    """The first candidate (settings, peak GB) that fits, else the smallest one, marked as not fitting."""
    tried = [{**s, "predicted_peak_gb": p} for s, p in candidates]
    for settings, peak in candidates:
        if budget.gb is None or peak * FRAGMENTATION <= budget.gb:
            return StagePlan(stage, budget, settings, peak, True, tried=tried)
    settings, peak = min(candidates, key=lambda c: c[1])
    note = (f"even the smallest {stage} plan needs {peak * FRAGMENTATION:.1f} GB, more than the "
            f"{budget.gb:.1f} GB budget: give it --vram {math.ceil(peak * FRAGMENTATION)} or more, or {need}")
    return StagePlan(stage, budget, settings, peak, False, note, tried)


# ---- encode-captions
def plan_captions(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    """bf16 whole (halving the batch), then nf4 whole, then layer offload (`_offload_candidates`)."""
    from stages.core.runtime import has_accelerate

    models = {c: meta_component(src, c) for c in module_components(src, family.text_components)}
    configured = cfg.captions.text_encoder_precision
    precisions = ["bf16", "nf4"] if configured == "auto" else [configured]
    tokens = cfg.captions.max_sequence_length + 77  # + the longest template/CLIP prefix
    work = {batch: max(batch * tokens * _width(m) * 2 * BLOCK_WORK_UNITS for m in models.values())
            for batch in _halvings(cfg.captions.batch_size)}
    candidates = []
    for precision in precisions:
        weights = sum(weight_bytes(m, precision) for m in models.values())
        for batch, w in work.items():
            candidates.append(({"text_encoder_precision": precision, "batch_size": batch}, (weights + w) / GB))
    candidates += _offload_candidates(cfg, family, models, work, budget)
    need = "set captions.text_encoder_precision = 'nf4' and captions.batch_size = 1"
    if OFFLOAD_PRECISION.get(configured) and family.text_offload_components and not has_accelerate():
        need += ", or install accelerate so the text encoder's layers can stay in CPU memory (layer offload)"
    return _fitting(budget, candidates, "encode-captions", need)


# Layer offload runs the encoder in a dense precision: "auto" offloads bf16 (nf4 is never offloaded:
# stages/families/text_encoders.py offload_kwargs says why).
OFFLOAD_PRECISION = {"auto": "bf16", "bf16": "bf16", "fp32": "fp32"}
HOST_BYTES = 2**50  # planning assumes CPU memory holds what the GPU does not (the load gives it the free RAM)


def _offload_candidates(cfg: Any, family: Any, models: dict[str, torch.nn.Module], work: dict[int, float],
                        budget: Budget) -> list[tuple[dict[str, Any], float]]:
    """Plans that keep only part of the largest offloadable text encoder (the family's
    `text_offload_components`) on the GPU, one per batch size: the GPU share is what the budget
    leaves after the other encoders and the work, and transformers' own device map for that share
    (`offload_placement`) gives the layers that stay and the largest one that visits per forward.
    Only where a whole plan at that batch would not fit (the share is below the whole encoder)."""
    from stages.core.runtime import has_accelerate

    precision = OFFLOAD_PRECISION.get(cfg.captions.text_encoder_precision)
    offloadable = [c for c in family.text_offload_components if c in models]
    if precision is None or not offloadable or budget.gb is None or not math.isfinite(budget.gb) or not has_accelerate():
        return []
    name = max(offloadable, key=lambda c: weight_bytes(models[c], precision))
    model, whole = models[name], weight_bytes(models[name], precision)
    others = sum(weight_bytes(m, precision) for c, m in models.items() if c != name)
    candidates = []
    for batch, w in work.items():
        share = budget.gb * GB / FRAGMENTATION - others - w
        if share >= whole:
            continue
        share_gb = math.floor(max(share, 0.0) / GB * 1000) / 1000  # the stage passes this share, so it gets this map
        placed = offload_placement(model, precision, share_gb)
        if placed is None:  # nothing would stay on the GPU (then the encoder would run on the CPU): the least that does
            share_gb = math.ceil(_least_share(model, precision) / GB * 1000) / 1000
            placed = offload_placement(model, precision, share_gb)
        if placed is None:
            continue
        settings = {"text_encoder_precision": precision, "batch_size": batch, "offload_gb": round(placed.offloaded / GB, 3),
                    "gpu_weights_gb": share_gb, "gpu_layers": placed.gpu_layers, "layers": placed.layers}
        candidates.append((settings, (others + placed.resident + placed.in_flight + w) / GB))
    return candidates


@dataclass
class Placement:
    device_map: dict[str, Any]
    resident: float  # bytes of weights on the GPU
    in_flight: float  # bytes of the largest offloaded module's own weights: what a forward copies in at once
    offloaded: float  # bytes of weights in CPU memory
    gpu_layers: int  # blocks (the model's no-split modules: decoder layers, vision blocks) wholly on the GPU
    layers: int


def offload_placement(model: torch.nn.Module, precision: str, device_gb: float) -> Placement | None:
    """Where `from_pretrained(device_map="auto", max_memory={gpu: device_gb, "cpu": ...})` puts a
    (meta) `model`'s weights at `precision`: transformers' own device map (it keeps room on the GPU
    for the largest layer, the one an offloaded forward copies in). None if nothing stays on GPU 0.
    accelerate hooks every offloaded module that has weights of its own, so what visits the GPU at
    once is one such module's weights."""
    import logging

    from transformers.integrations.accelerate import _get_device_map

    from stages.core.runtime import precision_dtype

    model.to(precision_dtype(precision, torch.device("cuda")))  # meta: sizes only
    quiet = [logging.getLogger(n) for n in ("accelerate.utils.modeling", "transformers.integrations.accelerate")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)  # "Device 0 is not available" when planning on a machine without a GPU
    try:
        device_map = _get_device_map(model, "auto", {0: int(device_gb * GB), "cpu": HOST_BYTES}, None)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    if 0 not in device_map.values():
        return None

    def device(name: str) -> Any:
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]
        return next((device_map[p] for p in prefixes if p in device_map), None)

    own, seen = {}, set()  # a tied weight (embeddings and head) counts once, with the first module holding it
    for name, m in model.named_modules():
        params = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        own[name] = sum(p.numel() * p.element_size() for p in params)
    on_gpu = {name for name, n in own.items() if n and device(name) == 0}
    resident = sum(n for name, n in own.items() if name in on_gpu)
    offloaded = sum(n for name, n in own.items() if name not in on_gpu)
    no_split = set(model._no_split_modules or ())
    blocks = [name for name, m in model.named_modules() if type(m).__name__ in no_split]
    gpu_blocks = [b for b in blocks if all(name in on_gpu for name, n in own.items() if n and (name == b or name.startswith(b + ".")))]
    return Placement(device_map, resident, max((n for name, n in own.items() if name not in on_gpu), default=0),
                     offloaded, len(gpu_blocks), len(blocks))


def _least_share(model: torch.nn.Module, precision: str) -> float:
    """Bytes that keep the first weighted module on the GPU with room for the largest layer beside it."""
    dtype_bytes = 4 if precision == "fp32" else 2
    own = [sum(p.numel() for p in m.parameters(recurse=False)) * dtype_bytes for m in model.modules()]
    no_split = set(model._no_split_modules or ())
    blocks = [sum(p.numel() for p in m.parameters()) * dtype_bytes for m in model.modules() if type(m).__name__ in no_split]
    first = next(n for n in own if n)
    return 1.25 * max(own + blocks) + first


def _halvings(n: int) -> list[int]:
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


# ---- cache-latents
def plan_latents(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    vae = meta_component(src, family.vae_components[0])
    configured = _configured_vae_precision(cfg)
    tile = VAE_TILE_PIXELS.get(type(vae).__name__)
    options = [(configured, False, False), (configured, True, False), ("bf16", True, False),
               (configured, True, True), ("bf16", True, True)]
    candidates, seen = [], set()
    for precision, sliced, tiled in options:
        if (precision, sliced, tiled) in seen or (tiled and tile is None):
            continue
        seen.add((precision, sliced, tiled))
        images = 1 if sliced else max(d.cache_variants for d in cfg.dataset_configs())
        resolution = max(d.resolution for d in cfg.dataset_configs())  # the largest of several datasets
        side = min(tile, resolution) if tiled else resolution
        work = images * side * side * VAE_ELEMENTS_PER_PIXEL * (4 if precision == "fp32" else 2)
        candidates.append(({"vae_precision": precision, "sliced": sliced, "tiled": tiled},
                           (weight_bytes(vae, precision) + work) / GB))
    return _fitting(budget, candidates, "cache-latents", "lower data.resolution")


# ---- train
def _planned_controls(cfg: Any, family: Any) -> int:
    """Control images per item the sequence carries: the family's most, or, where they are optional
    (FLUX.2 references), the most an item of this run's data has."""
    low, high = family.control_range
    if low or not high:
        return high
    from stages.core import dataset

    return dataset.most_controls(cfg)  # file names only: no image is read or hashed here


def _base_precisions(tcfg: Any, family: Any, host_gb: float, tokens: int) -> tuple[list[str], str, str]:
    """The base precisions train tries whole, in order: the configured one, or under "auto" the family's
    (AUTO_BASE_PRECISIONS) less fp8 where this process could not use it, and fp8 before bf16 where it was
    measured faster at a step of `tokens` (family.fp8_faster_from_tokens); why fp8 was left out where the
    GPU could run it ("" otherwise: a GPU without fp8 tensor cores is not news), and why it went first."""
    if tcfg.base_precision != "auto":
        return [tcfg.base_precision], "", ""
    precisions = list(family.auto_base_precisions or AUTO_BASE_PRECISIONS)
    if "fp8" not in precisions:
        return precisions, "", ""
    from stages.core.fp8 import fp8_supported

    supported, why = fp8_supported(), ""
    if supported:
        why = ("train.compile_transformer = 'off' (eager, one fp8 layer ran 0.50x bf16's speed: bench/fp8.md)"
               if tcfg.compile_transformer == "off" else fp8_host_short(host_gb))
    if why or not supported:
        precisions.remove("fp8")
        return precisions, why, ""
    faster_from = family.fp8_faster_from_tokens
    if faster_from is None or tokens < faster_from or "bf16" not in precisions:
        return precisions, "", ""
    precisions.remove("fp8")
    precisions.insert(precisions.index("bf16"), "fp8")
    return precisions, "", (f"auto tried fp8 before bf16: {tokens} tokens a step, where {family.name}'s fp8 step was "
                            f"measured faster from {faster_from} (docs/performance.md)")


def plan_train(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    tcfg = cfg.train
    model = meta_component(src, family.denoiser_components[0])
    blocks = blockswap.repeated_blocks(model)
    targets = tcfg.target_modules or list(family.default_lora_targets)
    lora = lora_params(model, targets, tcfg.rank) * LORA_BYTES_PER_PARAM
    side = max(d.resolution for d in cfg.dataset_configs()) // 16  # VAE /8, then 2x2 patches
    images = 1 + _planned_controls(cfg, family)  # edit families: control tokens join the sequence
    tokens = tcfg.batch_size * (images * side * side + cfg.captions.max_sequence_length)
    unit = tokens * (_width(blocks[0]) if blocks else _width(model)) * 2
    # host memory a load needs besides what the plan keeps there: a bf16 read of the base is a copy unless the
    # files are bf16 safetensors (then mapped pages: bench/fp8.md); fp8 streams a folder's shards whose keys
    # are the model's (fp8.streams, the loader's own test), else reads the base whole in bf16 first
    from stages.core.fp8 import streams
    from stages.core.model_source import stored_as_bf16, stored_dtypes

    stored, bf16_gb = stored_dtypes(src.weight_files(family.denoiser_components[0])), weight_bytes(model, "bf16") / GB
    read_gb = 0.0 if stored_as_bf16(stored) else bf16_gb
    fp8_host_gb = 0.0 if streams(model, stored) else bf16_gb
    precisions, fp8_left_out, fp8_first = _base_precisions(tcfg, family, fp8_host_gb, tokens)
    n, layout = len(blocks), getattr(tcfg, "block_swap_layout", "last")
    if layout == "spread" and not family.blocks_in_run_order:
        raise ConfigError(f"train.block_swap_layout = 'spread' does not suit {family.name}: its denoiser lists its blocks "
                          f"in another order than it runs them (SDXL's UNet runs down, mid, up), so block swap could not "
                          f"copy the next swapped block ahead of its use. Set train.block_swap_layout = 'last'.")
    keep_attention, per_block = getattr(tcfg, "keep_attention", False), family.attention_per_block
    fp8_fixed = getattr(tcfg, "fp8_blocks", "auto")
    if keep_attention and not per_block:
        raise ConfigError(f"train.keep_attention = true does not suit {family.name}: its denoiser's blocks do not each "
                          f"run one attention at their width (SDXL's UNet blocks hold several, or none), which is what "
                          f"the memory planner counts for it. Set train.keep_attention = false.")
    whole = {p: weight_bytes(model, p) for p in precisions}  # the whole base per precision
    # a step's activations: the checkpointed blocks keep their input, the others every activation their
    # backward reads, and the block being run (or recomputed) works in its own
    fixed_gb, per_sample_gb = family.outside_block_gb  # activations outside the blocks
    outside = (fixed_gb + per_sample_gb * tcfg.batch_size * images * (side * 16 / 512) ** 2) * GB
    # the un-checkpointed blocks are the last ones (trainer: blocks[checkpointed:])
    own_units = family.block_saved_units
    saved = [own_units.get(type(b).__name__, BLOCK_SAVED_UNITS) for b in blocks]
    work = BLOCK_WORK_UNITS if family.block_work_units is None else family.block_work_units
    kept = ATTENTION_KEPT_UNITS if keep_attention else 0.0  # per checkpointed unswapped block
    activations = lambda checkpointed, swapped=0: outside + unit * (  # noqa: E731
        checkpointed * CHECKPOINT_SAVED_UNITS + max(0, checkpointed - swapped) * kept + sum(saved[checkpointed:]) + work)
    options = _with_fp8_nf4(_train_options(tcfg.gradient_checkpointing, precisions, n, sorted(precisions, key=whole.get)),
                            n, fp8_fixed)
    mixed = fp8_nf4_weight_bytes(model) if any(m is not None for *_, m in options) else []
    # each block's bytes that swapping it moves to host memory, for the precisions a swap option uses
    block_bytes = {p: [weight_bytes(b, p, codes_only=True) for b in blocks] for p in {p for p, k, _, _ in options if k}}
    candidates = []
    for precision, swapped, checkpointed, fp8_blocks in options:
        total = whole[precision] if fp8_blocks is None else mixed[fp8_blocks]
        host = [block_bytes[precision][i] for i in blockswap.swapped_positions(n, swapped, layout)]  # two slots of the largest
        resident = total - sum(host) + min(2, len(host)) * max(host, default=0)
        peak = resident + lora + activations(checkpointed, swapped) + SWAP_EXTRA_GB * GB * (swapped > 0)
        if precision == "nf4" and not swapped:  # diffusers' load quantizes on the GPU: the whole nf4 base is there
            peak = max(peak, total + lora)  # (a swap plan quantizes block by block: stages/core/nf4_blocks.py)
        checkpointing = checkpointed > 0 or (n == 0 and tcfg.gradient_checkpointing is not False)
        settings = {"base_precision": precision, "gradient_checkpointing": checkpointing,
                    "checkpointed_blocks": checkpointed, "swapped_blocks": swapped, "blocks": n}
        if fp8_blocks is not None:  # read whole in bf16 into host memory, then quantized layer by layer
            settings["fp8_blocks"] = fp8_blocks
            if read_gb:
                settings["host_gb"] = round(read_gb, 2)
        elif swapped:  # the swapped blocks live in host memory (pinned), after the load's read
            settings["host_gb"] = round(read_gb + sum(host) / GB, 2)
        elif precision == "fp8" and fp8_host_gb:  # a single file or converted keys: read whole in bf16 first
            settings["host_gb"] = round(fp8_host_gb, 2)
        if swapped and layout != "last":
            settings["swap_layout"] = layout
        candidates.append((settings, peak / GB))
    plan = _fitting(budget, candidates, "train", "lower data.resolution or train.batch_size")
    grads_gb = lora / LORA_BYTES_PER_PARAM * 4 / GB  # the LoRA's fp32 gradients: a step allocates them anew
    for tried in plan.tried:
        tried["activations_gb"] = round(activations(tried["checkpointed_blocks"], tried["swapped_blocks"]) / GB, 6)
        tried["lora_grads_gb"] = round(grads_gb, 6)
    partial = tcfg.gradient_checkpointing == "auto"  # the checkpointed blocks chosen within the budget
    fewer_fp8 = plan.settings.get("fp8_blocks") is not None and fp8_fixed == "auto"
    if plan.fits and (plan.settings["swapped_blocks"] or (partial and plan.settings["checkpointed_blocks"] < n) or fewer_fp8) \
            and (mode := _graphs_mode(tcfg, budget)):
        plan = _with_graph_room(plan, candidates, lambda s: activations(s["checkpointed_blocks"], s["swapped_blocks"]) / GB, grads_gb,
                                budget, mode, fewer_fp8)
    if plan.fits and plan.settings.get("fp8_blocks") is not None:
        whole_fp8 = [peak for settings, peak in candidates
                     if settings["base_precision"] == "fp8" and "fp8_blocks" not in settings]
        why = (f"the whole fp8 base needs {min(whole_fp8) * FRAGMENTATION:.1f} GB" if whole_fp8 else
               "train.fp8_blocks")
        said = f"{plan.note.rstrip('.')}." if plan.note else ""
        plan.note = (f"{said} fp8 for the first {plan.settings['fp8_blocks']} of {n} blocks, nf4 for the other "
                     f"blocks and outside them: {why}.").strip()
    if fp8_left_out:
        plan.note = f"{plan.note} auto left fp8 out: {fp8_left_out}.".strip()
    if fp8_first and plan.settings["base_precision"] == "fp8":
        plan.note = f"{plan.note} {fp8_first}.".strip()
    resident = plan.settings["checkpointed_blocks"] - plan.settings["swapped_blocks"]
    extra_gb = ATTENTION_KEPT_UNITS * max(0, resident) * unit / GB
    if (plan.fits and not keep_attention and resident > 0 and tokens // tcfg.batch_size >= KEEP_ATTENTION_HINT_TOKENS
            and budget.gb is not None and per_block
            and (plan.predicted_peak_gb + extra_gb) * FRAGMENTATION <= budget.gb):
        plan.note = (f"{plan.note} train.keep_attention = true fits this budget too (+{extra_gb:.1f} GB): the "
                     f"{resident} checkpointed blocks would keep their attention outputs and the recompute skip "
                     f"attention, which makes long sequences faster.").strip()
    short = host_shortfall(plan)
    if short:  # `plan` shows it now; train stops with it before loading (load_device)
        plan.note = f"{plan.note} {short}".strip()
    return plan


# CUDA graphs under block swap (stages/core/fastpath.py, CaptureRoom): the trainer captures where the
# memory free under the budget is fastpath.CAPTURE_ROOM times the eager step's activations, else it runs
# eager, whose host time sets the pace at small images (512 px: FLUX at 6 GB 0.14-0.19x, Qwen-Image at
# 8 GB 0.16x their unconstrained speed; bench/memory.md). So a swap plan swaps more blocks, where that
# leaves the room: under graphs a swapped block costs little (Qwen-Image at 8 GB, 512 px: 0.53x under
# graphs with 27 swapped; FLUX at 6 GB, 1024 px: 0.91x with 54). The planner's room predicts the one the
# runtime measures: in the five swap rows that weighed it (memory-*-room-h200.json, 2026-12-02) the
# memory free at the capture was 0.14-0.25 GB below the budget less the planned peak without activations,
# and the eager step's activations (its allocation peak over what was allocated at its first call) were
# 0.10-0.20 GB above the formula's: the LoRA's gradients, allocated in the step (0.06-0.09 GB at rank 16),
# and ~0.1 GB more. With those allowances (the gradients scale with the LoRA's size) the planner's room came
# out 0.92-0.99x the measured one in those rows, which they were fitted on; the margin covers the rest.
GRAPH_FREE_SLACK_GB, GRAPH_ACTIVATIONS_EXTRA_GB = 0.25, 0.13
GRAPH_ROOM_MARGIN = 1.05


def graph_room(settings_peak_gb: float, acts_gb: float, grads_gb: float, budget: Budget, swapped: bool = True) -> float:
    """A plan's room for a capture as the runtime will measure it, by the planner's figures: the
    budget less what stays allocated between steps (the predicted peak without the activations and, under
    swap, the swap's allocator margin) and the measured slack, over what a step allocates (its
    activations, the LoRA's gradients `grads_gb`, and the measured extra)."""
    free = budget.gb - (settings_peak_gb - acts_gb - SWAP_EXTRA_GB * swapped) - GRAPH_FREE_SLACK_GB
    return free / (acts_gb + grads_gb + GRAPH_ACTIVATIONS_EXTRA_GB) if acts_gb > 0 else math.inf


def _graphs_mode(tcfg: Any, budget: Budget) -> str | None:
    """train.cuda_graphs' mode ("auto" or "on") where train may capture CUDA graphs under this budget,
    else None (CPU, LoRA dropout, or "off")."""
    from stages.core import fastpath

    mode = fastpath.graphs_mode(getattr(tcfg, "cuda_graphs", "auto"))
    return mode if budget.source != "cpu" and budget.gb is not None and tcfg.dropout == 0 and mode != "off" else None


def _with_graph_room(plan: StagePlan, candidates: list[tuple[dict[str, Any], float]], acts_of: Callable[[dict[str, Any]], float],
                     grads_gb: float, budget: Budget, mode: str, fewer_fp8: bool = False) -> StagePlan:
    """A budget-bound plan that leaves CUDA graphs room to capture, else `plan` as it is (under "auto" it
    will run eager); its note says which. A swap plan swaps more blocks (the fewest more that leave the
    room; same precision and checkpointing); a plan whose checkpointing `auto` chose within the budget (no
    swap) checkpoints more blocks (the fewest more; same precision): at a cap near the step's peak a capture
    without room ran out of memory and so did the eager steps after it (FLUX.2 klein, nf4, 1024 px at the
    diffusers script's 5.08 GB: 23 of 25 blocks checkpointed; bench/results/peers-klein-1024-b1-g3.json).
    `fewer_fp8` (an fp8 base whose fp8 blocks the planner chose within the budget): where checkpointing more
    leaves no room, the fewest fewer fp8 blocks that do (same checkpointing): klein's 22 fp8 blocks at the
    script's 5.74 GB reserved peak left 2.10 GB for a capture that wanted 2.33, so every step ran eager, 0.29 s
    against 0.20 with graphs (bench/results/peers-klein-1024-b1-fitreserved-fp8-expandable.json).
    `acts_of(settings)`: a plan's activations in GB."""
    from stages.core import fastpath

    swapped = bool(plan.settings["swapped_blocks"])
    want = (fastpath.CAPTURE_ROOM if swapped else fastpath.UNSWAPPED_CAPTURE_ROOM) * GRAPH_ROOM_MARGIN
    # (setting varied, +1: more of it gives room / -1: fewer does, settings kept, what the note calls it)
    ways = ([("swapped_blocks", 1, ("base_precision", "checkpointed_blocks"), "swapped")] if swapped else
            [("checkpointed_blocks", 1, ("base_precision", "swapped_blocks", "fp8_blocks"), "checkpointed")]
            + ([("fp8_blocks", -1, ("base_precision", "swapped_blocks", "checkpointed_blocks"), "in fp8")]
               if fewer_fp8 else []))
    room_at = lambda s, peak: graph_room(peak, acts_of(s), grads_gb, budget, swapped)  # noqa: E731
    room = room_at(plan.settings, plan.predicted_peak_gb)

    def first_with_room(vary: str, sign: int, keep: tuple[str, ...]) -> tuple[dict[str, Any], float] | None:
        """The first candidate (the fewest more, or fewer, of `vary`) with the rest as planned that fits and leaves the room."""
        return next(((s, peak) for s, peak in candidates
                     if all(s.get(k) == plan.settings.get(k) for k in keep) and s.get(vary) is not None
                     and (s[vary] - plan.settings[vary]) * sign > 0
                     and peak * FRAGMENTATION <= budget.gb and room_at(s, peak) >= want), None)

    hit = None if room >= want else next(((way, h) for way in ways if (h := first_with_room(*way[:3])) is not None), None)
    if hit is not None:
        (vary, sign, _, what), (settings, peak) = hit
        extra, room = abs(settings[vary] - plan.settings[vary]), room_at(settings, peak)
        more, than = ("more", "the budget needs") if sign > 0 else ("fewer", "the budget allows")
        why = ("eager steps under swap can be host-bound, most at small images" if swapped else
               "a capture without room can run out of memory" if vary == "checkpointed_blocks" else
               "eager steps at the cap run slower")
        note = (f"{extra} {more} block{'s' * (extra > 1)} {what} than {than}, to leave CUDA graphs room to "
                f"capture ({room:.1f}x the step's activations free; {want:.1f}x wanted): {why}")
        plan = dataclasses.replace(plan, settings=settings, predicted_peak_gb=peak, note=note)
    elif room < want:
        then = ("train.cuda_graphs = 'on' captures anyway and may run out of memory there"
                if mode == "on" else
                "train checks at the capture, else runs eager, which can be host-bound, most at small images")
        plan.note = (f"CUDA graphs may have no room to capture under this {'swap ' * swapped}plan ({room:.1f}x the step's "
                     f"activations free, {want:.1f}x wanted; {then}; a larger --vram gives them room)")
    plan.settings = {**plan.settings, "graph_room": round(room, 2)}
    return plan


def _train_options(configured: bool | str, precisions: list[str], n: int,
                   swap_order: list[str] | None = None) -> list[tuple[str, int, int]]:
    """(precision, swapped blocks, checkpointed blocks) in the order train tries them, cheapest in speed
    first: every precision without swapping (in `precisions`' order, fastest first; as configured,
    then checkpointed), then more and more blocks swapped, all checkpointed, the precisions in
    `swap_order` (never fp8: its base is quantized on the GPU from a host copy, with no block kept in
    host memory; smallest first: an nf4 block copies a quarter of a bf16 block's bytes, and fewer
    of them must be swapped). A smaller precision that fits whole beats swapping: SDXL at a 4 GB cap
    ran 0.23x with 38 of 70 bf16 blocks swapped, where its nf4 base fits at 3.0 GB and runs 0.79x of
    bf16 (bench/results/memory-zimage-sdxl-h200.json, bench-sdxl-E.json); Qwen-Image at 8 GB ran
    0.40x with 56 of 60 bf16 blocks swapped and 0.50x with 36 nf4 blocks (before swap ran under
    CUDA graphs).

    "auto" tries, at each precision in turn, 0, 1, ..., n checkpointed blocks (fewest first: each
    un-checkpointed block saves its recompute: 29 % of an eager FLUX.2 klein step for all of them,
    bench/LOG.md), so it un-checkpoints only what fits at the precision the other settings would pick,
    and never swaps a block or moves to the next precision to un-checkpoint one: swapping costs far more
    than recompute (FLUX at 8 GB, 15 blocks swapped: 0.85x)."""
    if configured == "auto":
        whole = [(p, 0, k) for p in precisions for k in range(n + 1)]
    else:
        whole = [(p, 0, n if c else 0) for p in precisions for c in dict.fromkeys((configured, True))]
    return whole + [(p, k, n) for p in (swap_order or precisions) if p != "fp8" for k in range(1, n + 1)]


def _with_fp8_nf4(options: list[tuple[str, int, int]], n: int, fixed: int | str = "auto") -> list[tuple[str, int, int, int | None]]:
    """`_train_options`' options with how many blocks stay fp8 (None: the precision whole), and after the
    last whole fp8 option the same checkpointing with the first n-1, n-2, ... blocks in fp8 and the rest
    nf4 (stages/core/fp8.py `quantize_fp8_nf4`): where the whole fp8 base does not fit, its fastest
    blocks go as far as the budget allows before the plan falls to nf4 whole. Most fp8 blocks first, then
    fewest checkpointed: on FLUX.2 klein at 1024 px a GB of fp8 blocks saved ~21 ms a step (nf4 0.252 s,
    fp8 0.209 s, 2.0 GB apart: docs/performance.md), a GB of un-checkpointed blocks ~9 ms.
    Under "auto" at least a quarter of the blocks (rounded up) stay fp8: fewer would take too little off
    the step to be worth the memory (klein's 16 of 25 took 17 % off nf4's). `fixed` (train.fp8_blocks as a
    number below n): the fp8 options have exactly that many fp8 blocks."""
    out: list[tuple[str, int, int, int | None]] = [(p, s, k, None) for p, s, k in options]
    whole_fp8 = [i for i, (p, s, _, _) in enumerate(out) if p == "fp8" and not s]
    if not whole_fp8 or n < 2 or (fixed != "auto" and fixed >= n):
        return out
    at = whole_fp8[-1] + 1
    counts = range(n - 1, math.ceil(n / 4) - 1, -1) if fixed == "auto" else [fixed]
    mixed = [("fp8", 0, out[i][2], m) for m in counts for i in whole_fp8]
    if fixed != "auto":  # the whole fp8 base is not an option then
        return [o for i, o in enumerate(out[:at]) if i not in whole_fp8] + mixed + out[at:]
    return out[:at] + mixed + out[at:]


# ---- sample
def module_components(src: Any, names: tuple[str, ...]) -> list[str]:
    """The components among `names` that are torch modules (not a tokenizer, processor or scheduler)."""
    import importlib

    index = src.component_config("", "model_index.json")
    return [c for c in names if c in index and isinstance(index[c], list) and index[c][0]
            and isinstance(cls := getattr(importlib.import_module(index[c][0]), index[c][1], None), type)
            and issubclass(cls, torch.nn.Module)]


CFG_BATCH = 2  # a guided step may run the denoiser on the prompt and the negative prompt together


def plan_sample(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    """The whole pipeline the sample stage renders with: bf16 on the GPU, then bf16 under diffusers' model
    CPU offload (one component on the GPU at a time), then the denoiser and text encoders in nf4 on the GPU
    (bitsandbytes through diffusers' PipelineQuantizationConfig; the VAE stays bf16), then nf4 offloaded.
    `sample.precision` other than "auto" fixes the precision, `sample.cpu_offload = true` the offload.
    A pipeline on the GPU whole is read there shard by shard (`device_map="cuda"`), but an offloaded one
    lives in host memory, so bf16 offload is left out where its weights exceed the host memory available
    (FLUX.2 dev: 112.6 GB), as is bf16 whole from a single-file checkpoint (read on the host first).
    Activations are ESTIMATES, not measured: the denoiser's inference work at the sample size (the
    text encoders' rule: BLOCK_WORK_UNITS per token and width, CFG_BATCH rows) and the VAE's decode of one
    image (cache-latents' encode rule), the larger of the two, since they never run together."""
    s = cfg.sample
    models = {c: meta_component(src, c) for c in module_components(
        src, family.text_components + family.vae_components + family.denoiser_components)}
    quantized = set(models) - set(family.vae_components)  # what nf4 quantizes: the text encoders and the denoiser
    width, height = s.width or cfg.data.resolution, s.height or cfg.data.resolution
    tokens = (width // 16) * (height // 16) * (1 + _planned_controls(cfg, family)) + cfg.captions.max_sequence_length
    work = {c: CFG_BATCH * tokens * _width(models[c]) * 2 * BLOCK_WORK_UNITS for c in quantized}
    work.update({c: width * height * VAE_ELEMENTS_PER_PIXEL * 2 for c in family.vae_components})
    fixed_gb, per_sample_gb = family.outside_block_gb  # SDXL's ResNets (train's figure: an upper bound)
    work[family.denoiser_components[0]] += (fixed_gb + per_sample_gb * CFG_BATCH * width * height / 512**2) * GB
    precisions = ["bf16", "nf4"] if s.precision == "auto" else [s.precision]
    offloads = [True] if s.cpu_offload else [False, True]
    host, notes, candidates = host_available_bytes(), [], []
    for precision in precisions:
        sizes = {c: weight_bytes(m, precision if (precision != "nf4" or c in quantized) else "bf16")
                 for c, m in models.items()}
        for offload in offloads:
            on_host = precision != "nf4" and (offload or src.is_single_file)
            if on_host and host is not None and sum(sizes.values()) > host and len(precisions) * len(offloads) > 1:
                notes.append(f"{precision}{' offloaded' if offload else ''} left out: its {sum(sizes.values()) / GB:.1f} GB "
                             f"of weights exceed the {host / GB:.1f} GB of host memory available")
                continue
            peak = (max(sizes[c] + work[c] for c in models) if offload
                    else sum(sizes.values()) + max(work.values()))
            candidates.append(({"precision": precision, "cpu_offload": offload}, peak / GB))
    plan = _fitting(budget, candidates, "sample", "lower sample.width and sample.height")
    plan.note = "; ".join([*notes, plan.note] if plan.note else notes)
    return plan


PLANNERS = {"encode-captions": plan_captions, "cache-latents": plan_latents, "train": plan_train, "sample": plan_sample}


def plan_for(cfg: Any, family: Any, src: Any, budget: Budget, stage: str) -> StagePlan:
    """The stage's plan. Under "auto" the cheap stages plan for the train stage's predicted peak
    when it is below the free memory, so they never set the run's memory."""
    if budget.source == "auto" and stage in ("encode-captions", "cache-latents"):
        train = plan_train(cfg, family, src, budget)
        if train.fits and train.predicted_peak_gb * FRAGMENTATION < budget.gb:
            plan = PLANNERS[stage](cfg, family, src, Budget(round(train.predicted_peak_gb * FRAGMENTATION, 3), "auto"))
            if plan.fits and not _forced_only(cfg, plan):
                plan.budget, plan.note = budget, "auto: planned for the train stage's predicted peak"
                return plan
    return PLANNERS[stage](cfg, family, src, budget)


def _configured_vae_precision(cfg: Any) -> str:
    """The VAE precision `cfg` asks for ("auto": bf16, the planner's first choice)."""
    return "bf16" if cfg.latents.vae_precision == "auto" else cfg.latents.vae_precision


def _forced_only(cfg: Any, plan: StagePlan) -> bool:
    """A plan that "auto" takes only when the free memory forces it, not to stay under train's peak:
    an encode-captions plan that offloads layers (slower, for memory nobody else needs), or a
    cache-latents plan that stores other numbers than configured (a lower VAE precision, a tiled
    encode: FLUX.2 klein at 1024 px cached bf16 latents on a free H200 for a 3 GB train stage)."""
    if plan.stage == "encode-captions":
        return bool(plan.settings.get("offload_gb"))
    if plan.stage != "cache-latents":
        return False
    configured = _configured_vae_precision(cfg)
    return plan.settings["vae_precision"] != configured or plan.settings["tiled"]


def unplanned(cfg: Any, stage: str, budget: Budget) -> StagePlan:
    """The configured settings as they are (CPU: no budget to plan for)."""
    settings = {"encode-captions": {"text_encoder_precision": cfg.captions.text_encoder_precision,
                                    "batch_size": cfg.captions.batch_size},
                "cache-latents": {"vae_precision": cfg.latents.vae_precision, "sliced": False, "tiled": False},
                "sample": {"precision": cfg.sample.precision, "cpu_offload": cfg.sample.cpu_offload},
                "train": {"base_precision": cfg.train.base_precision, "swapped_blocks": 0,
                          # "auto" without a budget: every block checkpointed (None: all of them)
                          "gradient_checkpointing": cfg.train.gradient_checkpointing is not False,
                          "checkpointed_blocks": None}}[stage]
    return StagePlan(stage, budget, settings, 0.0, True, "no GPU: settings as configured")


def with_plan(cfg: Any, plan: StagePlan) -> Any:
    """`cfg` with the plan's settings written into the stage's section."""
    s = plan.settings
    if plan.stage == "encode-captions":
        return dataclasses.replace(cfg, captions=dataclasses.replace(
            cfg.captions, text_encoder_precision=s["text_encoder_precision"], batch_size=s["batch_size"]))
    if plan.stage == "cache-latents":
        return dataclasses.replace(cfg, latents=dataclasses.replace(cfg.latents, vae_precision=s["vae_precision"]))
    if plan.stage == "sample":
        return dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, precision=s["precision"],
                                                                   cpu_offload=s["cpu_offload"]))
    train = dataclasses.replace(cfg.train, base_precision=s["base_precision"],
                                gradient_checkpointing=s["gradient_checkpointing"])
    return dataclasses.replace(cfg, train=train)


def plans_for_gpu(cfg: Any) -> bool:
    """Whether `cfg`'s stages plan for a GPU budget (its device is CUDA; tests simulate one here)."""
    from stages.core.runtime import pick_device

    return pick_device(cfg.device).type == "cuda"


def _planned(cfg: Any, family: Any, stage: str) -> dict[str, Any] | None:
    """The settings `stage` plans for `cfg` on a GPU (None on CPU), without measuring free memory,
    so the fingerprint a later stage checks is the one this stage wrote. Under "auto" it assumes the
    free memory exceeds train's peak (when it did not, the stage records what it forced:
    `forced_by_memory`)."""
    from stages.core.model_source import model_source

    if not plans_for_gpu(cfg):
        return None
    value = parse_budget(cfg.gpu.vram_budget_gb)
    budget = Budget(float("inf"), "auto") if value == "auto" else Budget(float(value), "cap")
    return plan_for(cfg, family, model_source(cfg), budget, stage).settings


def planned_caption_precision(cfg: Any, family: Any) -> str | None:
    """The text-encoder precision encode-captions plans when it is "auto" (the first GPU run: train
    refused nf4 captions as stale because it resolved "auto" to bf16)."""
    if cfg.captions.text_encoder_precision != "auto":
        return None
    return (_planned(cfg, family, "encode-captions") or {}).get("text_encoder_precision")


def planned_vae(cfg: Any, family: Any) -> dict[str, Any] | None:
    """The VAE settings cache-latents plans (None on CPU): a budget too small for the configured
    precision lowers it, a smaller one tiles the encode (train refused such latents as stale while it
    expected the configured precision)."""
    return _planned(cfg, family, "cache-latents")


def forced_by_memory(cfg: Any, plan: StagePlan) -> str | None:
    """Why an "auto" cache-latents `plan` stores other numbers than `cfg` (as configured, before the
    plan) asks, naming the free memory that would avoid it; None when it does not. Only the free
    memory can force this: a cap gives the same plan at every stage, so the layout train expects."""
    if plan.stage != "cache-latents" or plan.budget.source != "auto" or not _forced_only(cfg, plan):
        return None
    configured = _configured_vae_precision(cfg)
    what = " and ".join(w for w, forced in [(f"the VAE in {plan.settings['vae_precision']}",
                                             plan.settings["vae_precision"] != configured),
                                            ("a tiled encode", plan.settings["tiled"])] if forced)
    need = min(t["predicted_peak_gb"] for t in plan.tried
               if t["vae_precision"] == configured and not t["tiled"]) * FRAGMENTATION
    return (f"the free GPU memory forced {what} on cache-latents: rerun it with {need + AUTO_MARGIN_GB:.1f} GB of GPU "
            f"memory free to encode the latents as configured ({configured}, untiled: {need:.2f} GB; the 'auto' budget "
            f"was {plan.budget.gb:.2f} GB, the free memory less {AUTO_MARGIN_GB} GB). These latents are other numbers: "
            f"tiling moved random-weight VAEs' posterior mean by 24-81 % relative RMS, bf16 by 1.5-3 % "
            f"(bench/results/tiling-h200.json)")


def plan_stage(cfg: Any, family: Any, stage: str, log: Any, below_gb: float | None = None) -> tuple[Any, StagePlan]:
    """Resolve (and enforce) the budget, plan the stage, log a `plan` event; the config to run with.
    `below_gb`: plan as if the budget were at most that (the sample stage's retry after an out-of-memory
    error: the next smaller plan), without enforcing it."""
    from stages.core.model_source import model_source
    from stages.core.runtime import pick_device

    budget = resolve_budget(cfg.gpu.vram_budget_gb, pick_device(cfg.device))
    if below_gb is not None and budget.gb is not None:
        budget = Budget(min(budget.gb, below_gb), budget.source)
    if budget.gb is None:
        plan = unplanned(cfg, stage, budget)
    else:
        plan = plan_for(cfg, family, model_source(cfg), budget, stage)
    log.emit("plan", **plan.to_dict())
    if not plan.fits:
        log.emit("warning", message=plan.note)
    return (with_plan(cfg, plan) if budget.gb is not None else cfg), plan


# ---- applying a plan
def apply_vae_plan(vae: torch.nn.Module, plan: StagePlan, tile_px: int | None = None) -> None:
    """Sliced and tiled encode as the plan says. Tiles are VAE_TILE_PIXELS square (`tile_px` instead:
    tests and `bench/tiling.py --tiny` use small tiles so tiny images really tile), overlapping by a
    quarter, as both diffusers tilings do by default; bench/tiling.py measures what tiling changes."""
    if plan.settings.get("sliced") and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    if not (plan.settings.get("tiled") and hasattr(vae, "enable_tiling")):
        return
    side = tile_px or VAE_TILE_PIXELS.get(type(vae).__name__, 512)
    if hasattr(vae, "tile_sample_min_size"):  # AutoencoderKL(-Flux2) tiles at its sample_size (1024) by default
        vae.enable_tiling()
        scale = 2 ** (len(vae.config.block_out_channels) - 1)  # 8 for the released VAEs
        vae.tile_sample_min_size, vae.tile_latent_min_size = side, side // scale
    elif hasattr(vae, "tile_sample_min_height"):  # the Qwen-Image VAEs: 256 px tiles every 192 px by default
        vae.enable_tiling(side, side, side * 3 // 4, side * 3 // 4)
    else:
        vae.enable_tiling()


def host_available_bytes() -> int | None:
    """The host memory the kernel can give without swapping (/proc/meminfo MemAvailable); None where
    that file does not exist (not Linux): then nothing is checked."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_shortfall(plan: StagePlan) -> str:
    """What stops a train plan whose host memory (a swap plan's swapped blocks, plus a bf16 copy of the base
    where its files are not bf16 safetensors; an fp8 base from a single file: its bf16 read) needs more
    than the host has available; "" when it fits or the host cannot tell."""
    swapped = plan.settings.get("swapped_blocks")
    need, available = plan.settings.get("host_gb"), host_available_bytes()
    if not need or available is None or need * GB <= available:
        return ""
    if swapped:
        why = (f"the plan swaps {swapped} of {plan.settings.get('blocks')} blocks to fit the GPU budget "
               f"({plan.budget.gb or 0:.1f} GB), which needs {need:.1f} GB of host memory (the swapped blocks, "
               f"plus a bf16 copy of the base where its files are not bf16 safetensors)")
        fix = "give the stage more GPU memory (--vram) so that fewer blocks, or none, are swapped"
    else:
        why = (f"an fp8 base from a single-file checkpoint (or from a folder whose weights diffusers converts on "
               f"load) reads the base in bf16 ({need:.1f} GB) into host memory first")
        fix = ("point 'model' at a diffusers folder saved by diffusers (an fp8 load streams its shards), or use "
               "train.base_precision = 'nf4' or 'bf16', which load shard by shard")
    return f"train: {why}, but only {available / GB:.1f} GB of host memory is available: free host memory, or {fix}"


def load_device(plan: StagePlan, rt: Any) -> Any:
    """Where train loads the base: host memory when blocks will be swapped (only what stays resident
    then reaches the GPU; an nf4 base is quantized there block by block), else the runtime's device.
    A plan whose bf16 read (swap, fp8) does not fit the available host memory stops here with what to
    do, before anything loads (the kernel's OOM killer would end the process without a word). A plan
    whose fp8 base keeps only its first blocks in fp8 loads it as a MixedLoad."""
    from stages.core.runtime import HostLoad, MixedLoad

    short = host_shortfall(plan)
    if short:
        raise ResourceError(short)
    if plan.settings.get("fp8_blocks") is not None:  # fp8 for the first blocks, nf4 for the rest
        return MixedLoad(rt.device, rt.dtype, fp8_blocks=plan.settings["fp8_blocks"])
    swapped = plan.settings.get("swapped_blocks")
    if not swapped:
        return rt
    return HostLoad(torch.device("cpu"), rt.dtype, target=rt.device, swapped_blocks=swapped,
                    swap_layout=plan.settings.get("swap_layout", "last"))


def text_encoder_runtime(plan: StagePlan, rt: Any) -> Any:
    """Where encode-captions loads its text encoders: `rt`, or under a layer-offload plan an
    OffloadLoad giving rt's device the plan's share of the weights (accelerate checked here, before
    anything loads)."""
    from stages.core.runtime import OffloadLoad, require_accelerate

    share = plan.settings.get("gpu_weights_gb")
    if share is None:
        return rt
    require_accelerate("the encode-captions plan (layer offload of the text encoder)")
    return OffloadLoad(rt.device, rt.dtype, device_bytes=int(share * GB))


def checkpointed_blocks(plan: StagePlan, blocks: int) -> int:
    """How many of the model's `blocks` repeated blocks the train plan checkpoints (all of them when the
    plan says checkpointing without a number: on CPU, or a plan made before partial checkpointing)."""
    if not plan.settings.get("gradient_checkpointing"):
        return 0
    k = plan.settings.get("checkpointed_blocks")
    return blocks if k is None else min(k, blocks)


def apply_train_plan(model: torch.nn.Module, plan: StagePlan, rt: Any) -> blockswap.BlockSwap | None:
    """Install the plan's block swap (after LoRA is attached, before the optimizer is made)."""
    swap = blockswap.install_block_swap(model, plan.settings.get("swapped_blocks", 0), rt.device,
                                        plan.settings.get("swap_layout", "last"))
    blockswap.move_unswapped(model, swap, rt.device)
    return swap


# ---- out of memory
SETTING_TO_CHANGE = {
    "encode-captions": "captions.batch_size or captions.text_encoder_precision = 'nf4'",
    "cache-latents": "latents.vae_precision = 'bf16' or data.resolution",
    "train": ("train.batch_size, data.resolution or train.base_precision = 'nf4' (or set train.cuda_graphs = 'off': "
              "capturing a graph takes memory of its own)"),
    "sample": "sample.width and sample.height, or set sample.precision = 'nf4' and sample.cpu_offload = true",
}


def translate_oom(error: BaseException, cfg: Any, stage: str) -> ResourceError | None:
    """A CUDA out-of-memory error as a ResourceError that names the stage, the budget, the peak it
    reached and what to change; None for any other error."""
    import sys

    torch_mod = sys.modules.get("torch")
    if torch_mod is None or not isinstance(error, torch_mod.cuda.OutOfMemoryError):
        return None
    peak = torch_mod.cuda.max_memory_reserved() / GB if torch_mod.cuda.is_available() else 0.0
    budget = getattr(getattr(cfg, "gpu", None), "vram_budget_gb", "auto")
    budget_text = "auto: the free memory at start" if budget == "auto" else f"{budget} GB"
    return ResourceError(
        f"{stage} ran out of GPU memory (budget {budget_text}, peak reached {peak:.2f} GB): rerun with a lower "
        f"--vram (gpu.vram_budget_gb) so the planner picks smaller settings, or lower {SETTING_TO_CHANGE.get(stage, 'the batch size')}; "
        f"everything already written is kept and the rerun continues from it")
