"""The image side shared by FLUX.2 [klein] and FLUX.2 [dev]: AutoencoderKLFlux2 latents normalized
with its batch-norm statistics, and Flux2Transformer2DModel over 2x2-patchified tokens with 4-axis ids.

A mixin with the protocol's cache-latents and train methods (`class Flux2Klein(Flux2DiT)`); each
family adds its text encoder. Checked against diffusers 0.42.1 `pipelines/flux2/pipeline_flux2.py`
and `pipeline_flux2_klein.py`, whose helpers used here are the same code:
- `_encode_vae_image` / `__call__`'s decode: the VAE posterior (32 channels) is patchified 2x2
  (`_patchify_latents`: channel c*4 + dy*2 + dx) and normalized with the VAE's batch-norm running
  statistics, `(z - running_mean) / sqrt(running_var + batch_norm_eps)`, per patchified channel.
  The cache keeps the raw posterior; `normalize_latents` applies the same statistics unpatchified.
- `prepare_latents`, `_pack_latents`, `_prepare_latent_ids`: tokens in row-major order of the
  patchified latent with ids (0, row, col, 0), which is `flow.pack_2x2` of the unpatchified one;
  `_prepare_text_ids`: text ids (0, 0, 0, l).
- the transformer gets `timestep = t / 1000` = sigma (it multiplies by 1000). Guidance: a
  `guidance_embeds` transformer (FLUX.2 dev) gets the pipeline's float32 (B,) vector of
  `guidance_scale`; here `train.guidance_scale`. Without the embedding (klein) `guidance=None`, as
  its pipeline. The scheduler steps `x + (sigma_next - sigma) * pred`, so the target is noise - x0.
- sigmas: `compute_empirical_mu(image_seq_len, num_steps)` (one function, copied into both
  pipelines) gives the exponential time shift the pipelines sample with; `train.dynamic_shift`
  trains at that shift for the bucket's token count and the pipelines' default 50 steps.

Reference images (`image=` of both pipelines, optional; an item's control images here):
- `__call__` step 4: a reference over 1024 x 1024 pixels is scaled to that area
  (`Flux2ImageProcessor._resize_to_target_area`), its sides floored to a multiple of
  vae_scale_factor x 2 and center-cropped to them (`preprocess(..., resize_mode="crop")`).
  Training scales each reference to the bucket's area instead (up or down, its own aspect: the
  pipeline's rule with the bucket's area for 1024 x 1024), so one dataset's references share a shape
  per bucket; `sample` hands the pipeline references already at the sample's area, which it then
  floors and crops the same way. A flipped variant flips its references with the target.
- `prepare_image_latents`: each reference is encoded (`argmax`), patchified and batch-norm
  normalized like the target, packed, and the references' tokens concatenated in order;
  `_prepare_image_ids`: reference k has ids (10 + 10 k, row, col, 0).
- the denoiser sees `cat([latents, image_latents], dim=1)` with `cat([latent_ids, image_latent_ids])`
  and the prediction is cut to the target's tokens (`noise_pred[:, : latents.size(1)]`): the loss
  is on the target tokens only. The text encoders never see the references (only the optional
  caption upsampling of Flux2Pipeline does, which training has no use for), so caption rows stay keyed
  by caption alone. Items without references train text-to-image exactly as before; a dataset
  either has references on every item or on none (`dataset.for_family`: a batch stacks them).
"""

from __future__ import annotations

import math
from typing import Any

from stages.core import aspect_buckets, dataset, flow
from stages.core.errors import DatasetError, ModelError
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype, load_denoiser_weights
from stages.families.base import BatchMeta, FamilyTraits
from stages.families.common.patch_bn import PatchBatchNormalized
from stages.families.common.bfl import FLUX2 as COMFYUI_LAYOUT
from stages.families.common.bfl import FLUX2_KOHYA as KOHYA_LAYOUT

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

SHIFT_STEPS = 50  # both pipelines' default num_inference_steps, for the resolution shift
REFERENCE_TIME_SCALE = 10  # _prepare_image_ids' `scale`: reference k has time id 10 + 10 k


def require_text_layers(src: Any, layers: int, wanted: tuple[int, ...], model: str) -> None:
    """A text encoder with fewer layers than the hidden states the pipeline reads is another model's."""
    if layers < max(wanted):
        raise ModelError(f"'{src.ref}' text_encoder/ has {layers} layers, but {model} reads hidden states "
                         f"{wanted}: point 'model' at a {model} pipeline")


