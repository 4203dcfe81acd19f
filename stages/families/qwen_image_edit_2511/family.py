"""Qwen-Image-Edit-2511: Qwen-Image-Edit-Plus (stages.families.common.qwen_image_edit, whose docstring says
what was checked against diffusers) with the transformer config's `zero_cond_t` set. The pipeline
(QwenImageEditPlusPipeline) calls the transformer exactly as for 2509 and the transformer applies the flag
itself (the control tokens' image modulation at timestep 0), so the edit family's loss, which makes that
call, trains it as it is; what differs is the model (presets, tiny pipelines) and the class train loads it as
(`denoiser.ZeroCondTrainable`: the same forward with its modulation index built once per layout, so that CUDA
graphs can capture the step)."""

from __future__ import annotations

from typing import Any

from stages.families.common.qwen_image_edit import QwenImageEdit


class QwenImageEdit2511(QwenImageEdit):
    name = "qwen-image-edit-2511"
    title = "Qwen-Image-Edit-2511 (edit, 1 control)"

    def load_denoiser(self, src: Any, precision: str, rt: Any, tcfg: Any) -> Any:
        from stages.core.lora import load_denoiser_weights
        from stages.families.qwen_image_edit_2511.denoiser import ZeroCondTrainable

        return load_denoiser_weights(ZeroCondTrainable, src, "transformer", precision, rt, tcfg.nf4_double_quant)
