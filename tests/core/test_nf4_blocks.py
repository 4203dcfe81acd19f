"""An nf4 base quantized block by block for block swap (stages/core/nf4_blocks.py) is diffusers' nf4 model.

    .venv/bin/python -m pytest -q tests/core/test_nf4_blocks.py

diffusers' own nf4 load refuses to start without a GPU (its quantizer's `validate_environment`), yet
bitsandbytes 0.50 quantizes and runs nf4 on the CPU. So the reference here is diffusers' real
`from_pretrained(quantization_config=...)` load with only that environment check lifted, on CPU,
and the block-by-block model must equal it: the same quantized modules, the same state dict (codes,
absmax, double-quant state) bit for bit, and the same loss and LoRA gradients with blocks swapped.
The product refuses nf4 on CPU (runtime.require_cuda_for_nf4); the training tests lift that guard
to run the real nf4 + swap path here. The same comparison on the GPU is in tests/stages/test_trainer_paths.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import FAMILIES, make_cfg, tiny_model
from stages.core import blockswap, fastpath, lora, memory, nf4_blocks
from stages.core.model_source import ModelSource
from stages.families import get_family
from stages.core.caches import lora_dir


def _diffusers_nf4(src: ModelSource, cls, monkeypatch) -> torch.nn.Module:
    """diffusers' nf4 load on CPU: its GPU check lifted, nothing else changed."""
    from diffusers.quantizers.bitsandbytes.bnb_quantizer import BnB4BitDiffusersQuantizer

    monkeypatch.setattr(BnB4BitDiffusersQuantizer, "validate_environment", lambda self, *a, **k: None)
    return src.load(cls, "transformer", torch_dtype=torch.bfloat16, quantization_config=nf4_blocks.nf4_config(True),
                    device_map={"": "cpu"})


def _denoiser_class(family: str):
    import diffusers

    return getattr(diffusers, get_family(family).denoiser_class)


@pytest.mark.parametrize("family", [f for f in ("flux", "krea2") if f in FAMILIES])
def test_block_by_block_equals_diffusers_nf4_load(family, assets, monkeypatch):
    """Same Linear4bit modules (Krea 2 keeps its `_keep_in_fp32_modules` norms dense, as diffusers
    does), same state dict bit for bit, same model attributes that peft and diffusers read."""
    import bitsandbytes as bnb

    src, cls = ModelSource(str(tiny_model(assets, FAMILIES[family]))), _denoiser_class(family)
    ref = _diffusers_nf4(src, cls, monkeypatch)
    mine = nf4_blocks.load_nf4_by_block(cls, src, "transformer", torch.device("cpu"), 2, True)
    quantized = lambda m: {n for n, x in m.named_modules() if isinstance(x, bnb.nn.Linear4bit)}  # noqa: E731
    assert quantized(mine) == quantized(ref) and quantized(ref)
    dense = {n for n, x in mine.named_modules() if type(x) is torch.nn.Linear}
    assert dense == {n for n, x in ref.named_modules() if type(x) is torch.nn.Linear}
    keep = cls._keep_in_fp32_modules or []
    assert all(any(k in n.split(".") for k in keep) for n in dense)  # only what diffusers keeps stays dense
    want, got = ref.state_dict(), mine.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert mine.is_loaded_in_4bit and mine.is_quantized and type(mine.hf_quantizer) is type(ref.hf_quantizer)
    assert mine.config["_pre_quantization_dtype"] == ref.config["_pre_quantization_dtype"]


def _inputs(family_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    cfg = family_model.config
    g = torch.Generator().manual_seed(1)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(-1, 3)
    b = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    return {"hidden_states": b(2, 16, cfg.in_channels), "encoder_hidden_states": b(2, 5, cfg.joint_attention_dim),
            "pooled_projections": b(2, cfg.pooled_projection_dim), "timestep": torch.tensor([0.3, 0.8]),
            "guidance": torch.tensor([1.0, 1.0]), "img_ids": ids, "txt_ids": torch.zeros(5, 3)}


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**_inputs(model), return_dict=False)[0]
    loss = (out.float() ** 2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _with_lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    lora.attach_lora(model, lora.lora_config(4, 4.0, 0.0, ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]))
    model.enable_gradient_checkpointing()
    return model.train()


