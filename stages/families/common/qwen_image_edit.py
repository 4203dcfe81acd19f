"""Qwen-Image-Edit-Plus (Qwen/Qwen-Image-Edit-2509): Qwen-Image's VAE and transformer, with 1-3
control images that both the text encoder and the transformer see; the family class that
`qwen-image-edit` and `qwen-image-edit-2511` share.

Checked against diffusers 0.42.1 `pipelines/qwenimage/pipeline_qwenimage_edit_plus.py`:
- `_get_qwen_prompt_embeds`: the prompt is prefixed with "Picture k: <|vision_start|><|image_pad|>
  <|vision_end|>" per control, put into `prompt_template_encode`, and the processor (Qwen2-VL) gets
  the controls resized to `calculate_dimensions(CONDITION_IMAGE_SIZE = 384 * 384, aspect)`; the last
  hidden state at the valid tokens, the first 64 (`prompt_template_encode_start_idx`) dropped. No
  truncation: a row longer than `captions.max_sequence_length` is cut with a warning.
- `prepare_latents` / `_encode_vae_image`: each control resized to
  `calculate_dimensions(VAE_IMAGE_SIZE, its aspect)`, encoded (`argmax`), normalized per channel like
  the target, packed 2x2; the controls' tokens follow the target's (`cat(..., dim=1)`).
- `__call__`: `img_shapes = [[(1, h/2, w/2), *((1, hc/2, wc/2) per control)]] * B`, timestep
  t / 1000 = sigma, `noise_pred[:, :latents.size(1)]`: the loss is on the target tokens only.
- `models/transformers/transformer_qwenimage.py` with `zero_cond_t` in the transformer's config
  (Qwen-Image-Edit-2511): the transformer itself runs the timestep as `[t, 0 * t]` and marks each
  sample's first `img_shapes` entry (the target) 0 and the controls 1 (`modulate_index`), so the
  control tokens get the image modulation of timestep 0; the text stream and `norm_out` take t.
  `loss` calls it with the pipeline's arguments (target first in `img_shapes`), so it applies the
  flag as the pipeline does, from the loaded config.

Geometry: VAE_IMAGE_SIZE is the pipeline's 1024 x 1024 output area; training uses the bucket's area
(data.resolution squared, the same at 1024 px), so each control gets its own aspect at the target's
scale; `sample` renders with that area too. A flipped variant flips its controls' latents with the
target (the edit stays aligned); the text encoder sees the controls unflipped, as the pipeline does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from stages.core import aspect_buckets, flow
from stages.core.lazy import lazy_module, no_grad
from stages.core.lora import base_dtype
from stages.families.base import BatchMeta
from stages.families.common.qwen_image import QwenImageBase
from stages.families.common.qwen_image_edit_checks import PIPELINE_MAX_SEQUENCE_LENGTH
from stages.families.text_encoders import load_text_model, pad_valid_tokens, require_max_length, trim_to_longest

torch = lazy_module("torch")  # imported at first use: a family's traits and `status` need no torch

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
DROP_IDX = 64  # QwenImageEditPlusPipeline.prompt_template_encode_start_idx


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as pipeline_dims

    return pipeline_dims(area, ratio)


def condition_images(controls: list[Any]) -> list[Any]:
    """The controls as the pipeline hands them to the processor (CONDITION_IMAGE_SIZE, own aspect)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE
    from PIL import Image

    out = []
    for im in controls:
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, im.width / im.height)
        out.append(im.resize((w, h), Image.Resampling.LANCZOS))
    return out


class QwenImageEditTextEncoder:
    def __init__(self, src: Any, cfg: Any, rt: Any):
        from transformers import Qwen2_5_VLForConditionalGeneration

        from stages.families.common.qwen_image_edit_processor import Qwen2VLImageProcessorOnly

        require_max_length(cfg, PIPELINE_MAX_SEQUENCE_LENGTH, "Qwen-Image-Edit-Plus")
        self.device, self.max_len = rt.device, cfg.max_sequence_length
        self.processor = src.load(Qwen2VLImageProcessorOnly, "processor")
        self.model = load_text_model(Qwen2_5_VLForConditionalGeneration, src, "text_encoder", cfg, rt)
        self.last: tuple[list[str], list[int]] = ([], [])  # the last batch's texts and token counts

    @no_grad
    def encode(self, texts: list[str], controls: list[list[Any]]) -> dict[str, torch.Tensor]:
        """One caption at a time, as the pipeline (batch size 1): no padding enters the VL model."""
        rows, counts = zip(*(self._encode_one(text, images) for text, images in zip(texts, controls)))
        self.last = (list(texts), list(counts))
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def _encode_one(self, text: str, images: list[Any]) -> tuple[dict[str, torch.Tensor], int]:
        prefix = "".join(IMAGE_PROMPT.format(i + 1) for i in range(len(images)))
        inputs = self.processor(text=[PROMPT_TEMPLATE.format(prefix + text)], images=condition_images(images),
                                padding=True, return_tensors="pt").to(self.device)
        out = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs.get("pixel_values"), image_grid_thw=inputs.get("image_grid_thw"),
                         output_hidden_states=True)
        n = int(inputs["attention_mask"].sum()) - DROP_IDX
        return pad_valid_tokens(out.hidden_states[-1], inputs["attention_mask"], DROP_IDX, self.max_len), n

    def token_counts(self, texts: list[str]) -> list[int]:
        """Tokens of each row of the last `encode(texts, ...)`, control images' vision tokens included
        (by position: the same text, e.g. the empty caption, has other counts with other controls)."""
        if texts != self.last[0]:
            raise ValueError("token_counts of the texts of the last encode call only: they depend on its controls")
        return self.last[1]


