"""A kohya/ComfyUI-keyed copy of a trained LoRA: `lora_unet_<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`.

    lorapipe export-lora --config configs/flux-dev.toml --format kohya

Names come from the denoiser's diffusers module paths with dots turned into underscores
(`transformer_blocks.0.attn.to_q` -> `lora_unet_transformer_blocks_0_attn_to_q`: `GENERIC`), which is
what ComfyUI and diffusers' own kohya converters read for Qwen-Image and Z-Image. A family with other
names gives its own `Layout` as `family.kohya_layout` (SDXL: two renames; FLUX.1: Black Forest Labs'
names, where q, k and v are one fused linear, written here as one block-diagonal LoRA: down rows
stacked, up blocks on the diagonal, exactly the separate LoRAs summed). This module is the writer;
the names live with each family (`stages/families/<family>/kohya.py`).

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

from stages.core.errors import UserError
from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch

KOHYA_FILE = "lora_kohya.safetensors"
PREFIX = "lora_unet_"


def kohya_file_name(tag: str = "", lycoris: bool = False) -> str:
    """`lora_kohya.safetensors` (LoKr, LoHa: `lora_lycoris.safetensors`); a family's `file_tag` goes before the
    format, as in the ComfyUI file's name (`lora_high_noise_kohya.safetensors`), so that the two Wan 2.2 A14B
    experts' files stay apart once copied into one folder."""
    name = LYCORIS_FILE if lycoris else KOHYA_FILE
    return name.replace("lora_", f"lora_{tag}_", 1) if tag else name


def is_kohya_file(name: str) -> bool:
    """Whether an export file is the kohya or LyCORIS copy, by its name (with or without a family's tag)."""
    return name.startswith("lora_") and name.endswith(("_kohya.safetensors", "_lycoris.safetensors"))


class KohyaError(UserError, ValueError):
    """The adapter cannot be written in kohya format; the message says why and what to change."""


def diffusers_paths(module: str) -> tuple[str, int, int]:
    """Generic naming: (kohya name, member index, member count) = the diffusers path, never fused."""
    return module.replace(".", "_"), 0, 1


@dataclass(frozen=True)
class Layout:
    name: Callable[[str], tuple[str, int, int]]
    """diffusers module path -> (kohya module name, member index, member count)."""
    widths: Callable[[dict[str, Any]], dict[str, int]] | None = None
    """denoiser config -> output widths of fused members (None: the layout fuses nothing)."""
    swap_halves: frozenset[str] = frozenset()
    """kohya names whose lora_up rows are written in the other order (e.g. BFL's (shift, scale))."""


GENERIC = Layout(diffusers_paths)
"""Every family without its own layout: kohya names are the diffusers module paths."""


def pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """A module's value from a peft rank_pattern/alpha_pattern, matched as peft matches it when it
    builds the layer (`peft.utils.other.get_pattern_key`: the first pattern that ends the module's
    dotted path), else `default`."""
    from peft.utils.other import get_pattern_key

    if not patterns:
        return default
    return patterns.get(get_pattern_key(list(patterns), module), default)


def lora_scale(lora_cfg: dict[str, Any], module: str, rank: int) -> float:
    """The factor peft multiplies B @ A by for this module."""
    alpha = pattern_value(lora_cfg.get("alpha_pattern"), module, lora_cfg.get("lora_alpha", rank))
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
        raise KohyaError(f"'{name}' fuses modules with ranks {sorted(ranks)}; a kohya file needs one rank per fused "
                         f"layer: give them one rank (train.rank_pattern; `lora resize --rank R`) or write the "
                         f"diffusers or ComfyUI file")
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


def kohya_state(state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], layout: Layout,
                out_dims: dict[str, int] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """(kohya tensors, kohya key -> the diffusers modules it holds). `out_dims` (module path -> output
    width) sizes the zero blocks of fused members that were not trained."""
    if lora_cfg.get("use_dora"):
        raise KohyaError("DoRA adapters are not written in kohya format here: export with --format diffusers")
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, str]]] = {}
    counts: dict[str, int] = {}
    for module, (a, b) in split_modules(state).items():
        name, index, count = layout.name(module)
        b = b.float() * lora_scale(lora_cfg, module, a.shape[0])
        groups.setdefault(name, {})[index] = (a.float(), b, module)
        counts[name] = count
    widths = _widths_by_member(out_dims or {}, layout.name, set(groups))
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, list[str]] = {}
    for name, members in sorted(groups.items()):
        if counts[name] == 1:
            down, up = members[0][0], members[0][1]
        else:
            down, up = _fuse(members, counts[name], name, widths.get(name, {}))
        if name in layout.swap_halves:
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


