"""Value checks of a typed Config: every key's valid range, checked before any stage deletes or loads.

    from stages.core.config_values import value_errors
    problems = value_errors(cfg)     # [] when every value is usable; each message names its key

`stages.core.config.build_config` runs these after the type checks and reports both kinds together.
A value that failed its type check is left at its (valid) default here, so it is reported once.
"""

from __future__ import annotations

import difflib
import os
from typing import Any


# train.optimizer values that estimate their own step size / that train at y and export the average x
PRODIGY = ("prodigy", "prodigy_schedulefree")
SCHEDULE_FREE = ("adamw_schedulefree", "prodigy_schedulefree")

# Keys whose values are not one type (checked in value_errors), as `pipeline.py keys` states them.
FORMS = {"runtime.gradient_checkpointing": "true | false | 'auto'", "train.fp8_blocks": "'auto' | a number >= 1"}


def value_errors(cfg: Any, ranges: dict[str, Any]) -> list[str]:
    """Every value of `cfg` outside its valid range or form, each message naming the key and the fix."""
    errors = [f"'{key}' = {cfg.section(key)!r} must be {valid}" for key, valid in ranges.items()
              if cfg.section(key) not in valid]
    errors += [f"'sample.seeds[{i}]' = {seed!r} must be {ranges['seed']}"
               for i, seed in enumerate(cfg.sample.seeds) if seed not in ranges["seed"]]
    if not isinstance(cfg.runtime.gradient_checkpointing, bool) and cfg.runtime.gradient_checkpointing != "auto":
        errors.append(f"'runtime.gradient_checkpointing' = {cfg.runtime.gradient_checkpointing!r} must be true, false or "
                      f"'auto' (the planner checkpoints as few blocks as the GPU budget allows)")
    fp8_blocks = cfg.train.fp8_blocks
    if fp8_blocks != "auto" and (isinstance(fp8_blocks, bool) or not isinstance(fp8_blocks, int) or fp8_blocks < 1):
        errors.append(f"'train.fp8_blocks' = {fp8_blocks!r} must be 'auto' or a number >= 1 (how many of the first "
                      f"repeated blocks of an fp8 base stay fp8; the rest are nf4)")
    elif fp8_blocks != "auto" and cfg.train.base_precision not in ("fp8", "auto"):
        errors.append(f"'train.fp8_blocks' = {fp8_blocks} applies to an fp8 base only, but 'train.base_precision' = "
                      f"{cfg.train.base_precision!r}: set train.base_precision = 'fp8' (or 'auto'), or remove train.fp8_blocks")
    if cfg.gpu.vram_budget_gb != "auto" and not cfg.gpu.vram_budget_gb > 0:
        errors.append(f"'gpu.vram_budget_gb' = {cfg.gpu.vram_budget_gb!r} must be 'auto' or > 0 GB")
    return errors + _data_errors(cfg.data) + _datasets_errors(cfg, ranges) + _name_errors(cfg) + _train_errors(cfg) + \
        _validation_errors(cfg) + _family_errors(cfg)


def _validation_errors(cfg: Any) -> list[str]:
    v = cfg.validation
    held = bool(v.path) or v.split > 0
    if v.path and v.split > 0:
        return [f"'validation.path' = {v.path!r} and 'validation.split' = {v.split} both choose the held-out items: "
                f"set one of them"]
    trained = {os.path.abspath(d.path) for d in cfg.dataset_configs() if d.path}
    if v.path and os.path.abspath(v.path) in trained:
        return [f"'validation.path' = {v.path!r} is a folder the run trains on (data.path or a [[datasets]] path): "
                f"held-out images must not be trained on; use another folder, or validation.split"]
    if held and not v.every_n_steps:
        return ["'validation.every_n_steps' = 0 but held-out items are set (validation.path or validation.split): "
                "set validation.every_n_steps (e.g. 50)"]
    if v.every_n_steps and not held:
        return [f"'validation.every_n_steps' = {v.every_n_steps} but no held-out items: set validation.path (a folder "
                f"like data.path) or validation.split (e.g. 0.1)"]
    return []


