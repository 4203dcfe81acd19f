"""What the train planner counts for the trained adapter (stages/core/memory/adapter.py), against the real
libraries on the CPU: peft's own parameters for every adapter type and rank pattern, each optimizer's state
after real steps, and the working memory and saved activations of one adapted layer, measured by following
every tensor the forward and backward make (`LiveBytes`)."""

from __future__ import annotations

import copy
import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import FAMILIES, make_cfg, tiny_model
from stages.core import blockswap, lora, memory
from stages.core.config import RuntimeConfig, TrainConfig
from stages.core.memory import calibration as cal
from stages.core.memory.adapter import adapter_memory, bytes_per_param, transient_bytes
from stages.core.model_source import ModelSource
from stages.families import get_family

ADAPTERS = ("lora", "dora", "loha", "lokr")


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors alive that ops made inside the block (each storage once, freed when its last
    tensor goes), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view():
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self.seen:
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, n)
        return out


def _adapted_linear(kind: str, fan_in: int, fan_out: int, rank: int = 8) -> torch.nn.Module:
    """A bf16 Linear as a frozen base, with the adapter as train attaches it (fp32 adapter weights)."""
    from peft import inject_adapter_in_model

    torch.manual_seed(0)
    one = torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out)).to(torch.bfloat16).requires_grad_(False)
    inject_adapter_in_model(lora.lora_config(rank, rank, 0.0, ["0"], kind), one)
    for p in one.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return one


def _measure(kind: str, fan_in: int, fan_out: int, tokens: int) -> tuple[int, int]:
    """(bytes alive after the forward, peak bytes over forward and backward) of one adapted layer."""
    layer = _adapted_linear(kind, fan_in, fan_out)
    x = torch.randn(1, tokens, fan_in, dtype=torch.bfloat16)
    with LiveBytes() as seen:
        y = layer(x)
        saved = seen.live
        y.float().square().mean().backward()
        del y
    return saved, seen.peak


@pytest.mark.parametrize("family", ["flux", "sdxl"])
def test_adapter_parameters_are_what_peft_attaches(family, assets):
    """Every adapter type, with a rank pattern, on the tiny model of the real class: the planner's count is the
    number of parameters train's own attach creates."""
    fam = get_family(family)
    src = ModelSource(str(tiny_model(assets, FAMILIES[family])))
    targets = list(fam.default_lora_targets)
    pattern = {targets[-1]: 2}
    loaded = fam.load_denoiser(src, "fp32", _cpu(), TrainConfig())
    for kind in ADAPTERS:
        model = copy.deepcopy(loaded)
        tcfg = TrainConfig(adapter=kind, rank=4, alpha=4, rank_pattern=pattern)
        planned = adapter_memory(model, tcfg, RuntimeConfig(), targets, blockswap.repeated_blocks(model))
        params = lora.attach_lora(model, lora.lora_config(4, 4, 0.0, targets, kind, pattern))
        assert planned.params == sum(p.numel() for p in params) > 0, kind
        assert planned.grads_bytes == 4 * planned.params


def _cpu():
    from stages.core.runtime import make_runtime

    return make_runtime("cpu", "fp32")


@pytest.mark.parametrize("optimizer", sorted(cal.OPTIMIZER_STATE_BYTES))
def test_optimizer_state_per_parameter_is_what_the_library_keeps(optimizer):
    """After two real steps on adapter-shaped parameters, the optimizer's state tensors take at most the planned
    bytes per parameter, and not a byte less than one below it (a library that starts keeping more fails here)."""
    from stages.train.optimizers import make_optimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((16, 3072), (3072, 16), (16, 12288), (3072,))]
    tcfg = TrainConfig(optimizer=optimizer, lr_scheduler="constant", learning_rate=1.0 if "prodigy" in optimizer else 1e-4)
    opt = make_optimizer([(f"m{i}.lora_A", p) for i, p in enumerate(params)], tcfg, torch.device("cpu"))
    if hasattr(opt, "train"):  # schedule-free optimizers step in train mode
        opt.train()
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    own = {p.data_ptr() for p in params}
    state = {t.data_ptr(): t.numel() * t.element_size() for st in opt.state.values() for v in st.values()
             for t in (v if isinstance(v, (list, tuple)) else [v])
             if isinstance(t, torch.Tensor) and t.dim() and t.data_ptr() not in own}  # not the step counters
    measured = sum(state.values()) / sum(p.numel() for p in params)
    planned = cal.OPTIMIZER_STATE_BYTES[optimizer]
    assert measured <= planned < measured + 1, (optimizer, measured)
    assert bytes_per_param(tcfg, RuntimeConfig()) == 8 + planned


