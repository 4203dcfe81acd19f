"""encode-captions' plan: the text encoders' precision, batch size and layer offload within a budget."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from stages.core.lazy import lazy_module
from stages.core.memory import calibration as cal
from stages.core.memory.budget import Budget
from stages.core.memory.sizes import meta_component, module_components, text_dims, weight_bytes
from stages.core.memory.stage_plan import (Planner, StagePlan, changeable, either, fitting, halvings, nf4_instead,
                                          planned_controls)

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch


def plan(cfg: Any, family: Any, src: Any, budget: Budget) -> StagePlan:
    """bf16 whole (halving the batch), then nf4 whole, then layer offload (`_offload_candidates`)."""
    from stages.core.runtime import has_accelerate

    models = {c: meta_component(src, c) for c in module_components(src, family.text_components)}
    configured = cfg.captions.text_encoder_precision
    precisions = [first_precision(cfg), "nf4"] if configured == "auto" else [configured]
    tokens = encode_tokens(cfg, family)
    # an encoder that reads the controls takes one caption at a time, whatever the batch size
    work = {batch: max(encode_work(m, 1 if family.text_sees_controls else batch, tokens, family.text_keeps_hidden_states)
                       for m in models.values())
            for batch in halvings(cfg.captions.batch_size)}
    candidates = []
    for precision in precisions:
        weights = _weights(family, models, precision)
        for batch, w in work.items():
            candidates.append(({"text_encoder_precision": precision, "batch_size": batch}, (weights + w) / cal.GB))
    candidates += _offload_candidates(cfg, family, models, work, budget)
    need = [_smaller(cfg, family)]
    if OFFLOAD_PRECISION.get(configured) and family.text_offload_components and not has_accelerate():
        need.append("install accelerate so the text encoder's layers can stay in CPU memory (layer offload)")
    return fitting(budget, candidates, "encode-captions", either(*need))


def encode_tokens(cfg: Any, family: Any) -> int:
    """The tokens an encode plans for: captions.max_sequence_length, what the family's template adds beyond it,
    and the vision tokens of an item's controls where the encoder reads them."""
    controls = planned_controls(cfg, family) if family.text_sees_controls else 0
    return max(cfg.captions.max_sequence_length + family.text_tokens_beyond_max, 77) + controls * family.text_tokens_per_control


def _weights(family: Any, models: dict[str, Any], precision: str) -> float:
    """The text encoders' bytes in `precision` (the components a family keeps in bf16 at their bf16 size)."""
    return sum(weight_bytes(m, "bf16" if precision == "nf4" and c in family.text_whole_components else precision)
               for c, m in models.items())


def batch_for_captions(cfg: Any, family: Any, src: Any, plan: StagePlan, longest: int) -> StagePlan:
    """The plan to encode with once the captions are known: where the family's encoders read a batch at its
    longest caption (family.text_padded_to_longest) and the longest caption to encode has `longest` tokens, the
    largest batch the plan tried that its precision fits under its budget at that length, with its predicted peak
    there (the plan is for the longest caption captions.max_sequence_length allows); else `plan` itself."""
    planned = plan.settings.get("batch_size", cfg.captions.batch_size)
    if (not family.text_padded_to_longest or family.text_sees_controls or not plan.fits or plan.budget.gb is None
            or plan.budget.source == "cpu" or "offload_gb" in plan.settings):
        return plan
    limit = cfg.captions.max_sequence_length
    tokens = max(min(longest, limit) + family.text_tokens_beyond_max, 77)
    if tokens >= max(limit + family.text_tokens_beyond_max, 77):
        return plan
    models = {c: meta_component(src, c) for c in module_components(src, family.text_components)}
    weights = _weights(family, models, plan.settings["text_encoder_precision"])
    for batch in sorted({t["batch_size"] for t in plan.tried if "offload_gb" not in t}, reverse=True):
        if batch <= planned:
            break
        peak = (weights + max(encode_work(m, batch, tokens, family.text_keeps_hidden_states) for m in models.values())) / cal.GB
        if peak * cal.FRAGMENTATION <= plan.budget.gb:
            return dataclasses.replace(plan, settings={**plan.settings, "batch_size": batch}, predicted_peak_gb=peak,
                                       note=f"batches of {batch} for captions of at most {longest} tokens (the plan for "
                                            f"{limit}, captions.max_sequence_length, had {planned})")
    return plan


