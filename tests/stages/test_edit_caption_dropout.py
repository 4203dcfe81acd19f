"""Caption dropout for qwen-image-edit, whose Qwen2.5-VL text encoder sees the control images: the
empty caption is cached once per distinct control set (keyed like the captions), and the dropout
draw swaps in the item's own empty row. Families whose text does not see the controls keep one shared
empty row (tests/stages/test_datasets_captions.py).

    PYTHONPATH=$PWD python -m pytest -q tests/stages/test_edit_caption_dropout.py
"""

from __future__ import annotations

import dataclasses
import shutil
from collections import Counter

import pytest
import torch

from stages import cache_latents, encode_captions, train
from stages.core import faults, image_io
from stages.core.artifacts import ArtifactError
from stages.inspect import captions_section
from stages.train.trainer import build_data
from conftest import make_cfg, run_beside
from stages.core.caches import lora_dir
from stages.families import get_family, pipeline_class

QWEN_EDIT = pytest.mark.parametrize("built_run", ["qwen-image-edit"], indirect=True)


def _pipeline_row(pipe, prompt: str, controls) -> torch.Tensor:
    """QwenImageEditPlusPipeline.encode_prompt over the prompt and the controls, resized as its __call__ does."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    condition = []
    for path in controls:
        image = image_io.load_image(path)
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        condition.append(pipe.image_processor.resize(image, h, w))
    embeds, mask = pipe.encode_prompt(prompt=prompt, image=condition, device=torch.device("cpu"))
    assert mask is None  # one prompt: all valid
    return embeds


def _assert_row_is(store, row: int, embeds: torch.Tensor) -> None:
    got = store.read_row(row)
    n = int(got["prompt_length"])
    assert n == embeds.shape[1], "the row's length is not the pipeline's"
    torch.testing.assert_close(torch.from_numpy(got["prompt_embeds"][:n]).unsqueeze(0), embeds, rtol=1e-5, atol=1e-5)


def test_empty_rows_per_control_set_match_the_pipeline_and_follow_their_controls(assets, edit_data, tmp_path):
    data = shutil.copytree(edit_data, tmp_path / "data")
    # two items with the same control image: one control set, so one empty row for both
    (data / "shape_005_control.png").write_bytes((data / "shape_002_control.png").read_bytes())
    cfg = make_cfg("qwen-image-edit", assets, data, tmp_path / "runs", **{"data.caption_dropout": 0.3})
    manifest = encode_captions.run(cfg)
    assert manifest["encoded_this_run"] == 12 + 11  # 12 captions, 11 control sets' empty captions
    items = {it.key: it for it in cache_latents.scan_items(cfg)}
    own = manifest["empty_captions"]
    assert "empty_caption" not in manifest, "no shared empty row: the VL encoder sees each item's controls"
    assert own == {key: it.empty_caption_id for key, it in items.items()}
    assert own["shape_005.png"] == own["shape_002.png"] and len(set(own.values())) == 11
    assert not set(own.values()) & {c for it in items.values() for c in it.caption_ids}
    shown = {r["caption_id"]: r for r in captions_section(cfg.run_dir, 4, cfg)["captions"]}
    assert shown[own["shape_002.png"]]["text"] == "" and shown[own["shape_002.png"]]["items"] == ["shape_002.png",
                                                                                                  "shape_005.png"]

    store, _ = encode_captions.load_captions(cfg)
    pipe = pipeline_class(get_family(cfg.family)).from_pretrained(cfg.model)
    for cid in sorted(set(own.values())):
        key = next(k for k, c in own.items() if c == cid)
        _assert_row_is(store, manifest["rows"][cid], _pipeline_row(pipe, "", items[key].controls))

    # a changed control re-encodes exactly its item's caption row and empty row; the item that
    # shared the old control set keeps its empty row
    from PIL import Image

    control = data / "shape_005_control.png"
    Image.open(control).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(control)
    after = encode_captions.run(cfg)
    changed = {it.key: it for it in cache_latents.scan_items(cfg)}["shape_005.png"]
    assert after["encoded_this_run"] == 2
    assert set(after["rows"]) - set(manifest["rows"]) == {changed.caption_id, changed.empty_caption_id}
    assert after["empty_captions"]["shape_002.png"] == own["shape_002.png"] in after["rows"]
    store, _ = encode_captions.load_captions(cfg)
    _assert_row_is(store, after["rows"][changed.empty_caption_id], _pipeline_row(pipe, "", changed.controls))
    assert encode_captions.run(cfg)["encoded_this_run"] == 0


def _copy_run(cfg, name: str, steps: int, checkpoint_every: int):
    new = dataclasses.replace(cfg, run=name, train=dataclasses.replace(cfg.train, steps=steps),
                              runtime=dataclasses.replace(cfg.runtime, checkpoint_every=checkpoint_every))
    shutil.rmtree(new.run_dir, ignore_errors=True)
    for cache in ("captions.zarr", "latents.zarr"):
        shutil.copytree(cfg.run_dir / cache, new.run_dir / cache)
    return new


@pytest.fixture(scope="module")
def dropping(built_run):
    """The qwen-image-edit built run's caches with caption_dropout = 0.5 (encode-captions adds the empty rows)."""
    cfg = run_beside(built_run, "drop", **{"data.caption_dropout": 0.5})
    with pytest.raises(ArtifactError, match=r"the empty caption that caption dropout or train.preservation trains 'shape_000.png' on is not "
                                            r"in captions.zarr: run `lorapipe encode-captions qwen-image-edit-drop --artifacts "):
        build_data(cfg)  # the caches predate the setting: a clear error naming the item and the command
    assert encode_captions.run(cfg)["encoded_this_run"] == 12  # the 12 empty rows; the caption rows are kept
    return cfg