def _data_errors(data: Any, where: str = "data", given: Any = None) -> list[str]:
    """[data]'s checks, or with `where` = 'datasets[i]' those of one [[datasets]] table (`given`: its keys)."""
    from PIL import ImageColor

    errors = []
    if where == "data":
        try:
            ImageColor.getrgb(data.background)
        except ValueError:
            errors.append(f"'data.background' = {data.background!r} is not a colour: use a name such as 'white' or "
                          f"'black', or '#rrggbb'")
    ext = data.caption_ext
    if (given is None or "caption_ext" in given) and (not ext.startswith(".") or len(ext) < 2 or "/" in ext):
        hint = f"did you mean '.{ext}'?" if ext.isalnum() else "e.g. '.txt'"
        errors.append(f"'{where}.caption_ext' = {ext!r} must be a file extension starting with a dot: {hint}")
    if data.bucket_step > data.resolution and (given is None or "resolution" in given):
        errors.append(f"'data.bucket_step' = {data.bucket_step} is larger than '{where}.resolution' = {data.resolution}: "
                      f"no bucket fits; use 0 (the family's own step) or a smaller step")
    if data.repeats != 1 and data.weight > 0:
        errors.append(f"'{where}.repeats' = {data.repeats} and '{where}.weight' = {data.weight} are both set: give "
                      f"repeats (whole times per epoch) or weight (fractional repeats), not both")
    if data.keep_tokens > 0 and not data.shuffle_tags and (given is None or {"keep_tokens", "shuffle_tags"} & set(given)):
        errors.append(f"'{where}.keep_tokens' = {data.keep_tokens} keeps tags in place while shuffling, but "
                      f"'{where}.shuffle_tags' is false: set shuffle_tags = true, or keep_tokens = 0")
    return errors


def _datasets_errors(cfg: Any, ranges: dict[str, Any]) -> list[str]:
    """Each [[datasets]] table's values, checked as the [data] keys they stand in for, named by table."""
    errors = []
    for i, (table, data) in enumerate(zip(cfg.datasets, cfg.dataset_configs())):
        where = f"datasets[{i}]"
        errors += [f"'{where}.{k}' = {v!r} must be {ranges['data.' + k]}" for k, v in table.items()
                   if f"data.{k}" in ranges and v not in ranges[f"data.{k}"]]
        errors += _data_errors(data, where, table)
    return errors


def _train_errors(cfg: Any) -> list[str]:
    import re

    t, errors = cfg.train, []
    for name, low in (("rank_pattern", 1), ("alpha_pattern", 0)):
        for pattern, value in getattr(t, name).items():
            try:
                re.compile(pattern)
            except re.error as e:
                errors.append(f"'train.{name}' key {pattern!r} is not a regular expression ({e})")
            if not (value >= 1 if low else value > 0):
                errors.append(f"'train.{name}.{pattern}' = {value!r} must be {'>= 1' if low else '> 0'}")
    if t.adapter == "dora" and cfg.export.format == "kohya":
        errors.append("'export.format' = 'kohya' with 'train.adapter' = 'dora': DoRA has no kohya form here; use "
                      "export.format = 'diffusers' (diffusers' load_lora_weights reads DoRA)")
    if cfg.runtime.ema_device == "cuda" and cfg.device == "cpu":
        errors.append("'runtime.ema_device' = 'cuda' but 'device' = 'cpu': use 'auto' or 'cpu', or train on cuda")
    if cfg.runtime.ema_device != "auto" and t.ema_decay == 0:
        errors.append(f"'runtime.ema_device' = {cfg.runtime.ema_device!r} but 'train.ema_decay' = 0 (EMA off): set "
                      f"train.ema_decay (e.g. 0.999) or leave runtime.ema_device at 'auto'")
    roles = [d.role for d in cfg.dataset_configs()]
    if t.preservation == "dataset" and "regularization" not in roles:
        errors.append("'train.preservation' = 'dataset' but no [[datasets]] table has role = 'regularization': add "
                      "one (its images' captions are what the base model's predictions are kept for)")
    if t.preservation != "dataset" and "regularization" in roles:
        errors.append(f"a [[datasets]] table has role = 'regularization' but 'train.preservation' = "
                      f"{t.preservation!r}: set train.preservation = 'dataset' (or role = 'train')")
    if t.preservation == "dataset" and set(roles) == {"regularization"}:
        errors.append("every [[datasets]] table has role = 'regularization': nothing would be learned; give the "
                      "training images role = 'train'")
    if t.timestep_min >= t.timestep_max:
        errors.append(f"'train.timestep_min' = {t.timestep_min} is not below 'train.timestep_max' = {t.timestep_max}: "
                      f"set a range such as 0.0 and 1.0")
    return errors + _optimizer_errors(t)


