"""Config values: every bad value is a ConfigError naming the key and its valid range, all at once, before
any stage touches a cache; paths in a config file are relative to it; a hub id fails at once offline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import ROOT
from stages.core.config import all_keys, describe_keys, load_config
from stages.core.errors import ConfigError, ModelError, ResourceError

BAD_VALUES = [
    ({"data.background": "notacolor"}, "'data.background' = 'notacolor' is not a colour: use a name such as 'white'"),
    ({"seed": 2**64 - 1}, "'seed' = 18446744073709551615 must be in [0, 4294967295]"),
    ({"seed": -1}, "'seed' = -1 must be in [0, 4294967295]"),
    ({"data.caption_ext": "txt"}, "'data.caption_ext' = 'txt' must be a file extension starting with a dot: did you mean '.txt'?"),
    ({"data.caption_ext": "."}, "'data.caption_ext' = '.' must be a file extension starting with a dot: e.g. '.txt'"),
    ({"data.resolution": 2}, "'data.resolution' = 2 must be >= 16"),
    ({"data.max_aspect": 0.5}, "'data.max_aspect' = 0.5 must be >= 1"),
    ({"data.bucket_step": 128}, "'data.bucket_step' = 128 is larger than 'data.resolution' = 64: no bucket fits"),
    ({"data.bucket_step": -16}, "'data.bucket_step' = -16 must be >= 0"),
    ({"train.batch_size": 0}, "'train.batch_size' = 0 must be >= 1"),
    ({"train.learning_rate": 0.0}, "'train.learning_rate' = 0.0 must be > 0"),
    ({"train.dropout": 1.0}, "'train.dropout' = 1.0 must be in [0, 1)"),
    ({"train.adam_beta2": 1.5}, "'train.adam_beta2' = 1.5 must be in [0, 1)"),
    ({"runtime.keep_checkpoints": -1}, "'runtime.keep_checkpoints' = -1 must be >= 0"),
    ({"sample.seeds": [0, -3]}, "'sample.seeds[1]' = -3 must be in [0, 4294967295]"),
    ({"train.target_modules": ["to_q", " "]}, "'train.target_modules[1]' is empty"),
    ({"run": "a/b"}, "'run' = 'a/b' must be a plain folder name"),
    ({"device": "tpu"}, "'device' = 'tpu' is not one of 'auto', 'cpu', 'cuda'"),
    ({"train.steps": "many"}, "'train.steps' must be an integer, got 'many'"),
    ({"runtime.gradient_checkpointing": "some"}, "'runtime.gradient_checkpointing' = 'some' must be true, false or 'auto'"),
    ({"train.fp8_blocks": 0}, "'train.fp8_blocks' = 0 must be 'auto' or a number >= 1"),
]


def _demo(overrides: dict) -> object:
    return load_config(ROOT / "configs" / "demo.toml", overrides)


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[next(iter(o)) for o, _ in BAD_VALUES])
def test_a_bad_value_names_its_key_and_range(overrides, message):
    with pytest.raises(ConfigError) as e:
        _demo(overrides)
    assert message in str(e.value)
    assert str(e.value).startswith(str(ROOT / "configs" / "demo.toml"))


def test_type_and_value_errors_are_reported_together():
    """A type error used to hide every value error of the file (value checks were skipped)."""
    bad = {k: v for overrides, _ in BAD_VALUES for k, v in overrides.items() if k not in ("seed", "data.caption_ext")}
    with pytest.raises(ConfigError) as e:
        _demo({**bad, "seed": -1, "data.caption_ext": "txt"})
    listed = str(e.value).splitlines()[1:]
    for overrides, message in BAD_VALUES:
        key = next(iter(overrides))
        if key not in ("seed", "data.caption_ext", "data.bucket_step"):
            assert any(message in line for line in listed), message
    assert any("'data.bucket_step' = -16" in line for line in listed)
    assert len(listed) == len(set(listed)), "an error reported twice"


def test_the_family_check_hook_reports_with_the_rest(monkeypatch):
    """`stages.families.config_errors(cfg)` (a family's pixel multiple, token limits) joins the list."""
    import stages.families as families

    original = getattr(families, "config_errors", None)
    if original is not None:
        with pytest.raises(ConfigError, match=r"data\.bucket_step"):
            _demo({"data.bucket_step": 7})
    monkeypatch.setattr(families, "config_errors", lambda cfg: [f"'data.bucket_step' = {cfg.data.bucket_step} "
                                                                "is not a multiple of 16"], raising=False)
    with pytest.raises(ConfigError) as e:
        _demo({"data.bucket_step": 7, "data.max_aspect": 0.5})
    assert "is not a multiple of 16" in str(e.value) and "'data.max_aspect' = 0.5" in str(e.value)


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_every_shipped_config_loads(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths in a preset do not depend on the working directory
    cfg = load_config(ROOT / "configs" / preset)
    assert cfg.model and cfg.run
    assert Path(cfg.data.path).is_absolute() and Path(cfg.data.path).is_relative_to(ROOT)
    if preset.startswith("demo"):
        assert Path(cfg.model).parent == ROOT / "artifacts" / "demo-assets"
    else:
        assert not Path(cfg.model).is_absolute() and cfg.model.count("/") == 1  # a hub id stays a hub id


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "models" / "flux").mkdir(parents=True)
    (folder / "shared").mkdir()
    (folder / "shared" / "base.toml").write_text('model = "../models/flux"\n[data]\npath = "../images"\n')
    config = folder / "c.toml"
    config.write_text('model = "models/flux"\n[data]\npath = "images"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config)
    assert (cfg.model, cfg.data.path) == (str(folder / "models" / "flux"), str(folder / "images"))
    # the CLI's --set / --model stay relative to the working directory
    cfg = load_config(config, {"data.path": "elsewhere", "model": "models/flux"})
    assert (cfg.model, cfg.data.path) == ("models/flux", "elsewhere")
    # an included file's paths are relative to the included file
    (folder / "d.toml").write_text('include = "shared/base.toml"\nrun = "d"\n')
    cfg = load_config(folder / "d.toml")
    assert (cfg.model, cfg.data.path) == (str(folder / "models" / "flux"), str(folder / "images"))


def test_a_hub_id_in_a_file_stays_a_hub_id(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('model = "black-forest-labs/FLUX.1-dev"\n')
    assert load_config(config).model == "black-forest-labs/FLUX.1-dev"
    config.write_text('model = "./black-forest-labs/FLUX.1-dev"\n')  # explicitly a path
    assert load_config(config).model == str(tmp_path / "black-forest-labs" / "FLUX.1-dev")


def test_every_key_has_a_meaning_and_enumerated_keys_their_choices():
    rows = describe_keys()
    assert sorted(r[0] for r in rows) == sorted(all_keys())
    assert [r[0] for r in rows if not r[3].strip()] == []
    choices = {key: c for key, _, c, _ in rows}
    assert choices["train.lr_scheduler"].startswith("'constant' | 'constant_with_warmup'")
    assert choices["device"] == "'auto' | 'cpu' | 'cuda'"
    assert choices["seed"] == "in [0, 4294967295]" and choices["data.resolution"] == ">= 16"
    assert choices["runtime.gradient_checkpointing"] == "true | false | 'auto'"


def test_a_hub_id_without_network_fails_at_once(monkeypatch):
    """No HF_HUB_OFFLINE and no network: one short probe, not huggingface_hub's ~30-50 s of retries."""
    from stages.core import model_source

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("LORAPIPE_HUB_TIMEOUT", "3")
    monkeypatch.setattr(model_source, "_hub_problem", {})
    src = model_source.ModelSource("black-forest-labs/FLUX.1-dev")
    t0 = time.time()
    try:
        src.check(("vae",))
    except ModelError as e:
        assert time.time() - t0 < 10
        message = str(e)
        assert "cannot be reached" in message and "HF_HUB_OFFLINE=1" in message and "local diffusers folder" in message
        assert "`hf download black-forest-labs/FLUX.1-dev`" in message
    else:
        assert set(model_source._hub_problem.values()) == {""}  # a machine with network: the probe passed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src.check(("vae",))  # offline mode never probes: the library reads its cache


def test_machine_limits_are_resource_errors():
    import torch

    from stages.core.runtime import make_runtime, pick_device, require_cuda_for_nf4

    with pytest.raises(ResourceError, match="train.base_precision = 'nf4' needs a CUDA GPU"):
        require_cuda_for_nf4("train.base_precision", "nf4", make_runtime("cpu", "fp32"))
    if not torch.cuda.is_available():
        with pytest.raises(ResourceError, match="device = 'cuda' but torch sees no CUDA GPU"):
            pick_device("cuda")


def test_fp8_blocks_with_a_base_that_is_not_fp8_is_named():
    """A number of fp8 blocks means nothing for an nf4 or bf16 base: an error, not a setting silently ignored."""
    with pytest.raises(ConfigError, match=r"'train.fp8_blocks' = 16 applies to an fp8 base only, but "
                                          r"'train.base_precision' = 'nf4': set train.base_precision = 'fp8'"):
        _demo({"train.fp8_blocks": 16, "train.base_precision": "nf4"})
    assert _demo({"train.fp8_blocks": 16, "train.base_precision": "fp8"}).train.fp8_blocks == 16
