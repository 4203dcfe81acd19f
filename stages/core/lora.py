"""Denoiser loading (dense or nf4) and the LoRA adapter: attach, save, load. Family-agnostic.

The adapter folder (lora/final, lora/checkpoint-N) holds `adapter_model.safetensors` with peft's
state-dict keys (no `base_model.model.` prefix) and `adapter_config.json` (LoraConfig.to_dict()),
which export-lora turns into diffusers' LoRA file with the config in its metadata; with
train.ema_decay > 0 also `ema_model.safetensors`, the EMA of the weights under the same keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

from stages.core.errors import ConfigError
from stages.core.lazy import lazy_module, no_grad

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def load_denoiser_weights(cls: Any, src: Any, subfolder: str, precision: str, rt: Any, double_quant: bool) -> torch.nn.Module:
    """`cls.from_pretrained` in bf16/fp32, or nf4 through diffusers' bitsandbytes integration (quantized
    block by block from host memory when `rt` is a HostLoad whose plan swaps blocks), or fp8 (its first
    `rt.fp8_blocks` blocks only when `rt` is a MixedLoad, the rest nf4)."""
    from stages.core.runtime import has_accelerate, require_cuda_for_nf4

    if precision == "fp8":  # e4m3 base weights (stages/core/fp8.py); a MixedLoad's first blocks only, the rest nf4
        from stages.core.fp8 import load_fp8_denoiser, load_fp8_nf4

        if getattr(rt, "fp8_blocks", None) is not None:
            return load_fp8_nf4(cls, src, subfolder, rt.device, rt.fp8_blocks, double_quant)
        return load_fp8_denoiser(cls, src, subfolder, rt.device)
    if precision == "nf4" and getattr(rt, "swapped_blocks", 0):  # a HostLoad: blocks will be swapped
        from stages.core.nf4_blocks import load_nf4_by_block

        return load_nf4_by_block(cls, src, subfolder, rt.target, rt.swapped_blocks, double_quant, rt.swap_layout)
    kwargs: dict[str, Any] = {"torch_dtype": rt.dtype}
    require_cuda_for_nf4("train.base_precision", precision, rt)
    if precision != "nf4" and rt.is_cuda and has_accelerate():
        kwargs["device_map"] = {"": rt.device}  # weights go straight to the GPU (no CPU copy of 24 GB)
    if precision == "nf4":
        from stages.core.nf4_blocks import nf4_config

        kwargs["quantization_config"] = nf4_config(double_quant)
    model = src.load(cls, subfolder, **kwargs)
    if precision != "nf4":
        model.to(rt.device)
    model.requires_grad_(False)
    return model


def lora_config(rank: int, alpha: float, dropout: float, targets: list[str] | tuple[str, ...], adapter: str = "lora",
                rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, float] | None = None) -> Any:
    """The peft config of train.adapter: LoRA (gaussian A, zero B), DoRA (LoRA plus a learned
    magnitude per output), LoKr (Kronecker product) or LoHa (Hadamard product of two low-rank
    products); each starts as a zero delta. Patterns give some modules their own rank and alpha."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    common: dict[str, Any] = dict(r=rank, target_modules=list(targets), rank_pattern=dict(rank_pattern or {}),
                                  alpha_pattern=dict(alpha_pattern or {}))
    if adapter in ("lora", "dora"):
        return LoraConfig(lora_alpha=alpha, lora_dropout=dropout, init_lora_weights="gaussian",
                          use_dora=adapter == "dora", **common)
    if adapter in ("lokr", "loha"):
        return (LoKrConfig if adapter == "lokr" else LoHaConfig)(alpha=alpha, module_dropout=dropout, **common)
    raise ValueError(f"unknown adapter type {adapter!r}")


def train_lora_config(tcfg: Any, default_targets: Sequence[str], dropout: float | None = None) -> Any:
    """The peft config train attaches for `tcfg`: train.adapter at train.rank and train.alpha, on
    train.target_modules (else `default_targets`, the family's), with train.rank_pattern and alpha_pattern;
    `dropout` in place of train.dropout (0.0 where only the parameters matter)."""
    return lora_config(tcfg.rank, tcfg.alpha, tcfg.dropout if dropout is None else dropout,
                       list(tcfg.target_modules or default_targets), tcfg.adapter, tcfg.rank_pattern, tcfg.alpha_pattern)


def adapter_type(config: dict[str, Any]) -> str:
    """lora | dora | lokr | loha, from a saved adapter config (adapter_config.json)."""
    kind = str(getattr(config.get("peft_type"), "value", config.get("peft_type") or "LORA")).lower()
    return "dora" if kind == "lora" and config.get("use_dora") else kind


def base_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the frozen base computes in, which the families cast the denoiser's inputs to: its
    first frozen floating-point parameter's. Not diffusers' `model.dtype`, the first floating parameter
    of any kind: with bias-free quantized first layers (FLUX.2 klein in nf4) that is an fp32 adapter
    weight, and every nf4 matmul then ran in fp32 (TF32), 2.1x slower than diffusers' own klein script
    on the H200 (bench/results/peers-klein-1024-b1.json). fp8 weights are buffers, nf4 codes uint8. The modules
    diffusers keeps in fp32 (`_keep_in_fp32_modules`: Wan's scale_shift_table, its first parameter) are passed over."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if p.is_floating_point() and not p.requires_grad and not keep & set(name.split(".")):
            return p.dtype
    return model.dtype


def attach_lora(model: torch.nn.Module, config: Any) -> list[torch.nn.Parameter]:
    """Add the adapter (diffusers' PeftAdapterMixin) and return its parameters, cast to fp32."""
    model.add_adapter(config)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError(f"LoRA target modules {config.target_modules} matched no layer of {type(model).__name__}; "
                           f"check train.target_modules")
    for p in params:
        p.data = p.data.float()  # fp32 master weights for the adapter, as diffusers' cast_training_params
    return params


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(model: torch.nn.Module, config: Any, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(model), str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config_dict(config), indent=2, sort_keys=True))


