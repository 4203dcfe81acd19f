"""FLUX.1 Kontext: FLUX.1-dev's conditioning and transformer, with the control image's latent tokens
appended to the target's.

Checked against diffusers 0.42.1 `pipelines/flux/pipeline_flux_kontext.py`:
- `encode_prompt`: FluxPipeline's (CLIP pooled + T5), so captions are cached as for `flux`.
- `prepare_latents`: the control image is VAE-encoded with `sample_mode="argmax"` and normalized
  `(z - shift_factor) * scaling_factor` like the target; both are packed 2x2 (`_pack_latents`); the
  control's ids are `_prepare_latent_image_ids` with id[0] = 1 (the target's have 0).
- `__call__`: `hidden_states = cat([latents, image_latents], dim=1)`, `img_ids = cat([latent_ids,
  image_ids], dim=0)`, timestep t / 1000 = sigma, guidance for dev; the prediction is
  `noise_pred[:, :latents.size(1)]`: the loss is taken on the target tokens only.

Control geometry: the pipeline resizes the control to the output size's aspect (`_auto_resize`
picks a preferred Kontext resolution, which training has no use for), so here the control is resized
to the target's size and cut with the target's own crop and flip: the two stay pixel-aligned, and
control and target latents have one shape per bucket. Training draws a fresh sample of the control's
cached posterior each step, like the target's.
"""

from __future__ import annotations

from typing import Any

from stages.core import aspect_buckets, flow, image_io
from stages.core.lazy import lazy_module
from stages.core.lora import base_dtype
from stages.families.base import BatchMeta
from stages.families.common.flux1 import Flux1

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch


class FluxKontext(Flux1):
    name = "flux-kontext"
    title = "FLUX.1 Kontext (edit, 1 control)"
    # fp8_faster_from_tokens: FLUX.1's, the same transformer (the control's tokens only lengthen the sequence:
    # the same Linears on more rows, where fp8 gained more, bench/fp8.md); no fp8 rows of its own yet
    pipeline_class = "FluxKontextPipeline"
    control_range = (1, 1)  # FluxKontextPipeline takes one image
    text_sees_controls = False

    # ---- cache-latents
    def control_images(self, control: Any, size: tuple[int, int], variants: list[aspect_buckets.Variant],
                       bucket: tuple[int, int]) -> list[Any]:
        """The control resized to the target's (width, height), then each variant's crop and flip."""
        from PIL import Image

        im = control if control.size == tuple(size) else control.resize(tuple(size), Image.Resampling.LANCZOS)
        return [image_io.render_variant(im, v, bucket) for v in variants]

    # ---- sample
    def sample_image_kwargs(self, controls: list[Any], size: tuple[int, int]) -> dict[str, Any]:
        """The control at the sample size, as training saw it: no switch to a preferred Kontext size,
        and `max_area` the sample's own (the pipeline otherwise rescales the output to 1024 x 1024)."""
        from PIL import Image

        return {"image": controls[0].convert("RGB").resize(tuple(size), Image.Resampling.LANCZOS),
                "_auto_resize": False, "max_area": size[0] * size[1]}

    # ---- train
    def control_ids(self, h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The control's ids: the image ids with id[0] = 1, as FluxKontextPipeline.prepare_latents."""
        key = ("control", h, w, device, dtype)
        if key not in self._ids:
            ids = self.image_ids(h, w, device, dtype).clone()
            ids[:, 0] = 1
            self._ids[key] = ids
        return self._ids[key]

    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        if not meta.controls:  # Kontext also generates from text alone
            return super().loss(denoiser, x0, noise, t, cond, meta, tcfg)
        _, _, h, w = x0.shape
        device, dtype = x0.device, base_dtype(denoiser)
        target = flow.pack_2x2(flow.noisy_latents(x0, noise, t))
        tokens = torch.cat([target, *(flow.pack_2x2(c.to(device, target.dtype)) for c in meta.controls)], dim=1)
        ids = torch.cat([self.image_ids(h, w, device, dtype),
                         *(self.control_ids(c.shape[-2], c.shape[-1], device, dtype) for c in meta.controls)])
        pred = self.predict(denoiser, tokens, ids, t, cond, tcfg, meta)[:, : target.shape[1]]
        return flow.per_sample_loss(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