def _smaller(cfg: Any, family: Any) -> str:
    """What lowers encode-captions' memory below every plan it tried (each batch size down to 1 was): an nf4
    text encoder where another precision is set, then a shorter captions.max_sequence_length ("" when neither)."""
    tokens = cfg.captions.max_sequence_length
    shorter = changeable(("captions.max_sequence_length", tokens, tokens > 77))
    return either(nf4_instead("captions.text_encoder_precision", cfg.captions.text_encoder_precision),
                  shorter and f"{shorter} (the encoders' attention grows with its square; longer captions are cut)")


def encode_work(model: torch.nn.Module, batch: int, tokens: int, keeps_hidden_states: bool) -> float:
    """Bytes one encode of `batch` captions padded to `tokens` works in beside the weights: per token, the
    layer being run (calibration.BLOCK_WORK_UNITS of the width), every layer's hidden states where the family
    reads an inner one, and the logits of a language-model head over the vocabulary (the forward computes
    them at every position); per caption, the attention's scores, heads x tokens^2
    (calibration.ATTENTION_SCORE_BYTES), which set the peak of long captions (FLUX.1's T5 at 512 tokens)."""
    width, heads, layers, vocab = text_dims(model)
    per_token = width * 2 * (cal.BLOCK_WORK_UNITS + (layers + 1 if keeps_hidden_states else 0)) + vocab * 2
    return batch * (tokens * per_token + heads * tokens**2 * cal.ATTENTION_SCORE_BYTES)


def first_precision(cfg: Any) -> str:
    """The text encoders' precision `plan` tries first, so gives wherever memory allows: "auto" is bf16."""
    configured = cfg.captions.text_encoder_precision
    return "bf16" if configured == "auto" else configured


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
        share = budget.gb * cal.GB / cal.FRAGMENTATION - others - w
        if share >= whole:
            continue
        share_gb = math.floor(max(share, 0.0) / cal.GB * 1000) / 1000  # the stage passes this share, so it gets this map
        placed = offload_placement(model, precision, share_gb)
        if placed is None:  # nothing would stay on the GPU (then the encoder would run on the CPU): the least that does
            share_gb = math.ceil(_least_share(model, precision) / cal.GB * 1000) / 1000
            placed = offload_placement(model, precision, share_gb)
        if placed is None:
            continue
        settings = {"text_encoder_precision": precision, "batch_size": batch, "offload_gb": round(placed.offloaded / cal.GB, 3),
                    "gpu_weights_gb": share_gb, "gpu_layers": placed.gpu_layers, "layers": placed.layers}
        candidates.append((settings, (others + placed.resident + placed.in_flight + w) / cal.GB))
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
        device_map = _get_device_map(model, "auto", {0: int(device_gb * cal.GB), "cpu": HOST_BYTES}, None)
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


def _forced_only(cfg: Any, plan: StagePlan) -> bool:
    """A plan that offloads layers (slower, for memory nobody else needs), or that encodes in another
    precision than the first one tried: "auto" takes it only when the free memory forces it."""
    return bool(plan.settings.get("offload_gb")) or plan.settings["text_encoder_precision"] != first_precision(cfg)


def _apply(cfg: Any, s: dict[str, Any]) -> Any:
    return dataclasses.replace(cfg, captions=dataclasses.replace(
        cfg.captions, text_encoder_precision=s["text_encoder_precision"], batch_size=s["batch_size"]))


PLANNER = Planner(
    "encode-captions", plan,
    configured=lambda cfg: {"text_encoder_precision": cfg.captions.text_encoder_precision,
                            "batch_size": cfg.captions.batch_size},
    apply=_apply, to_change="captions.batch_size or captions.text_encoder_precision = 'nf4'",
    under_train_peak=True, forced_only=_forced_only,
    keys={"text_encoder_precision": "captions.text_encoder_precision", "batch_size": "captions.batch_size"},
    last_resort=_smaller)
