"""A kohya/ComfyUI-keyed copy of a trained LoRA: `lora_unet_<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`.

    python pipeline.py export-lora --config configs/flux-dev.toml --format kohya

Names come from the denoiser's diffusers module paths with dots turned into underscores
(`transformer_blocks.0.attn.to_q` -> `lora_unet_transformer_blocks_0_attn_to_q`), which is what
ComfyUI and diffusers' own kohya converters read for SDXL (bar two renames), Qwen-Image and
Z-Image. FLUX.1 is the
exception: kohya sd-scripts and ComfyUI name its layers as Black Forest Labs' checkpoint does
(`double_blocks_0_img_attn_qkv`), where q, k and v are one fused linear; `FLUX_BFL` maps those and
writes the fused LoRA as a block-diagonal one (down rows stacked, up blocks on the diagonal), which
is exactly the separate LoRAs summed, and which diffusers' converter splits back without loss.

The alpha/rank scale (alpha/sqrt(rank) for rsLoRA) is folded into `lora_up` and `.alpha` is written
equal to the rank, so every reader (ComfyUI, kohya, diffusers, which ignores alpha for FLUX's final
layer) applies the same scale 1. The file carries no diffusers adapter metadata on purpose: with it,
diffusers would re-apply lora_alpha/r on top of the folded scale.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import torch

from stages.core.errors import UserError

KOHYA_FILE = "lora_kohya.safetensors"
PREFIX = "lora_unet_"


class KohyaError(UserError, ValueError):
    """The adapter cannot be written in kohya format; the message says why and what to change."""


# diffusers module path -> (BFL module name, member index, member count) for FLUX.1's transformer.
# Fused members are ordered as in BFL's weights: qkv = [q, k, v]; linear1 = [q, k, v, mlp].
_FLUX_RULES: list[tuple[str, str, int, int]] = [
    (r"transformer_blocks\.(\d+)\.attn\.to_q", r"double_blocks_\1_img_attn_qkv", 0, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_k", r"double_blocks_\1_img_attn_qkv", 1, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_v", r"double_blocks_\1_img_attn_qkv", 2, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks_\1_img_attn_proj", 0, 1),
    (r"transformer_blocks\.(\d+)\.attn\.add_q_proj", r"double_blocks_\1_txt_attn_qkv", 0, 3),
    (r"transformer_blocks\.(\d+)\.attn\.add_k_proj", r"double_blocks_\1_txt_attn_qkv", 1, 3),
    (r"transformer_blocks\.(\d+)\.attn\.add_v_proj", r"double_blocks_\1_txt_attn_qkv", 2, 3),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks_\1_txt_attn_proj", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", r"double_blocks_\1_img_mlp_0", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff\.net\.2", r"double_blocks_\1_img_mlp_2", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj", r"double_blocks_\1_txt_mlp_0", 0, 1),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.2", r"double_blocks_\1_txt_mlp_2", 0, 1),
    (r"transformer_blocks\.(\d+)\.norm1\.linear", r"double_blocks_\1_img_mod_lin", 0, 1),
    (r"transformer_blocks\.(\d+)\.norm1_context\.linear", r"double_blocks_\1_txt_mod_lin", 0, 1),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_q", r"single_blocks_\1_linear1", 0, 4),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_k", r"single_blocks_\1_linear1", 1, 4),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_v", r"single_blocks_\1_linear1", 2, 4),
    (r"single_transformer_blocks\.(\d+)\.proj_mlp", r"single_blocks_\1_linear1", 3, 4),
    (r"single_transformer_blocks\.(\d+)\.proj_out", r"single_blocks_\1_linear2", 0, 1),
    (r"single_transformer_blocks\.(\d+)\.norm\.linear", r"single_blocks_\1_modulation_lin", 0, 1),
    (r"x_embedder", "img_in", 0, 1),
    (r"context_embedder", "txt_in", 0, 1),
    (r"time_text_embed\.timestep_embedder\.linear_1", "time_in_in_layer", 0, 1),
    (r"time_text_embed\.timestep_embedder\.linear_2", "time_in_out_layer", 0, 1),
    (r"time_text_embed\.text_embedder\.linear_1", "vector_in_in_layer", 0, 1),
    (r"time_text_embed\.text_embedder\.linear_2", "vector_in_out_layer", 0, 1),
    (r"time_text_embed\.guidance_embedder\.linear_1", "guidance_in_in_layer", 0, 1),
    (r"time_text_embed\.guidance_embedder\.linear_2", "guidance_in_out_layer", 0, 1),
    (r"proj_out", "final_layer_linear", 0, 1),
    (r"norm_out\.linear", "final_layer_adaLN_modulation_1", 0, 1),
]
# BFL's final adaLN outputs (shift, scale); diffusers' norm_out.linear outputs (scale, shift).
_SWAP_HALVES = {"final_layer_adaLN_modulation_1"}


def diffusers_paths(module: str) -> tuple[str, int, int]:
    """Generic naming: (kohya name, member index, member count) = the diffusers path, never fused."""
    return module.replace(".", "_"), 0, 1


# SDXL's added-conditioning MLP under kohya's (SGM) name: diffusers' kohya converter strips the
# trailing index of any `*emb*` name it does not know, so `add_embedding_linear_1` would not survive.
_SDXL_RENAMES = {"add_embedding.linear_1": "label_emb_0_0", "add_embedding.linear_2": "label_emb_0_2"}


def sdxl_unet(module: str) -> tuple[str, int, int]:
    return _SDXL_RENAMES.get(module) or module.replace(".", "_"), 0, 1


def flux_bfl(module: str) -> tuple[str, int, int]:
    for pattern, name, index, count in _FLUX_RULES:
        m = re.fullmatch(pattern, module)
        if m:
            return m.expand(name), index, count
    raise KohyaError(f"FLUX module '{module}' has no kohya (BFL) name; drop it from train.target_modules "
                     f"or export with --format diffusers")


def flux_widths(config: dict[str, Any]) -> dict[str, int]:
    """Output width of every member of FLUX's fused layers, from the transformer's config.json.

    Needed when only some members of a fused layer are trained: the default targets (attn.to_q/k/v)
    train q, k and v of a single block's linear1 but not its proj_mlp, whose block stays zero."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    widths: dict[str, int] = {}
    for i in range(config.get("num_layers", 0)):
        for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            widths[f"transformer_blocks.{i}.attn.{p}"] = inner
    for i in range(config.get("num_single_layers", 0)):
        for p in ("attn.to_q", "attn.to_k", "attn.to_v"):
            widths[f"single_transformer_blocks.{i}.{p}"] = inner
        widths[f"single_transformer_blocks.{i}.proj_mlp"] = inner * 4  # FluxSingleTransformerBlock mlp_ratio 4.0
    return widths


