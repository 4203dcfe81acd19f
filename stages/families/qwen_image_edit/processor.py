"""Qwen2-VL's processor without its video processor (stages.families.common.qwen_image_edit_processor),
also under this module name, which the model_index.json of a tiny qwen-image-edit pipeline may name."""

from stages.families.common.qwen_image_edit_processor import Qwen2VLImageProcessorOnly, load_processor  # noqa: F401
