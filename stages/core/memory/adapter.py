"""What the trained adapter takes on the GPU during `train`, for the train planner: its parameters as peft makes
them (train.adapter, rank, rank_pattern), each with its fp32 weight, gradient and train.optimizer's state, the EMA
copy where train.ema_decay keeps it on the GPU, the memory one adapted layer's forward or backward makes for a
moment (DoRA's weight norm, LoHa's and LoKr's delta weight), and what DoRA keeps per token for the backward.

    adapter = adapter_memory(model, cfg.train, cfg.runtime, targets, blocks)
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from stages.core.lazy import lazy_module
from stages.core.memory import calibration as cal

torch = lazy_module("torch")


@dataclass(frozen=True)
class AdapterMemory:
    params: int  # trained parameters
    resident_bytes: int  # weights, gradients, optimizer state and EMA
    grads_bytes: int  # the fp32 gradients alone (a step allocates them anew)
    transient_bytes: int  # the largest adapted layer's forward/backward working memory beyond LoRA's
    block_saved_bytes_per_token: list[int]  # per repeated block: what the adapter keeps per token for the backward


def bytes_per_param(tcfg: Any, runtime: Any) -> int:
    """fp32 weight and gradient, the optimizer's state (calibration.OPTIMIZER_STATE_BYTES) and an fp32 EMA copy
    where it stays on the training device."""
    ema = 4 if tcfg.ema_decay and runtime.ema_device != "cpu" else 0
    return 8 + cal.OPTIMIZER_STATE_BYTES[tcfg.optimizer] + ema


def targeted_linears(model: torch.nn.Module, tcfg: Any, targets: list[str]) -> dict[str, tuple[torch.nn.Linear, int]]:
    """Module name -> (the Linear peft adapts, its rank), as peft matches train.target_modules and rank_pattern."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    from stages.core import lora

    config = lora.train_lora_config(tcfg, targets, dropout=0.0)
    return {name: (m, config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r))
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and check_target_module_exists(config, name)}


@functools.lru_cache(maxsize=256)
def _params_of_one(adapter: str, in_features: int, out_features: int, rank: int) -> int:
    """The parameters peft adds to one Linear of this shape: counted on a meta Linear, so every adapter type's
    own factorization (LoKr's Kronecker factors, LoHa's two products, DoRA's magnitude) is peft's."""
    from peft import inject_adapter_in_model

    from stages.core import lora

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # peft's initializers draw: planning must not
        one = torch.nn.Sequential(torch.nn.Linear(in_features, out_features))
        before = sum(p.numel() for p in one.parameters())
        inject_adapter_in_model(lora.lora_config(rank, rank, 0.0, ["0"], adapter), one)
    return sum(p.numel() for p in one.parameters()) - before


def transient_bytes(adapter: str, in_features: int, out_features: int) -> int:
    """The working memory one adapted layer makes beyond a LoRA layer's (calibration.ADAPTER_TRANSIENT_BYTES): DoRA
    builds its delta weight from an identity of in x in and takes the norm of weight + delta; LoHa and LoKr build
    their delta weight, and rebuild it for the backward."""
    per_weight, per_input_square = cal.ADAPTER_TRANSIENT_BYTES[adapter]
    return per_weight * in_features * out_features + per_input_square * in_features * in_features


def adapter_memory(model: torch.nn.Module, tcfg: Any, runtime: Any, targets: list[str],
                   blocks: list[torch.nn.Module]) -> AdapterMemory:
    layers = targeted_linears(model, tcfg, targets)
    shapes = Counter((m.in_features, m.out_features, rank) for m, rank in layers.values())
    params = sum(n * _params_of_one(tcfg.adapter, i, o, r) for (i, o, r), n in shapes.items())
    transient = max((transient_bytes(tcfg.adapter, i, o) for i, o, _ in shapes), default=0)
    saved = cal.ADAPTER_SAVED_BYTES_PER_TOKEN_OUT[tcfg.adapter]
    block_saved = [0] * len(blocks)
    if saved:
        names = {id(m): name for name, m in model.named_modules()}
        block_saved = [saved * sum(m.out_features for m, _ in (layers.get(names[id(sub)], (None, 0)) for sub in block.modules())
                                   if m is not None) for block in blocks]
    return AdapterMemory(params=params, resident_bytes=params * bytes_per_param(tcfg, runtime), grads_bytes=params * 4,
                         transient_bytes=transient, block_saved_bytes_per_token=block_saved)