@dataclass(frozen=True)
class Layout:
    name: Callable[[str], tuple[str, int, int]]
    """diffusers module path -> (kohya module name, member index, member count)."""
    widths: Callable[[dict[str, Any]], dict[str, int]] | None = None
    """denoiser config -> output widths of fused members (None: the layout fuses nothing)."""


GENERIC = Layout(diffusers_paths)
# Pipeline class -> naming; anything not listed uses its diffusers module paths.
LAYOUTS: dict[str, Layout] = {"FluxPipeline": Layout(flux_bfl, flux_widths),
                               "StableDiffusionXLPipeline": Layout(sdxl_unet)}


def lora_scale(lora_cfg: dict[str, Any], module: str, rank: int) -> float:
    """The factor peft multiplies B @ A by for this module."""
    alpha = lora_cfg.get("lora_alpha", rank)
    for pattern, value in (lora_cfg.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            alpha = value
    return alpha / (math.sqrt(rank) if lora_cfg.get("use_rslora") else rank)


def split_modules(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """peft state dict -> module path -> (lora_A (r, in), lora_B (out, r)); refuses what kohya can't hold."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key)
        if m is None:
            raise KohyaError(f"adapter key '{key}' is not a plain LoRA weight (DoRA, biases and embeddings have no "
                             f"kohya form here): export with --format diffusers")
        if tensor.dim() not in (2, 4):  # linear, or conv (kohya's LoCon: down (r, in, k, k), up (out, r, 1, 1))
            raise KohyaError(f"adapter key '{key}' has shape {tuple(tensor.shape)}; only linear and conv LoRA "
                             f"layers have a kohya form: export with --format diffusers")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    incomplete = [k for k, v in pairs.items() if len(v) != 2]
    if incomplete:
        raise KohyaError(f"adapter modules {incomplete[:3]} lack lora_A or lora_B; the adapter file is damaged")
    return {k: (v["A"], v["B"]) for k, v in sorted(pairs.items())}


def _fuse(members: dict[int, tuple[torch.Tensor, torch.Tensor, str]], count: int, name: str,
          out_dims: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal LoRA for a fused linear: down = [A_0; A_1; ...], up = diag(B_0, B_1, ...).

    A member without an adapter gets zero rows and a zero block of the same rank (its delta is zero)."""
    ranks = {a.shape[0] for a, _, _ in members.values()}
    if len(ranks) != 1:
        raise KohyaError(f"'{name}' fuses modules with ranks {sorted(ranks)}; kohya needs one rank per fused layer")
    (rank,) = ranks
    a0 = next(iter(members.values()))[0]
    downs, ups = [], []
    for i in range(count):
        if i in members:
            a, b, _ = members[i]
        else:
            if i not in out_dims:
                raise KohyaError(f"'{name}': cannot size the missing member {i}; train all of its parts or none")
            a, b = a0.new_zeros(rank, a0.shape[1]), a0.new_zeros(out_dims[i], rank)
        downs.append(a)
        ups.append(b)
    return torch.cat(downs, dim=0), torch.block_diag(*ups)


def kohya_state(state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], pipeline_class: str,
                out_dims: dict[str, int] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """(kohya tensors, kohya key -> the diffusers modules it holds). `out_dims` (module path -> output
    width) sizes the zero blocks of fused members that were not trained."""
    if lora_cfg.get("use_dora"):
        raise KohyaError("DoRA adapters are not written in kohya format here: export with --format diffusers")
    layout = LAYOUTS.get(pipeline_class, GENERIC).name
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, str]]] = {}
    counts: dict[str, int] = {}
    for module, (a, b) in split_modules(state).items():
        name, index, count = layout(module)
        b = b.float() * lora_scale(lora_cfg, module, a.shape[0])
        groups.setdefault(name, {})[index] = (a.float(), b, module)
        counts[name] = count
    widths = _widths_by_member(out_dims or {}, layout, set(groups))
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, list[str]] = {}
    for name, members in sorted(groups.items()):
        if counts[name] == 1:
            down, up = members[0][0], members[0][1]
        else:
            down, up = _fuse(members, counts[name], name, widths.get(name, {}))
        if name in _SWAP_HALVES:
            up = torch.cat(up.chunk(2, dim=0)[::-1], dim=0)
        key = PREFIX + name
        out[f"{key}.lora_down.weight"] = down.contiguous()
        out[f"{key}.lora_up.weight"] = up.contiguous()
        out[f"{key}.alpha"] = torch.tensor(float(down.shape[0]))  # scale already folded into lora_up
        sources[key] = [members[i][2] for i in sorted(members)]
    return out, sources