class QwenImageEdit(QwenImageBase):
    name = "qwen-image-edit"
    title = "Qwen-Image-Edit (edit, 1 control)"
    # fp8_faster_from_tokens: Qwen-Image's, the same transformer (control tokens lengthen the sequence); no
    # fp8 rows of its own yet
    pipeline_class = "QwenImageEditPlusPipeline"
    # a tiny pipeline's model_index.json names the processor without torchvision (and an older one its alias)
    pipeline_modules = ("stages.families.common.qwen_image_edit_processor", "stages.families.qwen_image_edit.processor")
    text_components = ("tokenizer", "text_encoder", "processor")
    control_range = (1, 3)  # Qwen-Image-Edit-2509 is trained on 1 to 3 input images
    text_sees_controls = True
    # a control at the pipeline's CONDITION_IMAGE_SIZE (384 x 384 px), resized by the Qwen2-VL processor to
    # multiples of 28 px, one vision token per 28 x 28 px (196 for a square control, about that for others),
    # and its "Picture k: " label's tokens
    text_tokens_per_control = 210

    # ---- encode-captions
    def load_text_encoder(self, src: Any, cfg: Any, rt: Any) -> QwenImageEditTextEncoder:
        return QwenImageEditTextEncoder(src, cfg, rt)

    # ---- cache-latents
    def control_images(self, control: Any, size: tuple[int, int], variants: list[aspect_buckets.Variant],
                       bucket: tuple[int, int]) -> list[Any]:
        """The control at its own aspect over the bucket's area (the pipeline's VAE size rule), flipped
        with flipped variants; never cropped."""
        from PIL import Image

        w, h = calculate_dimensions(bucket[0] * bucket[1], control.width / control.height)
        im = control.resize((w, h), Image.Resampling.LANCZOS)
        return [im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if v.flip else im for v in variants]

    # ---- sample
    def sample_image_kwargs(self, controls: list[Any], size: tuple[int, int]) -> dict[str, Any]:
        return {"image": [c.convert("RGB") for c in controls]}

    @contextlib.contextmanager
    def sample_context(self, size: tuple[int, int]) -> Iterator[None]:
        """The pipeline sizes the controls' latents for a 1024 x 1024 output (VAE_IMAGE_SIZE); at
        another sample size they get that size's area, as in training."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        saved, plus.VAE_IMAGE_SIZE = plus.VAE_IMAGE_SIZE, size[0] * size[1]
        try:
            yield
        finally:
            plus.VAE_IMAGE_SIZE = saved

    # ---- train
    def loss(self, denoiser: torch.nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             cond: dict[str, torch.Tensor], meta: BatchMeta, tcfg: Any) -> torch.Tensor:
        b, _, h, w = x0.shape
        dtype, device = base_dtype(denoiser), x0.device
        text, mask = trim_to_longest(cond["prompt_embeds"].to(device, dtype), cond["prompt_length"], meta.text_multiple)
        target = flow.pack_2x2(flow.noisy_latents(x0, noise, t))
        tokens = torch.cat([target, *(flow.pack_2x2(c.to(device, target.dtype)) for c in meta.controls)], dim=1)
        shapes = [(1, h // 2, w // 2), *((1, c.shape[-2] // 2, c.shape[-1] // 2) for c in meta.controls)]
        pred = denoiser(
            hidden_states=tokens.to(dtype),
            timestep=t.to(device, dtype),  # the pipeline passes t / 1000 = sigma
            guidance=None,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0][:, : target.shape[1]]
        return flow.per_sample_loss(flow.unpack_2x2(pred, h, w), flow.flow_target(x0, noise), meta.loss_mask, tcfg, t)