def _optimizer_errors(t: Any) -> list[str]:
    """Combinations of train.optimizer with other keys that make no sense, each with the fix."""
    errors, opt = [], t.optimizer
    if opt in SCHEDULE_FREE and t.lr_scheduler not in ("constant", "constant_with_warmup"):
        errors.append(f"'train.lr_scheduler' = {t.lr_scheduler!r} with 'train.optimizer' = {opt!r}: a schedule-free "
                      f"optimizer replaces the LR schedule; set train.lr_scheduler = 'constant' (train.lr_warmup_steps "
                      f"still warms up), or use optimizer 'adamw'/'prodigy' for a schedule")
    if opt in SCHEDULE_FREE and t.ema_decay > 0:
        errors.append(f"'train.ema_decay' = {t.ema_decay} with 'train.optimizer' = {opt!r}: a schedule-free optimizer "
                      f"already exports an average of its iterates; set train.ema_decay = 0")
    if opt == "prodigy_schedulefree" and t.max_grad_norm > 0:
        errors.append(f"'train.max_grad_norm' = {t.max_grad_norm} with 'train.optimizer' = 'prodigy_schedulefree': "
                      f"clipping upsets its step-size estimate (its update is already RMS-scaled); set "
                      f"train.max_grad_norm = 0")
    if t.loraplus_ratio > 0 and t.adapter not in ("lora", "dora"):
        errors.append(f"'train.loraplus_ratio' = {t.loraplus_ratio} with 'train.adapter' = {t.adapter!r}: LoRA+ "
                      f"scales the lora_B matrices, which only lora and dora have; set train.loraplus_ratio = 0")
    return errors


def _name_errors(cfg: Any) -> list[str]:
    from stages.families import FAMILIES

    errors = []
    if cfg.family not in FAMILIES:
        close = difflib.get_close_matches(str(cfg.family), FAMILIES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        errors.append(f"'family' = {cfg.family!r} is not a family: {hint}one of {', '.join(sorted(FAMILIES))}")
    if not cfg.run or "/" in cfg.run or cfg.run.startswith("."):
        errors.append(f"'run' = {cfg.run!r} must be a plain folder name")
    if not cfg.model:
        errors.append("'model' is empty: set it to a diffusers pipeline folder or a hub id")
    if not cfg.artifacts:
        errors.append("'artifacts' is empty: set it to the folder that holds the runs (default 'artifacts')")
    errors += [f"'train.target_modules[{i}]' is empty: give a module name such as 'to_q'"
               for i, name in enumerate(cfg.train.target_modules) if not name.strip()]
    return errors


def _family_errors(cfg: Any) -> list[str]:
    """The family's own limits (pixel multiple of data.bucket_step, token limits):
    `stages.families.config_errors(cfg)` where the registry provides it."""
    import stages.families as families
    from stages.core.errors import UserError

    check = getattr(families, "config_errors", None)
    if check is None or cfg.family not in families.FAMILIES or not cfg.model:
        return []
    try:
        # each limit holds for this family: the message names it as a key, so that a `family` given on the command
        # line is the origin config_errors shows (stages.core.config.config_errors)
        return [f"{e} ('family' = {cfg.family!r})" for e in check(cfg)]
    except UserError as e:  # e.g. the model folder it reads the VAE config from does not exist
        return [str(e)]
