"""The sample stage's terminal carries only the project's own lines: while each family's tiny pipeline
loads and renders (the base column: one prompt, one seed, two steps), diffusers and transformers log
nothing. Each of these once printed a notice per image or per load: FLUX.2 klein's step-distilled
pipeline at its default guidance, Flux2Pipeline's prompt encoding (apply_chat_template's options as
**kwargs), Qwen-Image 2.1's pipeline type check of its processor stand-in."""

from __future__ import annotations

import logging

import pytest

from conftest import FAMILIES, family_data, make_cfg
from stages import sample
from stages.core.events import EventLog
from stages.core.runtime import quiet_libraries


class Lines(logging.Handler):
    """What the libraries log at WARNING and above (their own handlers write to the stderr they found
    at import, which the test's capture does not see)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sample_loads_and_renders_without_library_notices(family, assets, tmp_path, request):
    cfg = make_cfg(family, assets, family_data(family, request), tmp_path,
                   **{"sample.seeds": [0], "sample.steps": 2, "sample.width": 64, "sample.height": 64})
    rows, prompts, _ = sample.planned_rows(cfg)
    seen = Lines()
    loggers = [logging.getLogger(name) for name in ("diffusers", "transformers")]
    quiet_libraries()  # as every stage does first (install_model_trace)
    for logger in loggers:
        logger.addHandler(seen)
    try:
        pipe, _ = sample.load_pipeline(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
        controls = sample.load_controls(cfg, rows[:1] if rows else rows)
        labels, cells, _ = sample.render_columns(pipe, cfg, [], prompts[:1], (64, 64), controls)
    finally:
        for logger in loggers:
            logger.removeHandler(seen)
    assert len(cells[-1]) == 1 and cells[-1][0].size == (64, 64)
    assert seen.lines == []
