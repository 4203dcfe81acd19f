"""The optimizer and LR schedule of the `train` stage: train.optimizer, train.loraplus_ratio, lr_scheduler.

    optimizer = make_optimizer(named_params, tcfg, device); scheduler = make_scheduler(optimizer, tcfg)

adamw (torch, fused on CUDA), adamw8bit (bitsandbytes), prodigy (prodigyopt), prodigy_schedulefree
(prodigy-plus-schedule-free), adamw_schedulefree (schedulefree), adafactor (transformers). LoRA+ is two
parameter groups: the lora_B matrices at learning_rate x loraplus_ratio, the rest at learning_rate.

Schedule-free optimizers take their steps at one point (y) and evaluate at another (x, an average
of the iterates): `eval_weights` puts x into the parameters for validation and for every adapter
written, then puts y back bit for bit, so evaluating or saving never changes the run. A checkpoint
holds x as its adapter and y in its training state (`train_weights`), from which a resume continues.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator

import torch

from stages.core.config_values import PRODIGY, SCHEDULE_FREE

# Below this, train.learning_rate under prodigy reads as an AdamW LR (Prodigy's is a multiplier of ~1).
PRODIGY_LR_NOTE_BELOW = 0.1


def param_groups(named: list[tuple[str, torch.nn.Parameter]], tcfg: Any) -> list[Any]:
    """The trained parameters, or with train.loraplus_ratio two groups: the rest at learning_rate, the
    lora_B matrices at learning_rate x ratio (LoRA+; peft's create_loraplus_optimizer would also move
    every 1-D parameter, DoRA's magnitudes, to the fast group and drop train.weight_decay)."""
    if not tcfg.loraplus_ratio:
        return [p for _, p in named]
    fast = [p for name, p in named if "lora_B" in name.split(".")]
    slow = [p for name, p in named if "lora_B" not in name.split(".")]
    return [{"params": slow}, {"params": fast, "lr": tcfg.learning_rate * tcfg.loraplus_ratio}]


def make_optimizer(named: list[tuple[str, torch.nn.Parameter]], tcfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """train.optimizer over the adapter's (name, parameter) pairs. The libraries' own console lines
    (prodigyopt's "Using decoupled weight decay") are dropped: the train stage reports through its log."""
    groups = param_groups(named, tcfg)
    lr, betas, eps, decay = tcfg.learning_rate, (tcfg.adam_beta1, tcfg.adam_beta2), tcfg.adam_epsilon, tcfg.weight_decay
    kind = tcfg.optimizer
    with contextlib.redirect_stdout(io.StringIO()):
        if kind == "adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=decay, fused=device.type == "cuda")
        if kind == "adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps, weight_decay=decay)
        if kind == "prodigy":
            from prodigyopt import Prodigy

            # Bias correction on, as diffusers' advanced LoRA guide advises for diffusion LoRAs; safeguard_warmup
            # (the LR kept out of the step-size estimate's denominator) under an LR warmup, as prodigyopt's README advises.
            return Prodigy(groups, lr=lr, betas=betas, eps=eps, weight_decay=decay, decouple=True,
                           use_bias_correction=True, safeguard_warmup=tcfg.lr_warmup_steps > 0)
        if kind == "adafactor":
            from transformers.optimization import Adafactor

            # an external LR (our schedule) instead of Adafactor's relative step; no first moment (its memory saving)
            return Adafactor(groups, lr=lr, weight_decay=decay, relative_step=False, scale_parameter=False,
                             warmup_init=False)
        if kind == "adamw_schedulefree":
            from schedulefree import AdamWScheduleFree

            optimizer = AdamWScheduleFree(groups, lr=lr, betas=betas, eps=eps, weight_decay=decay,
                                          warmup_steps=tcfg.lr_warmup_steps)
        elif kind == "prodigy_schedulefree":
            from prodigyplus import ProdigyPlusScheduleFree

            optimizer = ProdigyPlusScheduleFree(groups, lr=lr, betas=betas, eps=eps, weight_decay=decay)
        else:
            raise ValueError(f"unknown train.optimizer {kind!r}")
    optimizer.train()  # schedule-free: the parameters hold y while training
    return optimizer


def make_scheduler(optimizer: torch.optim.Optimizer, tcfg: Any) -> Any:
    """diffusers' get_scheduler of train.lr_scheduler. adamw_schedulefree warms up inside the optimizer
    (its warmup_steps = train.lr_warmup_steps), so its schedule here is constant (no second warmup)."""
    from diffusers.optimization import get_scheduler

    name = "constant" if tcfg.optimizer == "adamw_schedulefree" else tcfg.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=tcfg.lr_warmup_steps,
                         num_training_steps=tcfg.steps, num_cycles=tcfg.lr_num_cycles, power=tcfg.lr_power)


def applied_lr(optimizer: torch.optim.Optimizer, scheduler: Any, tcfg: Any) -> float:
    """The LR the next step applies (of the first parameter group): Prodigy's estimate d x learning_rate,
    adamw_schedulefree's warmed-up LR, else the schedule's."""
    group = optimizer.param_groups[0]
    if tcfg.optimizer in PRODIGY:
        return float(group["d"] * group["lr"])
    if tcfg.optimizer == "adamw_schedulefree":
        k, warmup = group["k"], group["warmup_steps"]
        return group["lr"] * ((k + 1) / warmup if k < warmup else 1.0)
    return scheduler.get_last_lr()[0]


def notes(tcfg: Any) -> list[str]:
    """Info lines about settings that work but look unintended."""
    lr = tcfg.learning_rate
    if tcfg.optimizer in PRODIGY and lr < PRODIGY_LR_NOTE_BELOW:
        return [f"train.learning_rate = {lr:g} with train.optimizer = '{tcfg.optimizer}': Prodigy estimates its own "
                f"step size and multiplies it by learning_rate, so every step is {1 / lr:,.0f}x smaller than its "
                f"estimate; set train.learning_rate = 1.0 unless that is meant"]
    return []


def load_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(saved)`, keeping each state tensor's saved dtype: torch casts them to
    their parameter's dtype, which would turn prodigy_schedulefree's bf16 statistics into fp32 and change
    every step after a resume."""
    optimizer.load_state_dict(saved)
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        for index, param in zip(saved_group["params"], group["params"]):
            live = optimizer.state.get(param, {})
            for key, value in saved["state"].get(index, {}).items():
                current = live.get(key)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and current.dtype != value.dtype:
                    live[key] = value.to(current.device)


def is_schedule_free(tcfg: Any) -> bool:
    return tcfg.optimizer in SCHEDULE_FREE


@contextlib.contextmanager
def eval_weights(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], tcfg: Any) -> Iterator[None]:
    """Inside: the parameters a schedule-free optimizer evaluates and exports (x; `optimizer.eval()`).
    After: the exact training point (y) again, and train mode; eval() then train() alone would round y.
    Other optimizers: nothing changes."""
    if not is_schedule_free(tcfg):
        yield
        return
    train_point = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
        with torch.no_grad():
            for p, y in zip(params, train_point):
                p.copy_(y)