def _fused_widths(layout: Layout, src: Any, denoiser: str) -> dict[str, int]:
    """Widths of fused members, read from the denoiser's config.json (no weights loaded)."""
    from stages.core.model_source import ModelError

    if layout.widths is None:
        return {}
    try:
        config = src.component_config(denoiser)
    except ModelError:
        return {}  # then a partly trained fused layer is refused by name in _fuse
    return layout.widths(config)


def write_kohya(state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], manifest: dict[str, Any], out_dir: Path,
                layout: Layout, src: Any, tag: str = "") -> Path:
    """Write export/lora_kohya.safetensors beside the diffusers file (`tag`: the family's file tag, in its name);
    returns its path. `layout` is the family's (`family.kohya_layout`), `src` the ModelSource of the base model
    (model + revision of the config), whose denoiser config.json sizes untrained members of fused layers."""
    from safetensors.torch import save_file

    tensors, sources = kohya_state(state, lora_cfg, layout, _fused_widths(layout, src, manifest["lora_prefix"]))
    path = out_dir / kohya_file_name(tag)
    save_file(tensors, str(path), metadata=kohya_metadata(lora_cfg, manifest, len(sources)))
    return path


def kohya_metadata(lora_cfg: dict[str, Any], manifest: dict[str, Any], modules: int) -> dict[str, str]:
    """kohya sd-scripts' own header keys (which ComfyUI and kohya tools show), matching the tensors: alpha =
    rank, the trained alpha/rank already folded into lora_up; and the family the file was made for."""
    return {"ss_network_module": "networks.lora", "ss_network_dim": str(lora_cfg.get("r")),
            "ss_network_alpha": str(lora_cfg.get("r")), "lorapipe_trained_alpha": str(lora_cfg.get("lora_alpha")),
            "lorapipe_family": str(manifest.get("family")), "lorapipe_pipeline_class": manifest["pipeline_class"],
            "lorapipe_modules": str(modules)}


# ---- LyCORIS (LoKr, LoHa): the layout ComfyUI loads; diffusers' loader reads neither ------------

