"""The bench runner on a machine that lost an earlier call's work: a verify item whose train and export
were measured in a call on another machine (--skip-done) rebuilds them first, recorded as reruns, instead
of failing on a missing export (O3 and O4 of 2026-12-02 lost their verify rows so).

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_bench_runner.py
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench import Runner, run_args
from conftest import FAMILIES, tiny_model

FAMILY = "sdxl"


def test_a_verify_item_rebuilds_the_train_and_export_an_earlier_call_measured(tmp_path: Path, assets: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / FAMILY).symlink_to(tiny_model(assets, FAMILIES[FAMILY]))  # the bench's own tiny build (same seed)
    prior = tmp_path / "prior.json"
    done = [f"{FAMILY}/{kind}/nf4-512-b1" for kind in ("encode", "latents", "train", "export")]
    prior.write_text(json.dumps({"meta": {}, "items": [{"id": i, "status": "ok"} for i in done]}))
    out = tmp_path / "out.json"
    runner = Runner(run_args(work=str(tmp_path / "w"), out=str(out), tiny=True, models=str(models), keep=True,
                             skip_done=[str(prior)], only=[f"{FAMILY}/verify/*"]))

    runner.run_family(FAMILY)

    rows = json.loads(out.read_text())["items"]
    assert [(r["id"], r["status"]) for r in rows] == [
        (f"{FAMILY}/encode/bf16#rerun", "ok"), (f"{FAMILY}/latents/512#rerun", "ok"),
        (f"{FAMILY}/train/nf4-512-b1#rerun", "ok"), (f"{FAMILY}/export/nf4-512-b1#rerun", "ok"),
        (f"{FAMILY}/verify/nf4-512-b1", "ok")]
    verified = rows[-1]["summary"]
    assert verified["missing"] == [] and verified["unexpected"] == []
    assert verified["lora_tensors_loaded"] == verified["tensors_in_file"] > 0