def _widths_by_member(out_dims: dict[str, int], layout: Callable[[str], tuple[str, int, int]],
                      names: set[str]) -> dict[str, dict[int, int]]:
    """kohya name -> member index -> output width, for the fused layers being written."""
    widths: dict[str, dict[int, int]] = {}
    for module, width in out_dims.items():
        try:
            name, index, count = layout(module)
        except KohyaError:
            continue
        if count > 1 and name in names:
            widths.setdefault(name, {})[index] = width
    return widths


def linear_out_dims(model: torch.nn.Module) -> dict[str, int]:
    """module path -> output width of every nn.Linear (sizes untrained members of fused layers)."""
    return {n: m.out_features for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _fused_widths(manifest: dict[str, Any]) -> dict[str, int]:
    """Widths of fused members, read from the denoiser's config.json (no weights loaded)."""
    from stages.core.model_source import ModelError, ModelSource

    layout = LAYOUTS.get(manifest["pipeline_class"], GENERIC)
    if layout.widths is None:
        return {}
    try:
        config = ModelSource(manifest.get("model", ""), manifest.get("revision", "")).component_config(manifest["lora_prefix"])
    except ModelError:
        return {}  # then a partly trained fused layer is refused by name in _fuse
    return layout.widths(config)


def write_kohya(state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], manifest: dict[str, Any], out_dir: Path) -> Path:
    """Write export/lora_kohya.safetensors beside the diffusers file; returns its path."""
    from safetensors.torch import save_file

    pipeline_class = manifest["pipeline_class"]
    tensors, sources = kohya_state(state, lora_cfg, pipeline_class, _fused_widths(manifest))
    metadata = {  # kohya sd-scripts' own header keys (which ComfyUI and kohya tools show), matching the
        # tensors: alpha = rank, the trained alpha/rank already folded into lora_up
        "ss_network_module": "networks.lora", "ss_network_dim": str(lora_cfg.get("r")),
        "ss_network_alpha": str(lora_cfg.get("r")), "lorapipe_trained_alpha": str(lora_cfg.get("lora_alpha")),
        "lorapipe_family": str(manifest.get("family")), "lorapipe_pipeline_class": pipeline_class,
        "lorapipe_modules": str(len(sources)),
    }
    path = out_dir / KOHYA_FILE
    save_file(tensors, str(path), metadata=metadata)
    return path