@QWEN_EDIT
def test_dropout_draws_each_items_own_empty_row_at_the_rate(built_run, dropping):
    data, _ = build_data(dropping)
    store, manifest = encode_captions.load_captions(dropping)
    pairs = data.pairs
    assert [p.empty[0] for p in pairs] == [manifest["empty_captions"][p.key] for p in pairs]
    assert len({p.empty for p in pairs}) == len(pairs)  # the demo pairs' controls all differ
    g = torch.Generator().manual_seed(0)
    indices = list(range(len(pairs)))
    draws = [data.draw_captions(indices, g) for _ in range(2000)]
    for k, p in enumerate(pairs):
        got = Counter(d[k] for d in draws)
        assert set(got) == {p.empty, (p.caption_id, p.caption_row)}, "an item drew another item's empty row"
        assert abs(got[p.empty] / len(draws) - 0.5) < 0.04, got[p.empty]
    a, b = next(members for members in data.buckets().values() if len(members) > 1)[:2]
    batch = data.load([a, b], [0, 0], [pairs[a].empty, (pairs[b].caption_id, pairs[b].caption_row)])
    want = store.read_row(pairs[a].empty[1])  # the swapped-in row is what the step trains on
    assert batch.caption_ids == [pairs[a].empty[0], pairs[b].caption_id]
    assert all((batch.cond[name][0].numpy() == want[name]).all() for name in data.caption_fields)


@QWEN_EDIT
def test_stop_and_resume_with_dropout_is_bit_identical(built_run, dropping, monkeypatch):
    from stages.core.train_data import TrainData

    trained_on: list[str] = []
    load = TrainData.load

    def recording(self, indices, variants, captions=None):  # the real load; notes the rows it trains on
        batch = load(self, indices, variants, captions)
        trained_on.extend(batch.caption_ids)
        return batch

    monkeypatch.setattr(TrainData, "load", recording)
    whole = _copy_run(dropping, "qwen-edit-drop-whole", steps=6, checkpoint_every=3)
    train.run(whole)
    empties = set(encode_captions.load_captions(whole)[1]["empty_captions"].values())
    assert 0 < sum(c in empties for c in trained_on) < len(trained_on), "dropout drew no empty row, or only those"
    cut = _copy_run(dropping, "qwen-edit-drop-cut", steps=6, checkpoint_every=3)
    monkeypatch.setenv(faults.ENV, "train:3:TERM")
    assert train.run(cut)["step"] == 3
    monkeypatch.delenv(faults.ENV)
    assert train.run(cut, resume=True)["step"] == 6
    from safetensors.torch import load_file

    want = load_file(str(lora_dir(whole) / "final" / "adapter_model.safetensors"))
    got = load_file(str(lora_dir(cut) / "final" / "adapter_model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_truncated_empty_row_is_named_with_its_item(assets, edit_data, tmp_path):
    """The controls' vision tokens count: an empty caption can outgrow captions.max_sequence_length too."""
    import json

    data = tmp_path / "data"
    data.mkdir()
    for name in ("shape_000.png", "shape_000_control.png", "shape_000.txt"):
        shutil.copy(edit_data / name, data / name)
    cfg = make_cfg("qwen-image-edit", assets, data, tmp_path / "runs",
                   **{"data.caption_dropout": 0.1, "captions.max_sequence_length": 100})
    encode_captions.run(cfg)
    warnings = [e["message"] for e in map(json.loads, (cfg.run_dir / "events.jsonl").read_text().splitlines())
                if e["event"] == "warning"]
    assert any(m.startswith("the empty caption (caption dropout) of 'shape_000.png' has ") and "truncated to 100" in m
               for m in warnings), warnings
    assert any(m.startswith("caption of 'shape_000.png' has ") for m in warnings), warnings
