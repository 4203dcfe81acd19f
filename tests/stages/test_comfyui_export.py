"""The ComfyUI-ready file (stages.core.comfyui_file) and its check in ComfyUI's terms (stages.core.comfyui).

For every family's tiny model and every adapter (LoRA, DoRA, LoKr, LoHa), with alpha != rank and rank and
alpha patterns: peft's own merge gives the ground truth (merged weight minus base weight per module);
the trained deltas the export is checked against must equal it, and the ComfyUI file, read through the
key map as ComfyUI's loader reads it, must give every module its trained delta at strength 1 +- 1 %.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FAMILIES, tiny_model

from stages.core import comfyui  # noqa: E402
from stages.core.comfyui_file import TrainedDeltas, base_reader, comfyui_state  # noqa: E402
from stages.core.lora import lora_config  # noqa: E402
from stages.families import get_family  # noqa: E402

RANK, ALPHA = 4, 6.0
# per family: layers trained beside the default targets, to reach every kind of name ComfyUI has
# (fused members, swapped halves, layers only ComfyUI's own names reach, convs)
EXTRA = {
    "flux": ("single_transformer_blocks.0.proj_mlp", "norm_out.linear", "transformer_blocks.0.norm1.linear",
             "time_text_embed.timestep_embedder.linear_1"),
    "flux2-klein": ("norm_out.linear", "double_stream_modulation_img.linear",
                    "time_guidance_embed.timestep_embedder.linear_1", "transformer_blocks.0.attn.add_k_proj"),
    "qwen-image": ("img_in", "transformer_blocks.0.img_mlp.net.2"),
    "qwen-image-2.1": ("transformer_blocks.0.img_mlp.gate_layer", "transformer_blocks.0.img_mlp.proj", "modulation.1"),
    "z-image": ("layers.0.feed_forward.w1", "all_final_layer.2-1.linear", "noise_refiner.0.attention.to_q"),
    "krea2": ("text_fusion.layerwise_blocks.0.attn.to_q", "img_in", "final_layer.linear"),
    "sdxl": ("add_embedding.linear_1", "down_blocks.1.resnets.0.time_emb_proj", "down_blocks.1.resnets.0.conv1"),
    "chroma": ("single_transformer_blocks.0.proj_mlp", "x_embedder", "distilled_guidance_layer.in_proj",
               "distilled_guidance_layer.layers.0.linear_2"),
    "ernie-image": ("layers.0.mlp.gate_proj", "x_embedder.proj", "text_proj", "adaLN_modulation.1", "final_norm.linear"),
    "hidream-i1": ("double_stream_blocks.0.block.ff_i.experts.0.w1", "double_stream_blocks.0.block.ff_t.w2",
                   "caption_projection.0.linear", "final_layer.adaLN_modulation.1"),
    "ideogram4": ("layers.0.adaln_modulation", "input_proj", "llm_cond_proj", "final_layer.linear"),
    "wan2.2-5b": ("condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1", "proj_out"),
    "wan2.2-14b": ("condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1", "proj_out"),
    "ltx2": ("proj_in", "time_embed.linear", "av_cross_attn_video_a2v_gate.linear",
             "transformer_blocks.0.audio_to_video_attn.to_q", "proj_out"),
}
EXTRA["flux-kontext"], EXTRA["flux2"], EXTRA["qwen-image-edit"] = EXTRA["flux"], EXTRA["flux2-klein"], EXTRA["qwen-image"]
EXTRA["qwen-image-edit-2511"] = EXTRA["qwen-image"]
ADAPTERS = ("lora", "dora", "lokr", "loha")


def _denoiser(folder, family):
    import diffusers

    fam = get_family(family)
    config = json.loads((folder / fam.lora_prefix / "config.json").read_text())
    model = getattr(diffusers, config["_class_name"]).from_pretrained(str(folder), subfolder=fam.lora_prefix)
    return model.float().eval(), config


def _targets(model, family: str, adapter: str) -> list[str]:
    """The family's default targets and its extras, as exact module paths (convs for LoRA and DoRA only:
    peft's LoKr and LoHa make conv factors that have no LyCORIS form here)."""
    suffixes = get_family(family).default_lora_targets
    names = [n for n, m in model.named_modules() if (isinstance(m, torch.nn.Linear) and any(
             n == s or n.endswith("." + s) for s in suffixes)) or n in EXTRA.get(family, ())]
    assert set(EXTRA.get(family, ())) <= set(names), set(EXTRA[family]) - set(names)
    convs = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)}
    return [n for n in names if adapter in ("lora", "dora") or n not in convs]


