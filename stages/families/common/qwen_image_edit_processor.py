"""Qwen2-VL's processor without its video processor.

transformers 5.24 cannot build `Qwen2VLProcessor` without torchvision (its video-processor slot
fails the class check even when None), and torchvision has no CPU build for torch 2.13 here. The
Plus pipeline only gives it images: this subclass is the same processor (same image-token
expansion, `__call__`, image processor) with the video slot left out. It loads the `processor/`
folder the released repo ships (tokenizer files + preprocessor_config.json).
"""

from __future__ import annotations

from typing import Any

from transformers import ProcessorMixin, Qwen2VLProcessor


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def load_processor(folder: Any) -> Qwen2VLImageProcessorOnly:
    """The pipeline's `processor/` subfolder (a local path)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorOnly(Qwen2VLImageProcessorPil.from_pretrained(str(folder)),
                                     AutoTokenizer.from_pretrained(str(folder)))