@pytest.mark.parametrize("checkpoint", ["diffusers", "product"])
def test_swapped_block_by_block_nf4_trains_as_diffusers_nf4(assets, monkeypatch, checkpoint):
    """peft wraps the block-by-block layers with its bnb LoRA layer, and with the last blocks swapped
    (real copies of the quantized weights per call) loss and LoRA gradients equal diffusers' nf4
    model's bit for bit; the blocks chosen for the host are the ones block swap takes. Under the
    product's checkpoint function the swapped blocks run from the swap's slots (Params4bit views
    carrying their quant_state); under diffusers' own, from copies of their own."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    src, cls = ModelSource(str(tiny_model(assets, FAMILIES["flux"]))), _denoiser_class("flux")
    ref = _with_lora(_diffusers_nf4(src, cls, monkeypatch))
    loss_ref, grads_ref = _loss_and_grads(ref)
    n = 1  # of the tiny FLUX's 2 blocks: one swapped, one resident
    model = _with_lora(nf4_blocks.load_nf4_by_block(cls, src, "transformer", torch.device("cpu"), n, True))
    if checkpoint == "product":
        model.enable_gradient_checkpointing(fastpath.checkpoint_function(0.0))
    assert isinstance(model.transformer_blocks[0].attn.to_q, LoraLinear4bit)
    host = [m for m, to_host in nf4_blocks._groups(model, n) if to_host]
    swap = blockswap.install_block_swap(model, n, torch.device("cpu"))
    assert [b for b in swap.blocks] == [mods[0] for mods in host]
    fresh, own_copies = [], swap.fresh_copies
    swap.fresh_copies = lambda block: fresh.append(block) or own_copies(block)
    loss, grads = _loss_and_grads(model)
    # forward, then the recompute of checkpointing, which finds the product's slot still holding the block
    assert swap.copies == (1 if checkpoint == "product" else 2 * n)
    assert len(fresh) == (0 if checkpoint == "product" else 2 * n)
    views = [v for v in swap._views[0].values() if blockswap.quantized(v)]
    assert views and all(v.quant_state is p.quant_state for v, p in
                         zip(views, [p for p in swap.host[id(swap.blocks[0])].values() if blockswap.quantized(p)]))
    assert torch.equal(loss, loss_ref) and grads.keys() == grads_ref.keys() and grads
    for k in grads:
        assert torch.equal(grads[k], grads_ref[k]), k


def _wide_flux(assets, tmp_path) -> str:
    """The tiny FLUX's configs, 12 blocks 2048 wide (weights outweigh activations, as in the real
    model); planning reads configs only, so no weights are made."""
    import json

    src = tiny_model(assets, FAMILIES["flux"])
    folder = tmp_path / "wide-flux"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text((src / "model_index.json").read_text())
    config = json.loads((src / "transformer" / "config.json").read_text())
    config.update(num_layers=4, num_single_layers=8, num_attention_heads=2048 // config["attention_head_dim"])
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_planner_swaps_nf4_below_the_whole_nf4_size(assets, demo_data, tmp_path, monkeypatch):
    """Before: an nf4 plan never predicted less than the whole nf4 base (diffusers quantizes it on
    the GPU whole). With block-by-block loading a swap plan predicts resident blocks + two in flight,
    and the planner still tries the whole model before swapping any block."""
    from test_memory import _just_above, _peak_of, _plan

    monkeypatch.setattr(memory.calibration, "SWAP_EXTRA_GB", 0.0)  # an absolute margin: larger than the tiny model itself
    cfg = make_cfg("flux", assets, demo_data, tmp_path, **{"train.base_precision": "nf4", "data.resolution": 256,
                                                            "model": _wide_flux(assets, tmp_path)})
    roomy = _plan("train", cfg, 1000.0)
    assert roomy.settings["swapped_blocks"] == 0
    swaps = [t["swapped_blocks"] for t in roomy.tried]
    assert swaps.index(1) > max(i for i, s in enumerate(swaps) if s == 0)  # whole first, then swap
    src = ModelSource(cfg.model)
    model = memory.meta_component(src, "transformer")
    whole_nf4 = memory.weight_bytes(model, "nf4") / memory.GB
    deepest = _peak_of(roomy, swapped_blocks=roomy.settings["blocks"])
    assert deepest < whole_nf4  # the old floor would have kept it >= the whole nf4 base
    tight = _plan("train", cfg, _just_above(deepest))
    assert tight.fits and tight.settings["base_precision"] == "nf4" and tight.settings["swapped_blocks"] > 0
    assert tight.predicted_peak_gb * memory.FRAGMENTATION < whole_nf4 and "host memory" not in tight.note
    # too little host memory for the bf16 read: `plan` says so in the swap plan's note, before anything runs
    monkeypatch.setattr(memory.budget, "host_available_bytes", lambda: int(0.5 * tight.settings["host_gb"] * memory.GB))
    short = _plan("train", cfg, _just_above(deepest))
    assert short.settings == tight.settings and short.note.endswith(memory.host_shortfall(short))
    assert "host memory" in short.note and "--vram" in short.note
    unswapped = _peak_of(roomy, swapped_blocks=0, gradient_checkpointing=True)
    assert unswapped >= whole_nf4  # the unswapped nf4 plan keeps diffusers' floor


def test_load_device_routes_swapped_nf4_to_the_block_loader(assets):
    from stages.core.runtime import HostLoad, Runtime

    rt = Runtime(torch.device("cpu"), torch.bfloat16)
    plan = lambda **s: memory.StagePlan("train", memory.Budget(8.0, "cap"), s, 1.0, True)  # noqa: E731
    assert memory.load_device(plan(base_precision="nf4", swapped_blocks=0), rt) is rt  # diffusers' loader as before
    host = memory.load_device(plan(base_precision="nf4", swapped_blocks=3), rt)
    assert isinstance(host, HostLoad) and host.device.type == "cpu" and host.swapped_blocks == 3 and host.target == rt.device
    src = ModelSource(str(tiny_model(assets, FAMILIES["flux"])))
    model = lora.load_denoiser_weights(_denoiser_class("flux"), src, "transformer", "nf4", host, True)
    assert model.is_loaded_in_4bit and all(not p.requires_grad for p in model.parameters())


def _force_swap(monkeypatch, n: int) -> None:
    """A plan that swaps `n` blocks of an nf4 base, on CPU (which has no budget to plan for), with
    the CPU nf4 guard lifted: the trainer then loads, swaps and trains through the real code."""
    from stages.train import trainer

    def plan_stage(cfg, family, stage, log):
        plan = memory.StagePlan(stage, memory.Budget(None, "cpu"), {"base_precision": "nf4", "swapped_blocks": n,
                                "gradient_checkpointing": True, "blocks": 2}, 0.0, True)
        log.emit("plan", **plan.to_dict())
        return memory.with_plan(cfg, plan), plan

    monkeypatch.setattr(memory, "plan_stage", plan_stage)
    monkeypatch.setattr(trainer, "require_cuda_for_nf4", lambda *a: None)


def test_nf4_swap_training_resumes_bit_identically(assets, demo_data, tmp_path_factory, monkeypatch):
    from safetensors.torch import load_file

    from stages import cache_latents, encode_captions, train
    from test_trainer_paths import _cfg, _trainer

    cached = make_cfg("flux", assets, demo_data, tmp_path_factory.mktemp("nf4-swap"), **{"run": "nf4swap"})
    encode_captions.run(cached)
    cache_latents.run(cached)
    _force_swap(monkeypatch, 1)
    sets = {"train.steps": 4, "runtime.checkpoint_every": 2, "train.base_precision": "nf4"}
    straight = train.run(_cfg(cached, **sets))
    swap = straight["runtime"]["block_swap"]  # one swapped block: copied once, then found in its slot every fetch
    assert swap["swapped_blocks"] == 1 and swap["copies"] == 1 and straight["runtime"]["cuda_alloc_retries"] == 0
    want = load_file(str(lora_dir(cached) / "final" / "adapter_model.safetensors"))
    cfg = _cfg(cached, **sets)
    tr = _trainer(cfg)
    assert tr.swap is not None and len(tr.swap.blocks) == 1 and tr.model.is_loaded_in_4bit
    for _ in range(2):
        tr.step()
    tr.save_checkpoint(2)
    del tr
    resumed = train.run(cfg, resume=True)
    got = load_file(str(lora_dir(cfg) / "final" / "adapter_model.safetensors"))
    assert straight["step"] == resumed["step"] == 4
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nf4_base_computes_in_bf16_under_fp32_adapters(family, assets):
    """The dtype each family casts the denoiser's inputs to is the frozen base's (bf16), not diffusers'
    `model.dtype`: with bias-free quantized first layers (FLUX.2 klein) that is an fp32 adapter weight,
    and every nf4 matmul ran in fp32: 2.1x slower than diffusers' klein script on the H200."""
    from peft import LoraConfig

    fam = get_family(family)
    src = ModelSource(str(tiny_model(assets, FAMILIES[family])))
    model = nf4_blocks.load_nf4_by_block(_denoiser_class(family), src, fam.denoiser_components[0],
                                         torch.device("cpu"), 0, False)
    lora.attach_lora(model, LoraConfig(r=4, lora_alpha=4, target_modules=list(fam.default_lora_targets)))
    assert lora.base_dtype(model) == torch.bfloat16
    if family == "flux2-klein":
        assert model.dtype == torch.float32  # the trap: the first floating parameter is an adapter's


