"""What the terminal shows: the project's warnings and a summary per stage on stderr, library noise quiet
unless --verbose / LORAPIPE_DEBUG=1."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import ROOT, demo_config_path, tiny_model
from stages.core.events import EventLog, terminal_line

NOISE = ["Loading weights", "it/s]", "requires torchvision", "torch_dtype", "Make sure to know what you are doing",
         "No LoRA keys associated", "Token indices sequence length", "AccumulateGrad", "gemm_4bit_forward"]


def test_a_stage_prints_its_warnings_and_summary_and_no_library_noise(assets, demo_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    long_caption = sorted(data.glob("*.txt"))[0]
    long_caption.write_text("a large blue square at the top left " * 12)  # > captions.max_sequence_length = 32
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPIPE_DEBUG", "LORAPIPE_VERBOSE")}
    r = subprocess.run([sys.executable, "pipeline.py", "encode-captions", "--config", str(demo_config_path("flux")),
                        "--model", str(tiny_model(assets, "flux-dev")), "--set", f"data.path={data}",
                        "--set", f"artifacts={tmp_path / 'artifacts'}", "--set", "device='cpu'"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert any(line.startswith(f"warning: caption of '{long_caption.with_suffix('.png').name}' has ")
               and "truncated to 32" in line for line in lines), r.stderr
    summary = [line for line in lines if line.startswith("encode-captions done in ")]
    assert len(summary) == 1 and "12 of 12 encoded this run; 1 warning" in summary[0], r.stderr
    assert str(tmp_path / "artifacts" / "demo") in summary[0]
    assert [n for n in NOISE if n in r.stderr] == [], r.stderr


def test_plan_prints_its_table_and_no_library_noise(assets, demo_data, tmp_path):
    """`pipeline.py plan` imports what the stages load (bitsandbytes among them) and stays as quiet as they do;
    under a cap it says which allocator the stages will run."""
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPIPE_DEBUG", "LORAPIPE_VERBOSE", "PYTORCH_CUDA_ALLOC_CONF",
                                                            "PYTORCH_ALLOC_CONF")}
    r = subprocess.run([sys.executable, "pipeline.py", "plan", "--config", str(demo_config_path("flux")),
                        "--model", str(tiny_model(assets, "flux-dev")), "--set", f"data.path={demo_data}",
                        "--set", f"artifacts={tmp_path / 'artifacts'}", "--vram", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "memory plan of run" in r.stdout and "expandable_segments:True" in " ".join(r.stdout.split()), r.stdout
    assert [n for n in NOISE if n in r.stdout + r.stderr] == [] and r.stderr.strip() == "", r.stderr


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_libraries_silences_at_the_source_and_verbose_restores():
    import diffusers.utils.logging as diffusers_logging
    import torch
    from diffusers.utils.deprecation_utils import _resolve_dtype

    from stages.core.runtime import quiet_libraries

    logger = logging.getLogger("transformers.tokenization_utils_base")
    collect = _Collect()

    def shown() -> list[str]:
        collect.messages.clear()
        with warnings.catch_warnings(record=True) as caught:
            # behind the filters quiet_libraries puts first: show FutureWarnings (pyproject ignores them)
            warnings.filters[:] = [f for f in warnings.filters if f[1] is not None or f[2] is not FutureWarning]
            warnings.filterwarnings("always", category=FutureWarning, append=True)
            _resolve_dtype(None, torch.float32)  # diffusers' real `torch_dtype` FutureWarning
        logger.warning("Token indices sequence length is longer than the specified maximum sequence length (90 > 77)")
        logger.warning("a warning we keep")
        return [str(w.message) for w in caught] + collect.messages

    logger.addHandler(collect)
    try:
        quiet_libraries(verbose=False)
        assert shown() == ["a warning we keep"]
        assert not diffusers_logging.is_progress_bar_enabled()
        quiet_libraries(verbose=True)
        assert len(shown()) == 3 and diffusers_logging.is_progress_bar_enabled()
    finally:
        logger.removeHandler(collect)
        quiet_libraries(verbose=False)


def test_the_summary_line_is_built_from_the_done_event(tmp_path, capsys):
    log = EventLog(tmp_path, "r", "train")
    log.emit("warning", message="resumed from checkpoint-4 at step 4")
    log.emit("skipped", item="a.png", reason="image 'a.png' is truncated")
    log.emit("done", seconds=2.25, step=8, loss_first=1.5, loss_last=1.25)
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: resumed from checkpoint-4 at step 4", "skipped 'a.png': image 'a.png' is truncated",
                   f"train done in 2.2 s: step 8, loss 1.5 -> 1.25; 2 warnings (above, and in events.jsonl); "
                   f"output in {tmp_path}"]
    export = {"event": "done", "stage": "export-lora", "seconds": 1.0, "files": ["/x/export/a.safetensors"]}
    assert terminal_line(export, 0, Path("/x"))[0] == "export-lora done in 1.0 s: 0 warnings; output: /x/export/a.safetensors"
    failed = {"event": "error", "stage": "cache-latents", "message": "boom"}
    assert terminal_line(failed, 1, Path("/x"))[0] == "cache-latents failed (1 warning before it; events in /x/events.jsonl)"


def test_on_a_gpu_the_summary_says_the_peak_and_how_train_ran():
    """A stage's reserved peak (what a budget caps) and, for train, blocks swapped and CUDA graphs or
    eager and why; nothing of it on CPU."""
    def line(**done):
        return terminal_line({"event": "done", "stage": "train", "seconds": 9.0, "step": 8, **done}, 0, Path("/x"))[0]

    runtime = {"blocks": 57, "block_swap": {"swapped_blocks": 54},
               "cuda_graphs": {"plan": "...", "graphs": 1, "failed": 0, "replays": 7, "no_room": 0, "room": ["..."]}}
    peak = {"allocated": 4.98, "reserved": 5.785}
    assert line(device="cuda:0", peak_vram_gb=peak, runtime=runtime) == \
        "train done in 9.0 s: step 8; peak 5.79 GB reserved, 54 of 57 blocks swapped, CUDA graphs; 0 warnings; output in /x"
    runtime["cuda_graphs"].update(graphs=0, no_room=1)
    assert "54 of 57 blocks swapped, eager: no room to capture CUDA graphs;" in line(device="cuda:0", peak_vram_gb=peak, runtime=runtime)
    runtime["cuda_graphs"].update(no_room=0, failed=1)
    assert "eager: the CUDA graph capture failed;" in line(device="cuda:0", peak_vram_gb=peak, runtime=runtime)
    runtime["cuda_graphs"].update(failed=0, stopped="released for a new shape's eager step: ...")  # graphs cleared
    assert "CUDA graphs, then eager: released for a new batch shape under the budget;" in \
        line(device="cuda:0", peak_vram_gb=peak, runtime=runtime)
    cached = terminal_line({"event": "done", "stage": "cache-latents", "seconds": 3.0, "total": 4, "encoded": 4,
                            "peak_vram_gb": {"allocated": 3.364, "reserved": 3.895}}, 0, Path("/x"))[0]
    assert cached == "cache-latents done in 3.0 s: 4 of 4 encoded this run; peak 3.90 GB reserved; 0 warnings; output in /x"
    cpu = line(device="cpu", peak_vram_gb={"allocated": 0.0, "reserved": 0.0},
               runtime={"blocks": 4, "block_swap": None, "cuda_graphs": {"plan": "off (no CUDA device)"}})
    assert cpu == "train done in 9.0 s: step 8; 0 warnings; output in /x"


@pytest.mark.parametrize("event", ["start", "step", "preparing"])
def test_routine_events_stay_off_the_terminal(event):
    assert terminal_line({"event": event, "stage": "train"}, 0, Path("/x")) is None


def test_every_quieted_logger_is_a_real_module_and_keeps_other_messages():
    """A filter on a logger name that no module logs under would silence nothing: each name in
    QUIET_LOG_MESSAGES and in the families' notices imports, and its filter drops only the listed message."""
    import importlib

    from stages.core.runtime import QUIET_LOG_MESSAGES, quiet_libraries
    from stages.families import library_notices

    notices = library_notices()
    assert "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus" in notices.messages
    for name in [*QUIET_LOG_MESSAGES, *notices.messages]:
        importlib.import_module(name)
    quiet_libraries(verbose=False, notices=notices)
    logger, collect = logging.getLogger("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"), _Collect()
    logger.addHandler(collect)
    try:
        logger.warning("true_cfg_scale is passed as 4.0, but classifier-free guidance is not enabled since no "
                       "negative_prompt is provided.")
        logger.warning("a warning we keep")
    finally:
        logger.removeHandler(collect)
    assert collect.messages == ["a warning we keep"]
