"""The sample stage's terminal carries only the project's own lines: while each family's tiny pipeline
loads and renders (the base column: one prompt, one seed, two steps), diffusers and transformers log
nothing. Each of these once printed a notice per image or per load: FLUX.2 klein's step-distilled
pipeline at its default guidance, Flux2Pipeline's prompt encoding (apply_chat_template's options as
**kwargs), Qwen-Image 2.1's pipeline type check of its processor stand-in."""

from __future__ import annotations

import pytest

from conftest import FAMILIES, family_data, library_lines, make_cfg
from stages import sample
from stages.core.events import EventLog
from stages.core.runtime import quiet_libraries
from stages.families import library_notices


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sample_loads_and_renders_without_library_notices(family, assets, tmp_path, request):
    cfg = make_cfg(family, assets, family_data(family, request), tmp_path,
                   **{"sample.seeds": [0], "sample.steps": 2, "sample.width": 64, "sample.height": 64})
    rows, prompts, _ = sample.planned_rows(cfg)
    quiet_libraries(notices=library_notices())  # as every stage does first (install_model_trace)
    with library_lines() as seen:
        pipe, _, loaded_as = sample.load_pipeline(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
        controls = sample.load_controls(cfg, rows[:1] if rows else rows)
        _, cells, _ = sample.render_columns(pipe, cfg, [], prompts[:1], (64, 64), controls)
    first = cells[-1][0][0] if isinstance(cells[-1][0], list) else cells[-1][0]  # a video family's cell: a clip
    assert len(cells[-1]) == 1 and first.size == (64, 64)
    assert seen == []
    assert loaded_as == {"precision": "fp32", "cpu_offload": False}  # CPU: as configured


def test_a_processor_that_needs_torchvision_is_a_clear_error(assets, demo_data, tmp_path):
    """The released Qwen-Image 2.1 folder names Qwen3VLProcessor, whose video processor needs torchvision;
    encode-captions reads only its text side, but the sample stage builds the whole pipeline. Without
    torchvision that is one error naming the package and what does not need it, not an ImportError's
    traceback. The tiny folder, its processor made the released one's classes."""
    import importlib.util
    import json
    import shutil

    from conftest import tiny_model
    from stages.core.errors import ModelError

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the released processor loads")
    model = tmp_path / "qwen-image-2.1"
    shutil.copytree(tiny_model(assets, FAMILIES["qwen-image-2.1"]), model)
    index = json.loads((model / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (model / "model_index.json").write_text(json.dumps(index))
    config = json.loads((model / "processor" / "processor_config.json").read_text())
    (model / "processor" / "processor_config.json").write_text(json.dumps({**config, "processor_class": "Qwen3VLProcessor"}))
    (model / "processor" / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
         "merge_size": 2, "temporal_patch_size": 2}))
    cfg = make_cfg("qwen-image-2.1", assets, demo_data, tmp_path / "runs", model=str(model))
    with pytest.raises(ModelError, match=r"cannot load the QwenImage21Pipeline of '.*qwen-image-2.1' \(the sample stage "
                                         r"builds every component of the pipeline\): Qwen3VLVideoProcessor requires the "
                                         r"Torchvision library .* train and export-lora do not need it; install the "
                                         r"torchvision build that matches torch "):
        sample.load_pipeline(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