def test_klein_nf4_layers_see_bf16_inputs(assets):
    """FLUX.2 klein's loss feeds its nf4 layers bf16 activations (a forward pre-hook on every Linear4bit)."""
    import bitsandbytes as bnb
    from peft import LoraConfig

    from stages.core.config import TrainConfig
    from stages.families.base import BatchMeta

    fam = get_family("flux2-klein")
    src = ModelSource(str(tiny_model(assets, FAMILIES["flux2-klein"])))
    model = nf4_blocks.load_nf4_by_block(_denoiser_class("flux2-klein"), src, "transformer", torch.device("cpu"), 0, False)
    lora.attach_lora(model, LoraConfig(r=4, lora_alpha=4, target_modules=list(fam.default_lora_targets)))
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.register_forward_pre_hook(lambda mod, args: seen.add(args[0].dtype))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, model.config.in_channels // 4, 8, 8, generator=g)
    cond = {"prompt_embeds": torch.randn(1, 6, model.config.joint_attention_dim, generator=g)}
    size = torch.tensor([[64, 64]])
    meta = BatchMeta(original_size=size, crop_top_left=torch.zeros_like(size), target_size=size)
    loss = fam.loss(model, x0, torch.randn(x0.shape, generator=g), torch.tensor([0.5]), cond, meta, TrainConfig())
    loss.backward()
    assert seen == {torch.bfloat16}
