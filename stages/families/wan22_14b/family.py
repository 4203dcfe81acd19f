"""Wan 2.2 T2V-A14B (Wan-AI/Wan2.2-T2V-A14B-Diffusers), text-to-video with two experts: the Wan family of
`stages.families.common.wan` with the Wan 2.1 VAE (16 channels, 8 px and 4 frames a latent cell), one timestep
per sample, and a mixture of two 14B transformers that WanPipeline switches between by timestep.

Checked against diffusers 0.42.1 `WanPipeline.__call__`: with `boundary_ratio` set (0.875 in the release's
model_index.json), a step whose scheduler timestep t (sigma x 1000) is >= boundary_ratio x num_train_timesteps
runs `transformer` (the high-noise expert), every later step `transformer_2` (the low-noise expert), each with
its own guidance scale. Each adapter trains one expert (train.expert), on that expert's sigmas only: sigma >= 0.875
for "high", below for "low"; "both" trains the high one's adapter and then the low one's in one `train`, each as a
run of that expert alone would (stages/core/caches.py `expert_configs`), one 14B expert in memory at a time.

Export: the diffusers file has the `transformer.` keys WanPipeline writes for either expert;
`load_lora_weights(..., load_into_transformer_2=True)` puts it on the low-noise one (WanLoraLoaderMixin),
which `sample` does through `lora_load_kwargs`. ComfyUI loads each expert as its own model, so the ComfyUI file
is named for its expert (`<run>_high_noise_comfyui.safetensors`, `..._low_noise_...`), and so is the kohya copy
(`lora_high_noise_kohya.safetensors`, `lora_low_noise_kohya.safetensors`)."""

from __future__ import annotations

from typing import Any

from stages.core import flow
from stages.core.errors import ConfigError, ModelError
from stages.core.lazy import lazy_module
from stages.core.lora import load_denoiser_weights
from stages.families.common.wan import WanBase
from stages.families.wan22_14b import BOUNDARY_RATIO, EXPERTS

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

COMPONENT = {"high": "transformer", "low": "transformer_2"}
TAG = {"high": "high_noise", "low": "low_noise"}


def expert_of(tcfg: Any) -> str:
    """train.expert of one adapter's config ("high" or "low"; a "both" run hands each expert's config,
    stages/core/caches.py `expert_configs`); a ConfigError naming the key otherwise."""
    if tcfg.expert not in COMPONENT:
        raise ConfigError(f"train.expert = '{tcfg.expert}': set 'high', 'low' or 'both' to pick the Wan 2.2 A14B "
                          f"experts this run trains")
    return tcfg.expert


def expert_indices(table: torch.Tensor, expert: str) -> tuple[int, int]:
    """(first index, count) of the sigma table's rows (highest sigma first) on the expert's side of the boundary:
    sigma >= BOUNDARY_RATIO for "high" (the pipeline's t >= 875), the rest for "low"."""
    high = int((table >= BOUNDARY_RATIO).sum())
    return (0, high) if expert == "high" else (high, len(table) - high)


class Wan22_14B(WanBase):
    name = "wan2.2-14b"
    title = "Wan 2.2 T2V-A14B"
    expand_timesteps = False  # the release's model_index.json: one timestep per sample
    denoiser_components = ("transformer", "transformer_2")  # train loads one at a time; the pipeline (sample) both
    experts = EXPERTS
    frame_rate = 16.0  # Wan 2.2's wan/configs/shared_config.py: sample_fps = 16 (WanPipeline's example exports at 16)
    pixels_per_token = 16  # the Wan 2.1 VAE's 8 px a latent cell, then the transformer's 2x2 patches
    vae_downsample = 8

    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        ratio = src.component_config("", "model_index.json").get("boundary_ratio") if not src.is_single_file else None
        if ratio is not None and abs(float(ratio) - BOUNDARY_RATIO) > 1e-6:
            raise ModelError(f"model '{src.ref}' switches experts at boundary_ratio {ratio}, family = '{self.name}' "
                             f"trains Wan 2.2 T2V-A14B's {BOUNDARY_RATIO}: point 'model' at a Wan2.2-T2V-A14B folder")
        return load_denoiser_weights(WanTransformer3DModel, src, self.trained_component(tcfg), precision, rt,
                                     tcfg.nf4_double_quant)

    def trained_component(self, tcfg: Any) -> str:
        return COMPONENT[expert_of(tcfg)]

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        """Sigmas through the scheduler's flow_shift (train.shift), drawn only on the trained expert's side of
        the boundary: the density's u spread over those rows of the sigma table, its shape kept."""
        table = flow.sigma_table(tcfg.shift)
        start, count = expert_indices(table, expert_of(tcfg))
        u = flow.draw_u(n, generator, tcfg, first)
        return table[(start + (u * count).long()).clamp_(start, start + count - 1)]

    def lora_load_kwargs(self, tcfg: Any) -> dict[str, Any]:
        return {"load_into_transformer_2": True} if expert_of(tcfg) == "low" else {}

    def file_tag(self, tcfg: Any) -> str:
        return TAG[expert_of(tcfg)]
