"""bench/peers.py: what it reads from a diffusers script's run, the data it hands the script, the
command it builds, and the side-by-side table in bench/RESULTS.md. Parsing and report code only (the
runs themselves need the carried scripts and, at full size, the GPU)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers, report
from bench.bench import finished_before_kill

ROOT = Path(__file__).resolve().parents[2]

# tqdm's refreshes as diffusers' klein script wrote them (a 6-step CPU run of the tiny model): the last
# refresh after the loop shows a rate that includes the LoRA save, 1.54 s/it against 1.02 it/s.
TQDM_LOG = "\r".join([
    "Steps:   0%|          | 0/6 [00:00<?, ?it/s]",
    "Steps:  17%|█▋        | 1/6 [00:02<00:12,  2.41s/it, loss=1.54, lr=0.0001]",
    "Steps:  67%|██████▋   | 4/6 [00:08<00:03,  1.82s/it, loss=1.53, lr=0.0001]",
    "Steps:  83%|████████▎ | 5/6 [00:08<00:01,  1.27s/it, loss=1.54, lr=0.0001]",
    "Steps: 100%|██████████| 6/6 [00:09<00:00,  1.02it/s, loss=1.55, lr=0.0001]Model weights saved in /tmp/x",
    "Steps: 100%|██████████| 6/6 [00:09<00:00,  1.54s/it, loss=1.55, lr=0.0001]"])


def test_tqdm_rate_is_read_before_the_final_refresh():
    rows = peers.parse_tqdm(TQDM_LOG)
    assert [r["n"] for r in rows] == [1, 4, 5, 6, 6]  # "?it/s" has no rate
    assert rows[3]["s_per_step"] == pytest.approx(1 / 1.02) and rows[4]["s_per_step"] == 1.54
    assert rows[1]["elapsed_s"] == 8
    assert peers.tqdm_step_s(rows) == 1.27  # the last refresh before the final step
    assert peers.tqdm_step_s([]) is None


def _steps_file(tmp_path: Path, ends: list[float], peaks: list[float], exit_peak: float | None) -> Path:
    p = tmp_path / "steps.jsonl"
    lines = [json.dumps({"event": "step", "step": i + 1, "t": t, "wall": 1e9 + t, "peak_alloc_gb": pk,
                         "peak_reserved_gb": pk + 1}) for i, (t, pk) in enumerate(zip(ends, peaks))]
    if exit_peak is not None:
        lines.append(json.dumps({"event": "exit", "steps": len(ends), "process_peak_alloc_gb": exit_peak,
                                 "process_peak_reserved_gb": exit_peak + 1}))
    else:
        lines.append('{"event": "step", "step": 99, "t"')  # a line cut by a kill is skipped
    p.write_text("\n".join(lines) + "\n")
    return p


def test_peer_steps_median_after_warmup_and_training_peak(tmp_path):
    # step k ends at ends[k-1]; step 1's interval holds loading and encoding (its peak 30 GB)
    ends = [100.0, 102.0, 103.5, 104.5, 105.5, 106.7, 107.7]
    peaks = [30.0, 11.0, 12.5, 12.0, 12.0, 12.2, 12.1]
    summary = peers.peer_summary(*peers.read_steps(_steps_file(tmp_path, ends, peaks, 31.0)), batch=4, warmup=3)
    # intervals are the durations of steps 2..7: 2.0 1.5 1.0 1.0 1.2 1.0; warmup 3 drops steps 2 and 3
    assert summary["steps_timed"] == 4 and summary["step_s"] == pytest.approx(1.0)
    assert summary["step_s_max"] == pytest.approx(1.2)
    assert summary["samples_per_s"] == pytest.approx(4.0)
    assert summary["peak_gb"] == 12.5 and summary["peak_reserved_gb"] == 13.5  # step 1 left out
    assert summary["process_peak_gb"] == 31.0 and summary["steps_done"] == 7

    cut = peers.peer_summary(*peers.read_steps(_steps_file(tmp_path, ends[:2], peaks[:2], None)), batch=1, warmup=3)
    assert cut["steps_done"] == 2 and cut["step_s"] is None and cut["samples_per_s"] is None
    assert cut["process_peak_gb"] == 30.0  # no exit row: the largest step peak
    assert peers.read_steps(tmp_path / "missing.jsonl") == ([], None)


def test_product_summary_uses_the_same_rule():
    train = {"samples_per_second": 2.1, "peak_vram_gb": {"allocated": 9.5, "reserved": 11.0}, "compiled": True,
             "steps": [{"step": s, "ts": t} for s, t in zip(range(1, 7), [10.0, 14.0, 14.5, 15.0, 15.5, 16.0])]}
    out = peers.product_summary(train, batch=1, warmup=3)
    assert out["step_s"] == pytest.approx(0.5) and out["steps_timed"] == 3
    assert out["samples_per_s"] == pytest.approx(2.0) and out["manifest_samples_per_s"] == 2.1
    assert out["peak_gb"] == 9.5 and out["peak_reserved_gb"] == 11.0


def test_peer_folder_is_read_back_by_the_datasets_standin(tmp_path):
    from bench.bench import make_dataset

    data = make_dataset(tmp_path / "data", n=3, side=32, controls=1)
    images = peers.ensure_data(data, n=3, side=32, controls=1)
    assert [p.name for p in images] == ["img_000.png", "img_001.png", "img_002.png"]
    folder, prompt = peers.peer_folder(images, tmp_path / "peer", controls=1)
    assert prompt == (data / "img_000.txt").read_text().strip()
    code = ("import json, sys; from datasets import load_dataset; d = load_dataset(sys.argv[1], None, cache_dir=None)"
            "['train']; print(json.dumps([d.column_names, len(d), d['text'], [d[i]['control_image'].size for i in "
            "range(len(d))], list(d[0]['image'].getdata())[:2], __import__('datasets').__version__]))")
    r = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True,
                       env={"PYTHONPATH": str(peers.DATASETS_STANDIN), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    columns, n, texts, sizes, pixels, version = json.loads(r.stdout)
    assert columns == ["image", "control_image", "text"] and n == 3 and version.endswith("standin")
    assert texts == [(data / f"img_{i:03d}.txt").read_text().strip() for i in range(3)]
    assert sizes == [[32, 32]] * 3
    from PIL import Image

    assert pixels == [list(px) for px in list(Image.open(data / "img_000.png").getdata())[:2]]  # the same file
    with pytest.raises(FileNotFoundError, match="metadata.jsonl"):
        sys.path.insert(0, str(peers.DATASETS_STANDIN))
        try:
            import datasets  # the stand-in (not installed in this venv)

            if not datasets.__version__.endswith("standin"):
                pytest.skip("the real datasets is installed")
            datasets.load_dataset(str(data))
        finally:
            sys.path.remove(str(peers.DATASETS_STANDIN))
            sys.modules.pop("datasets", None)


def _args(**kw):
    base = dict(model="/m", res=1024, batch=4, steps=20, text_tokens=512, tiny=False, peer_no_cache_latents=False)
    return argparse.Namespace(**{**base, **kw})


def test_peer_command_matches_the_product_settings(tmp_path):
    from stages.families import get_family

    out = tmp_path / "out"
    out.mkdir()
    targets = list(get_family("flux2-klein").default_lora_targets)
    cmd = peers.peer_command("flux2-klein", Path("s.py"), _args(), tmp_path / "d", "a cat", out, targets)
    flag = lambda k: cmd[cmd.index(k) + 1]  # noqa: E731
    assert flag("--lora_layers").split(",") == targets
    assert (flag("--rank"), flag("--lora_alpha"), flag("--resolution"), flag("--train_batch_size")) == ("16", "16", "1024", "4")
    assert flag("--max_sequence_length") == "512" and flag("--mixed_precision") == "bf16"
    assert "--gradient_checkpointing" in cmd and "--cache_latents" in cmd and "--cond_image_column" not in cmd
    assert cmd[cmd.index("--text_encoder_out_layers") + 1:][:3] == ["9", "18", "27"]
    qcfg = json.loads(Path(flag("--bnb_quantization_config_path")).read_text())
    assert qcfg == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}

    tiny = peers.peer_command("flux2-klein", Path("s.py"), _args(tiny=True, peer_no_cache_latents=True),
                              tmp_path / "d", "a cat", out, targets)
    assert "--bnb_quantization_config_path" not in tiny and "--cache_latents" not in tiny
    assert tiny[tiny.index("--mixed_precision") + 1] == "no"
    kontext = peers.peer_command("flux-kontext", Path("s.py"), _args(), tmp_path / "d", "a cat", out, ["attn.to_q"])
    assert kontext[kontext.index("--cond_image_column") + 1] == "control_image"
    assert "--bnb_quantization_config_path" not in kontext  # the Kontext script has no quantization option


def test_missing_script_names_where_it_goes(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train_dreambooth_lora_flux_kontext.py.*\.carry-peers"):
        peers.prepare_script("flux-kontext", tmp_path, tmp_path)


def _result(peer_sps: float, peer_peak: float, products: list[tuple[str, float, float]]) -> dict:
    rows = [{"side": "diffusers script", "script": "train_dreambooth_lora_flux2_klein.py", "precision": "nf4",
             "status": "ok", "step_s": 1 / peer_sps, "samples_per_s": peer_sps, "peak_gb": peer_peak,
             "process_peak_gb": 20.0, "wall_s": 120.0, "upstream_commit": "027e8eebf3", "datasets": "stand-in"}]
    for precision, sps, peak in products:
        rows.append({"side": "product", "precision": precision, "status": "ok", "step_s": 1 / sps, "samples_per_s": sps,
                     "peak_gb": peak, "total_wall_s": 90.0, "stages": {"encode": {"wall_s": 30.0, "peak_gb": 5.0},
                                                                       "latents": {"wall_s": 20.0, "peak_gb": 3.0},
                                                                       "train": {"wall_s": 40.0, "peak_gb": peak}}})
    return {"meta": {"command": "bench/peers.py run --family flux2-klein", "tiny": False}, "family": "flux2-klein",
            "res": 1024, "batch": 1, "steps": 20, "rows": rows}


def test_side_by_side_table_ratio_and_target(tmp_path):
    text = peers.report_section([_result(0.5, 12.0, [("nf4", 1.25, 9.0), ("bf16", 1.5, 14.0)])])
    lines = [line for line in text.splitlines() if line.startswith("| flux2-klein")]
    assert len(lines) == 3
    assert "| diffusers `train_dreambooth_lora_flux2_klein.py` | nf4 | 2.000 | 0.50 | 12.0 | 1.00 |" in lines[0]
    assert lines[1].endswith("| product | nf4 | 0.800 | 1.25 | 9.0 | 2.50 | yes |")
    assert lines[2].endswith("| product | bf16 | 0.667 | 1.50 | 14.0 | 3.00 | no |")  # faster, but above the script's peak
    assert "encode 30 s, peak 5.0 GB; latents 20 s, peak 3.0 GB; train 40 s, peak 14.0 GB; all three 90 s" in text
    assert "`bench/peers.py run --family flux2-klein`" in text
    slow = peers.report_section([_result(0.5, 12.0, [("nf4", 0.9, 9.0)])])
    assert "| 1.80 | no |" in slow
    failed = _result(0.5, 12.0, [])
    failed["rows"][0].update(status="failed", samples_per_s=None, step_s=None)
    failed["rows"].append({"side": "product", "precision": "nf4", "status": "ok", "samples_per_s": 1.0, "peak_gb": 9.0})
    assert "| product | nf4 | — | 1.00 | 9.0 | — | — |" in peers.report_section([failed])
    for rc, shown in ((-9, "product (cut off by the budget at train)"), (1, "product (failed at train)")):
        cut = _result(0.5, 12.0, [])  # a product train killed at the run's deadline is not a failure
        cut["rows"].append({"side": "product", "precision": "nf4", "status": "failed at train",
                            "stages": {"encode": {"rc": 0}, "train": {"rc": rc}}})
        assert f"| {shown} | nf4 | — | — | — | — | — |" in peers.report_section([cut])
    tiny = {**_result(0.5, 12.0, []), "meta": {"tiny": True}}
    assert "No side-by-side run yet" in peers.report_section([tiny])

    path = tmp_path / "peers-klein.json"
    path.write_text(json.dumps(_result(0.5, 12.0, [("nf4", 1.25, 9.0)])))
    assert report._kind(json.loads(path.read_text())) == "peers"
    results = report.write_report([path])["RESULTS.md"]
    assert "## Side by side with diffusers' scripts" in results and "| 2.50 | yes |" in results


def test_a_train_killed_after_its_final_manifest_is_read_not_failed(tmp_path):
    """The budget's kill after a train wrote its complete final manifest in this call keeps the row; a
    manifest from an earlier call, an incomplete one or fewer steps do not."""
    import os
    import time

    final = tmp_path / "lora" / "final"
    final.mkdir(parents=True)
    since = time.time()
    (final / "manifest.json").write_text(json.dumps({"complete": True, "step": 15}))
    assert finished_before_kill(tmp_path, "train", since - 1, 15)
    assert not finished_before_kill(tmp_path, "latents", since - 1, 15)
    assert not finished_before_kill(tmp_path, "train", since - 1, 20)
    (final / "manifest.json").write_text(json.dumps({"complete": False, "step": 15}))
    assert not finished_before_kill(tmp_path, "train", since - 1, 15)
    (final / "manifest.json").write_text(json.dumps({"complete": True, "step": 15}))
    os.utime(final / "manifest.json", (since - 100, since - 100))  # written before this call
    assert not finished_before_kill(tmp_path, "train", since - 1, 15)


def test_a_product_only_probe_takes_the_scripts_row_from_an_earlier_run_of_the_same_shape(tmp_path):
    from bench.peers import peer_row_from

    rows = [{"side": "diffusers script", "status": "ok", "peak_gb": 26.747, "step_s": 1.7676},
            {"side": "product", "precision": "fp8", "status": "ok", "peak_gb": 15.9}]
    f = tmp_path / "run3.json"
    f.write_text(json.dumps({"family": "flux-kontext", "res": 1024, "batch": 1, "rows": rows}))
    row = peer_row_from(f, "flux-kontext", 1024, 1)
    assert (row["peak_gb"], row["step_s"], row["from_file"]) == (26.747, 1.7676, str(f))
    with pytest.raises(SystemExit, match="holds flux-kontext at 1024 px batch 1, this run is flux-kontext at 512 px"):
        peer_row_from(f, "flux-kontext", 512, 1)
    f.write_text(json.dumps({"family": "flux-kontext", "res": 1024, "batch": 1, "rows": rows[1:]}))
    with pytest.raises(SystemExit, match="no finished row of the script"):
        peer_row_from(f, "flux-kontext", 1024, 1)


def test_variant_flags_set_their_train_keys_and_an_unknown_one_is_named():
    """`fp8+cudnn+fp8blocks16` is an fp8 row with cuDNN attention and train.fp8_blocks = 16; a misspelt flag stops
    the run with the flags it knows."""
    from types import SimpleNamespace

    assert peers.variant_flag("fp8blocks16") == ({}, {"train.fp8_blocks": 16})
    assert peers.variant_flag("cudnn") == ({}, {"runtime.cudnn_attention": True})
    assert peers.variant_flag("fp8blocks") is None and peers.variant_flag("fp8blockz3") is None
    with pytest.raises(SystemExit, match=r"unknown product variant flag\(s\) \['cudnnn'\]; known: cudnn, .*fp8blocks<N>"):
        peers.run_product(SimpleNamespace(tiny=False, res=1024), "flux2-klein", None, "fp8+cudnnn", None, {}, {})


def test_a_failed_stage_keeps_its_own_last_events(tmp_path):
    """A failed product stage's row keeps the events that run wrote (its plan, the step it died in), not an
    earlier run's from the same events.jsonl, and a damaged line does not stop it; no file gives none."""
    events = tmp_path / "events.jsonl"
    lines = [json.dumps({"ts": 100.0, "event": "start", "stage": "encode-captions"}),
             json.dumps({"ts": 200.0, "event": "start", "stage": "train"}), "{not json",
             json.dumps({"ts": 201.0, "event": "plan", "stage": "train", "note": "x" * 500}),
             json.dumps({"ts": 202.0, "event": "error", "stage": "train", "message": "train ran out of GPU memory"})]
    events.write_text("\n".join(lines) + "\n")
    got = peers._events_tail(tmp_path, 200.5)
    assert [json.loads(g)["event"] for g in got[:1]] == ["start"] and got[1].startswith('{"ts": 201.0') and len(got[1]) == 400
    assert json.loads(got[-1])["message"] == "train ran out of GPU memory" and len(got) == 3
    assert [json.loads(g)["event"] for g in peers._events_tail(tmp_path, 200.5, n=1)] == ["error"]
    assert peers._events_tail(tmp_path / "missing", 0.0) == []