def config_dict(config: Any) -> dict[str, Any]:
    d = config.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


def load_adapter_files(folder: Path, weights: str = ADAPTER_WEIGHTS) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    return load_file(str(folder / weights)), json.loads((folder / ADAPTER_CONFIG).read_text())


def load_adapter_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy a saved adapter into a model that already has the same adapter attached."""
    from peft.utils import set_peft_model_state_dict

    state, _ = load_adapter_files(folder)
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise RuntimeError(f"adapter in '{folder}' has keys this model lacks: {unexpected[:5]}")


# ---- EMA of the adapter weights (train.ema_decay) ----------------------------------------------

EMA_WEIGHTS = "ema_model.safetensors"


class AdapterEMA:
    """ema = decay * ema + (1 - decay) * weights, per adapter parameter, after every optimizer step.
    Starts from the initial adapter (no bias correction); fp32, on `device` (the training device,
    or the CPU to keep GPU memory free)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, device: str):
        self.params, self.decay = params, decay
        self.device = params[0].device if device == "auto" else torch.device(device)
        self.shadow = [p.detach().to(self.device, torch.float32, copy=True) for p in params]

    @no_grad
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().to(self.device, torch.float32), 1.0 - self.decay)

    def state(self) -> list[torch.Tensor]:
        return self.shadow

    def load(self, state: list[torch.Tensor]) -> None:
        if len(state) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(state, self.shadow)):
            raise ValueError("the checkpoint's EMA does not match this adapter's parameters")
        self.shadow = [t.to(self.device, torch.float32).clone() for t in state]

    @no_grad
    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The EMA under the adapter's own state-dict keys: the weights are swapped in, read, swapped back."""
        saved = [p.data for p in self.params]
        try:
            for p, s in zip(self.params, self.shadow):
                p.data = s.to(p.device)
            return adapter_state_dict(model)
        finally:
            for p, d in zip(self.params, saved):
                p.data = d


def save_ema(model: torch.nn.Module, ema: AdapterEMA, folder: Path) -> None:
    from safetensors.torch import save_file

    save_file(ema.state_dict(model), str(folder / EMA_WEIGHTS))


# ---- train.preservation: the base model's own prediction ----------------------------------------

@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The model as its frozen base: every peft adapter layer's disable flag set (no LoRA delta, no LoRA
    dropout, so no random number drawn), restored after. For no-grad forwards only."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag


# ---- train.assistant_adapter: a LoRA merged into the base for training only -----------------------

ASSISTANT = "assistant"  # its peft adapter name while it is being merged


def assistant_file(path: str) -> Path:
    """The assistant LoRA's .safetensors: the path itself, or the one .safetensors file in that folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.safetensors"))
        if len(found) != 1:
            raise ConfigError(f"train.assistant_adapter = '{path}' is a folder with {len(found)} .safetensors files: "
                              f"name the diffusers LoRA file itself")
        return found[0]
    if not p.is_file() or p.suffix != ".safetensors":
        raise ConfigError(f"train.assistant_adapter = '{path}' is not a .safetensors file or a folder holding one: "
                          f"give a diffusers LoRA file, or set it to \"\"")
    return p


def assistant_identity(path: str) -> dict[str, str] | None:
    """{path, sha256} of train.assistant_adapter for the fingerprint and the manifest; None when unset."""
    if not path:
        return None
    file = assistant_file(path)
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return {"path": str(file), "sha256": digest.hexdigest()}


def merge_assistant(model: torch.nn.Module, path: str, prefix: str, precision: str) -> int:
    """Merge a diffusers LoRA file (keys '<prefix>.<module>.lora_A/B.weight', alpha from its header as
    diffusers writes it) into the frozen base's weights through diffusers' own loader, and remove its
    layers: the base then computes base + delta, and the trained adapter is attached on top of it.
    Returns the number of modules merged. A quantized base (nf4, fp8) cannot take the deltas: refused."""
    if precision in ("nf4", "fp8"):
        raise ConfigError(f"train.assistant_adapter is merged into the base weights, which a {precision} base cannot "
                          f"take: set train.base_precision = 'bf16' (or clear train.assistant_adapter)")
    file = assistant_file(path)
    model.load_lora_adapter(str(file.parent), weight_name=file.name, prefix=prefix, adapter_name=ASSISTANT)
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = sum(isinstance(m, BaseTunerLayer) for m in model.modules())
    if not merged:
        raise ConfigError(f"train.assistant_adapter '{file}' matched no module of {type(model).__name__} under the "
                          f"'{prefix}.' prefix: is it a LoRA of this model family?")
    model.fuse_lora(adapter_names=[ASSISTANT])
    model.unload_lora()  # the fused weights stay in the base layers; the LoRA layers go
    model.requires_grad_(False)
    return merged