def test_an_ema_on_the_gpu_costs_an_fp32_copy_and_on_the_cpu_nothing():
    plain = bytes_per_param(TrainConfig(), RuntimeConfig())
    assert bytes_per_param(TrainConfig(ema_decay=0.999), RuntimeConfig()) == plain + 4
    assert bytes_per_param(TrainConfig(ema_decay=0.999), RuntimeConfig(ema_device="cpu")) == plain


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
@pytest.mark.parametrize("fan_in, fan_out", [(1024, 2048), (2048, 512)])
def test_one_adapted_layer_makes_at_most_its_planned_transient(kind, fan_in, fan_out):
    """Beyond a LoRA layer's own peak, the adapter's forward and backward make what the planner adds (DoRA's
    identity, delta weight and norm; LoHa's and LoKr's delta weights), planned within 25 % above it."""
    tokens = 32
    _, lora_peak = _measure("lora", fan_in, fan_out, tokens)
    _, peak = _measure(kind, fan_in, fan_out, tokens)
    extra = peak - lora_peak
    assert extra > 0.5 * fan_in * fan_out, "the adapter's delta weight is a weight-sized tensor"
    assert extra <= transient_bytes(kind, fan_in, fan_out) <= 1.25 * extra + 2 * fan_in * fan_out, (kind, extra)


def test_dora_keeps_at_most_its_planned_bytes_per_token_for_the_backward():
    tokens, fan_in, fan_out = 256, 512, 1024
    lora_saved, _ = _measure("lora", fan_in, fan_out, tokens)
    dora_saved, _ = _measure("dora", fan_in, fan_out, tokens)
    per_token_out = (dora_saved - lora_saved) / (tokens * fan_out)
    assert 1 <= per_token_out <= cal.ADAPTER_SAVED_BYTES_PER_TOKEN_OUT["dora"]


def test_the_train_plan_grows_by_what_the_adapter_takes(assets, demo_data, tmp_path):
    """The same run planned with DoRA, LoHa, Prodigy or an EMA on the GPU predicts a higher train peak than with
    LoRA and AdamW, by the adapter's own figures."""
    family = get_family("flux")
    base = make_cfg("flux", assets, demo_data, tmp_path, **{"train.rank": 1024})  # MBs: plans are rounded to 1 MB
    src = ModelSource(base.model)

    def peak(train=None, runtime=None) -> float:
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, **(train or {})),
                                  runtime=dataclasses.replace(base.runtime, **(runtime or {})))
        return memory.plan_train(cfg, family, src, memory.Budget(1000.0, "cap")).predicted_peak_gb * cal.GB

    model = memory.meta_component(src, family.denoiser_components[0])
    targets, blocks = base.train.target_modules or list(family.default_lora_targets), blockswap.repeated_blocks(model)
    lora_plan = adapter_memory(model, base.train, base.runtime, targets, blocks)
    plain = peak()
    with_prodigy = peak({"optimizer": "prodigy", "learning_rate": 1.0})
    assert with_prodigy - plain == pytest.approx(8 * lora_plan.params, rel=0.05)
    assert peak({"ema_decay": 0.99}) - plain == pytest.approx(4 * lora_plan.params, rel=0.05)
    assert peak({"ema_decay": 0.99}, {"ema_device": "cpu"}) == plain
    for kind in ("dora", "loha"):
        tcfg = dataclasses.replace(base.train, adapter=kind)
        adapter = adapter_memory(model, tcfg, base.runtime, targets, blocks)
        grown = peak({"adapter": kind}) - plain
        assert grown >= adapter.transient_bytes + adapter.resident_bytes - lora_plan.resident_bytes - 1e6, kind