LYCORIS_FILE = "lora_lycoris.safetensors"
LOKR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def split_lycoris(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft LoKr/LoHa state dict -> module path -> {lokr_w1: ..., ...} (peft names them as LyCORIS does)."""
    names = "|".join(LOKR_KEYS + LOHA_KEYS)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = re.fullmatch(rf"(.+)\.({names})", key)
        if m is None or tensor.dim() != 2:
            raise KohyaError(f"adapter key '{key}' ({tuple(tensor.shape)}) is not a linear LoKr/LoHa weight; conv "
                             f"(Tucker) factors have no LyCORIS form here: target linear modules only")
        modules.setdefault(m.group(1), {})[m.group(2)] = tensor.float()
    return dict(sorted(modules.items()))


def _factor(parts: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, int | None]:
    """A LoKr factor, full or as a @ b; and its rank when decomposed (ComfyUI's `dim`)."""
    if name in parts:
        return parts[name], None
    return parts[f"{name}_a"] @ parts[f"{name}_b"], parts[f"{name}_b"].shape[0]


def lycoris_delta(parts: dict[str, torch.Tensor], alpha: float | None) -> torch.Tensor:
    """The weight delta a LyCORIS reader builds (ComfyUI weight_adapter lokr.py/loha.py): LoKr
    kron(w1, w2) * alpha / dim (dim: the rank of a decomposed factor; 1 when both are full),
    LoHa (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rank."""
    if "hada_w1_a" in parts:
        rank = parts["hada_w1_b"].shape[0]
        product = (parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"])
        return product * (alpha / rank if alpha is not None else 1.0)
    w1, dim1 = _factor(parts, "lokr_w1")
    w2, dim2 = _factor(parts, "lokr_w2")
    dim = dim2 if dim2 is not None else dim1
    return torch.kron(w1, w2) * (alpha / dim if alpha is not None and dim is not None else 1.0)


def lycoris_scale(lora_cfg: dict[str, Any], module: str) -> float:
    """alpha / r as peft's LoKr and LoHa layers apply it, with the module's rank and alpha patterns."""
    rank = pattern_value(lora_cfg.get("rank_pattern"), module, lora_cfg.get("r"))
    return pattern_value(lora_cfg.get("alpha_pattern"), module, lora_cfg.get("alpha", lora_cfg.get("r"))) / rank


def folded_factors(parts: dict[str, torch.Tensor], scale: float) -> tuple[dict[str, torch.Tensor], float | None]:
    """The factors with peft's scale folded into the first one, and the alpha that makes every reader
    apply scale 1 (alpha = dim; None where the reader ignores alpha: LoKr with both factors full)."""
    out = dict(parts)
    first = "hada_w1_b" if "hada_w1_b" in out else ("lokr_w1" if "lokr_w1" in out else "lokr_w1_b")
    out[first] = out[first] * scale
    if "hada_w1_b" in out:
        return out, float(out["hada_w1_b"].shape[0])
    dim = next((out[k].shape[0] for k in ("lokr_w2_b", "lokr_w1_b") if k in out), None)
    return out, None if dim is None else float(dim)


def lycoris_state(state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], layout: Layout,
                  out_dims: dict[str, int] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """(LyCORIS tensors, key -> the diffusers modules it holds). A module of its own keeps its factors
    (`<name>.lokr_w1`, `.hada_w1_a`, ... and `.alpha`); the members of a fused layer (FLUX's qkv) have no
    factored sum, so that layer is written as its full delta `<name>.diff` (rows of each member stacked,
    untrained members zero), which ComfyUI adds as it is."""
    groups: dict[str, dict[int, tuple[dict[str, torch.Tensor], str]]] = {}
    counts: dict[str, int] = {}
    for module, parts in split_lycoris(state).items():
        name, index, count = layout.name(module)
        groups.setdefault(name, {})[index] = (parts, module)
        counts[name] = count
    widths = _widths_by_member(out_dims or {}, layout.name, set(groups))
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, list[str]] = {}
    for name, members in sorted(groups.items()):
        key = PREFIX + name
        sources[key] = [members[i][1] for i in sorted(members)]
        if counts[name] == 1 and name not in layout.swap_halves:
            parts, module = members[0]
            folded, alpha = folded_factors(parts, lycoris_scale(lora_cfg, module))
            out.update({f"{key}.{k}": v.contiguous() for k, v in folded.items()})
            if alpha is not None:
                out[f"{key}.alpha"] = torch.tensor(alpha)
            continue
        deltas = {i: lycoris_delta(*folded_factors(p, lycoris_scale(lora_cfg, m))) for i, (p, m) in members.items()}
        rows = []
        for i in range(counts[name]):
            if i not in deltas and i not in widths.get(name, {}):
                raise KohyaError(f"'{name}': cannot size the missing member {i}; train all of its parts or none")
            first = next(iter(deltas.values()))
            rows.append(deltas[i] if i in deltas else first.new_zeros(widths[name][i], first.shape[1]))
        diff = torch.cat(rows, dim=0)
        if name in layout.swap_halves:
            diff = torch.cat(diff.chunk(2, dim=0)[::-1], dim=0)
        out[f"{key}.diff"] = diff.contiguous()
    return out, sources


def write_lycoris(state: dict[str, torch.Tensor], lora_cfg: dict[str, Any], manifest: dict[str, Any], out_dir: Path,
                  layout: Layout, src: Any, tag: str = "") -> Path:
    """Write export/lora_lycoris.safetensors (LoKr/LoHa in LyCORIS keys, kohya module names; `tag` as write_kohya's)."""
    from safetensors.torch import save_file

    kind = str(lora_cfg.get("peft_type", "")).lower()
    tensors, sources = lycoris_state(state, lora_cfg, layout, _fused_widths(layout, src, manifest["lora_prefix"]))
    metadata = {"ss_network_module": "lycoris.kohya", "ss_network_args": f'{{"algo": "{kind}"}}',
                "ss_network_dim": str(lora_cfg.get("r")), "ss_network_alpha": str(lora_cfg.get("r")),
                "lorapipe_trained_alpha": str(lora_cfg.get("alpha")), "lorapipe_family": str(manifest.get("family")),
                "lorapipe_pipeline_class": manifest["pipeline_class"], "lorapipe_modules": str(len(sources))}
    path = out_dir / kohya_file_name(tag, lycoris=True)
    save_file(tensors, str(path), metadata=metadata)
    return path