def trained(family: str, adapter: str, folder):
    """(adapter state dict, adapter config, base weights, peft's merged deltas) of a random adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict

    from stages.core.lora import config_dict

    model, config = _denoiser(folder, family)
    targets = _targets(model, family, adapter)
    patterns = {"rank_pattern": {targets[0]: 2}, "alpha_pattern": {targets[-1]: 3.0}}
    cfg = lora_config(RANK, ALPHA, 0.0, targets, adapter, **patterns)
    base = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in targets}
    model.add_adapter(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(p + torch.randn(p.shape, generator=g) * 0.1 if "magnitude" in name else torch.randn(p.shape, generator=g) * 0.1)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    merged = {n: m.get_base_layer().weight.detach() - base[n] for n, m in model.named_modules()
              if isinstance(m, BaseTunerLayer) and n in base}
    return state, config_dict(cfg), base, merged, config


def shapes_of(folder, family):
    from stages.core.verify import denoiser_skeleton
    from stages.core.model_source import ModelSource

    skeleton = denoiser_skeleton(ModelSource(str(folder)), get_family(family).lora_prefix)
    return {n: tuple(m.weight.shape) for n, m in skeleton.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_comfyui_file_applies_the_trained_delta(assets, family, adapter, tmp_path):
    folder = tiny_model(assets, FAMILIES[family])
    state, lora_cfg, base, merged, config = trained(family, adapter, folder)
    deltas = TrainedDeltas(state, lora_cfg, base=base.__getitem__)
    for module, truth in merged.items():  # the reference is peft's own merge
        torch.testing.assert_close(deltas[module].float(), truth.float(), rtol=1e-4, atol=1e-5, msg=module)
    layout = get_family(family).comfyui_layout
    tensors = comfyui_state(deltas, layout, config)
    kmap = comfyui.key_map(layout, shapes_of(folder, family), config)
    report = comfyui.check("file", tensors, kmap, merged, base=base.__getitem__)
    assert report.problems() == [], report.problems()
    assert sorted(report.strength) == sorted(merged)
    assert all(abs(r - 1) < 1e-3 and e < 1e-3 for r, e in report.strength.values()), report.strength
    if adapter in ("lora", "dora"):  # every entry carries its alpha (a fused weight's members share one entry)
        entries = {k.removesuffix(".lora_up.weight") for k in tensors if k.endswith(".lora_up.weight")}
        assert {k.removesuffix(".alpha") for k in tensors if k.endswith(".alpha")} == entries
        assert sum(len(kmap[e].modules) for e in entries) == len(merged)
        diffusers_file_keeps_the_deltas(family, folder, state, lora_cfg, tmp_path)


def diffusers_file_keeps_the_deltas(family, folder, state, lora_cfg, tmp_path):
    """The diffusers file, its scale folded into lora_B, read by the pipeline's own loader: the trained
    LoRA deltas (DoRA: its low-rank part; the magnitude is loaded as it is)."""
    import diffusers

    from stages.core import verify
    from stages.core.model_source import ModelSource
    from stages.export_lora import scale_folded, write_diffusers

    fam = get_family(family)
    manifest = {"pipeline_class": fam.pipeline_class, "lora_prefix": fam.lora_prefix}
    file = write_diffusers(*scale_folded(state, lora_cfg), manifest, tmp_path)
    skeleton = verify.denoiser_skeleton(ModelSource(str(folder)), fam.lora_prefix)
    weights = verify.load_into(skeleton, getattr(diffusers, fam.pipeline_class), file, fam.lora_prefix, "check")
    loaded = verify.delta_weights(skeleton, "check", weights)
    want = TrainedDeltas({k: v for k, v in state.items() if "magnitude" not in k}, lora_cfg)
    assert sorted(loaded) == sorted(want)
    for module in want:
        torch.testing.assert_close(loaded[module].float(), want[module].float(), rtol=1e-5, atol=1e-6, msg=module)


@pytest.mark.parametrize("family", ["flux", "z-image", "sdxl"])
def test_check_sees_what_comfyui_would_drop_or_misapply(assets, family):
    """Keys outside the key map do not load; a file without alpha tensors applies rank/alpha of the
    strength; a delta of the wrong shape is named."""
    folder = tiny_model(assets, FAMILIES[family])
    state, lora_cfg, base, merged, config = trained(family, "lora", folder)
    layout = get_family(family).comfyui_layout
    tensors = comfyui_state(TrainedDeltas(state, lora_cfg), layout, config)
    kmap = comfyui.key_map(layout, shapes_of(folder, family), config)

    renamed = {k.replace("transformer.", "lora_unet_foo_", 1) if k.startswith("transformer.")
               else "x" + k: v for k, v in tensors.items()}
    report = comfyui.check("renamed", renamed, kmap, merged)
    assert len(report.not_loaded) == len(renamed) and len(report.missing) == len(merged)

    no_alpha = {k: v for k, v in tensors.items() if not k.endswith(".alpha")}
    report = comfyui.check("no-alpha", no_alpha, kmap, merged)
    module = next(m for m in merged if m.endswith("to_v"))  # rank 4, alpha 6: loads at 4/6 of its strength
    assert report.strength[module][0] == pytest.approx(RANK / ALPHA, rel=1e-4)
    assert any("off their trained strength" in p for p in report.problems())

    key = next(k for k in tensors if k.endswith("lora_up.weight"))
    bad = dict(tensors, **{key: tensors[key][:-1]})
    assert any("shape" in p for p in comfyui.check("bad", bad, kmap, merged).problems())


def test_key_map_speaks_comfyuis_names(assets):
    """Spot checks against ComfyUI's own tables: FLUX's q/k/v land on rows of double_blocks.N.img_attn.qkv,
    the final adaLN is swapped, Z-Image's q on attention.qkv, SDXL's UNet paths on Stability's numbering."""
    flux = tiny_model(assets, FAMILIES["flux"])
    config = json.loads((flux / "transformer" / "config.json").read_text())
    kmap = comfyui.key_map(get_family("flux").comfyui_layout, shapes_of(flux, "flux"), config)
    k = kmap["transformer.transformer_blocks.0.attn.to_k"]
    assert k.weight == "double_blocks.0.img_attn.qkv" and k.modules == ("transformer_blocks.0.attn.to_k",)
    whole = kmap["lora_unet_double_blocks_0_img_attn_qkv"]
    assert whole.modules == tuple(f"transformer_blocks.0.attn.to_{p}" for p in "qkv") and whole.shape[0] == 3 * k.shape[0]
    assert kmap["lycoris_norm_out_linear"].swaps_delta and kmap["diffusion_model.final_layer.adaLN_modulation.1"].swapped
    assert "lora_unet_transformer_blocks_0_attn_to_k" not in kmap

    sdxl = tiny_model(assets, FAMILIES["sdxl"])
    config = json.loads((sdxl / "unet" / "config.json").read_text())
    kmap = comfyui.key_map(get_family("sdxl").comfyui_layout, shapes_of(sdxl, "sdxl"), config)
    per = config["layers_per_block"]  # SDXL's 2: down block 1's first attention is input_blocks.4.1
    assert kmap["lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"].weight \
        == f"input_blocks.{1 + (per + 1)}.1.transformer_blocks.0.attn1.to_q"
    assert kmap["lora_unet_up_blocks_0_attentions_1_proj_in"].weight == "output_blocks.1.1.proj_in"
    assert kmap["lora_unet_label_emb_0_0"].modules == ("add_embedding.linear_1",)
    assert "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q" not in kmap  # diffusers' own keys


def test_base_reader_reads_one_weight(assets):
    folder = tiny_model(assets, FAMILIES["flux"])
    read = base_reader(sorted((folder / "transformer").glob("*.safetensors")))
    model, _ = _denoiser(folder, "flux")
    torch.testing.assert_close(read("proj_out"), model.proj_out.weight.detach())