def stacked_text_states(model: torch.nn.Module, tokens: Any, layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Both FLUX.2 pipelines' prompt embeds: the chosen layers' hidden states side by side per token,
    (B, L, 3, D) flattened to (B, L, 3 D)."""
    out = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True,
                use_cache=False)
    return {"prompt_embeds": torch.stack([out.hidden_states[k] for k in layers], dim=2).flatten(2)}


class Flux2DiT(PatchBatchNormalized, FamilyTraits):
    lora_prefix = "transformer"
    denoiser_class = "Flux2Transformer2DModel"
    vae_class = "AutoencoderKLFlux2"
    # Image-stream attention of the double blocks and the fused q/k/v/MLP input of the single blocks
    # (FLUX.2's single blocks have no separate to_q/to_k/to_v).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj")
    vae_components = ("vae",)
    denoiser_components = ("transformer",)
    kohya_layout = KOHYA_LAYOUT
    comfyui_layout = COMFYUI_LAYOUT
    # Reference images are optional (0: text-to-image); the pipelines take any number, the folder
    # convention names up to dataset.MAX_CONTROLS.
    control_range = (0, dataset.MAX_CONTROLS)
    text_sees_controls = False
    # The block being recomputed in backward holds ~35 units (tokens x width x 2 bytes), not the default 24:
    # the single blocks' fused q/k/v + SwiGLU projection is 9 units wide. Fitted on the checkpointed train
    # rows of bench/results (klein and dev, nf4/fp8/bf16, 512-1024 px, batch 1-4): at 24 the planner predicted
    # 0.86-0.996x what they allocated (klein bf16 1024 px b4: 12.07 GB for 14.01), at 35 0.937-1.003x
    # (tests/bench/test_bench_report.py; left out: klein's nf4 512 px b1 row, run with fp32 activations before
    # commit e6730df, and dev's with a reference image, whose tokens the plan does not count); klein's whole
    # fp8 base had planned 5.26 GB for the 5.82 the diffusers script's shape allocated, so a budget near it
    # planned more fp8 blocks than fit (bench/LOG.md).
    block_work_units = 35.0

    def __init__(self) -> None:
        self._ids: dict[tuple, torch.Tensor] = {}  # image and text ids and the guidance vector, per shape
        self._reference_multiple = 0  # the pipelines' vae_scale_factor x 2, known once the VAE loads

    # ---- cache-latents
    def load_vae(self, src: Any, rt: Any) -> torch.nn.Module:
        from diffusers import AutoencoderKLFlux2

        self._reference_multiple = self.pixel_multiple(src)
        return src.load(AutoencoderKLFlux2, "vae", torch_dtype=rt.dtype).to(rt.device).eval()

    def pixel_multiple(self, src: Any) -> int:
        blocks = src.component_config("vae")["block_out_channels"]
        return 2 ** (len(blocks) - 1) * 2  # the pipelines' vae_scale_factor x the 2x2 patches

    @no_grad
    def encode_posterior(self, vae: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return dist.mean, dist.logvar  # logvar already clamped to [-30, 20] by DiagonalGaussianDistribution

    def control_images(self, control: Any, size: tuple[int, int], variants: list[aspect_buckets.Variant],
                       bucket: tuple[int, int]) -> list[Any]:
        """A reference as the pipelines prepare it, at the bucket's area: scaled to that area at its
        own aspect, sides floored to the pipelines' multiple and center-cropped to them (their own
        `Flux2ImageProcessor` calls); flipped with flipped variants, never cropped with the target."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
        from PIL import Image

        m = self._reference_multiple
        if not m:
            raise RuntimeError("control_images needs the VAE loaded first (load_vae sets the pipelines' multiple)")
        im = Flux2ImageProcessor._resize_to_target_area(control, bucket[0] * bucket[1])
        w, h = im.width // m * m, im.height // m * m
        if not (w and h):
            raise DatasetError(f"a reference image of {control.width} x {control.height} pixels is too narrow for "
                               f"{bucket[0]} x {bucket[1]} training: at that area a side is under {m} pixels; crop it "
                               f"nearer to the target's aspect")
        im = Flux2ImageProcessor(vae_scale_factor=m).resize(im, h, w, resize_mode="crop")
        return [im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if v.flip else im for v in variants]


    # ---- sample
    def sample_image_kwargs(self, controls: list[Any], size: tuple[int, int]) -> dict[str, Any]:
        """The references at the sample's area, as training scaled them to the bucket's (the pipeline
        floors and crops them itself); none for a text-to-image run."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        if not controls:
            return {}
        return {"image": [Flux2ImageProcessor._resize_to_target_area(c.convert("RGB"), size[0] * size[1])
                          for c in controls]}

    # ---- train
    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> torch.nn.Module:
        from diffusers import Flux2Transformer2DModel

        return load_denoiser_weights(Flux2Transformer2DModel, src, "transformer", precision, rt, tcfg.nf4_double_quant)

    def sample_timesteps(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator, tcfg: Any,
                         first: int | None = None) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        u = flow.draw_u(n, generator, tcfg, first)
        shift = tcfg.shift
        if tcfg.dynamic_shift:  # the scheduler's exponential time shift is a static shift by exp(mu)
            seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
            shift = math.exp(compute_empirical_mu(seq_len, SHIFT_STEPS))
        return flow.lookup_sigmas(u, flow.sigma_table(shift))

    def position_ids(self, kind: str, n: int, m: int, device: torch.device) -> torch.Tensor:
        """(n*m, 4) ids (t, h, w, l), built once per shape: image (0, row, col, 0) over n x m tokens
        (`_prepare_latent_ids`), text (0, 0, 0, l) over m tokens with n = 1 (`_prepare_text_ids`)."""
        key = (kind, n, m, device)
        if key not in self._ids:
            rows, cols = torch.meshgrid(torch.arange(n), torch.arange(m), indexing="ij")
            zero = torch.zeros_like(rows)
            axes = [zero, rows, cols, zero] if kind == "image" else [zero, zero, zero, cols]
            self._ids[key] = torch.stack(axes, dim=-1).reshape(-1, 4).to(device)
        return self._ids[key]

    def reference_ids(self, shapes: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
        """The references' ids (10 + 10 k, row, col, 0) over each one's (h, w) tokens, concatenated:
        `_prepare_image_ids`."""
        key = ("references", tuple(shapes), device)
        if key not in self._ids:
            parts = []
            for k, (n, m) in enumerate(shapes):
                ids = self.position_ids("image", n, m, device).clone()
                ids[:, 0] = REFERENCE_TIME_SCALE * (k + 1)
                parts.append(ids)
            self._ids[key] = torch.cat(parts)
        return self._ids[key]

    def guidance(self, denoiser: torch.nn.Module, b: int, tcfg: Any, device: torch.device) -> torch.Tensor | None:
        """The pipelines' `torch.full([1], guidance_scale, dtype=float32).expand(B)`, with
        train.guidance_scale; None for a transformer without the guidance embedding."""
        if not denoiser.config.guidance_embeds:
            return None
        key = ("guidance", b, tcfg.guidance_scale, device)
        if key not in self._ids:
            self._ids[key] = torch.full((b,), tcfg.guidance_scale, device=device, dtype=torch.float32)
        return self._ids[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        b, _, h, w = x0.shape
        dtype, device = base_dtype(denoiser), x0.device
        text = cond["prompt_embeds"].to(device, dtype)
        target = flow.pack_2x2(flow.noisy_latents(x0, noise, t))
        tokens, ids = target, self.position_ids("image", h // 2, w // 2, device)
        if meta.controls:  # the references' tokens follow the target's
            tokens = torch.cat([target, *(flow.pack_2x2(c.to(device, target.dtype)) for c in meta.controls)], dim=1)
            shapes = [(c.shape[-2] // 2, c.shape[-1] // 2) for c in meta.controls]
            ids = torch.cat([ids, self.reference_ids(shapes, device)])
        pred = denoiser(
            hidden_states=tokens.to(dtype),
            encoder_hidden_states=text,
            timestep=t.to(device, dtype),  # the pipelines pass t / 1000 = sigma
            img_ids=ids,
            txt_ids=self.position_ids("text", 1, text.shape[1], device),
            guidance=self.guidance(denoiser, b, tcfg, device),
            return_dict=False,
        )[0][:, : target.shape[1]]  # the prediction of the target's tokens (all of them without references)
        return flow.per_sample_loss(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
