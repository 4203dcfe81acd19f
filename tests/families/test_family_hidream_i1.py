"""HiDream-I1 against its own diffusers pipeline (HiDreamImagePipeline), on the tiny real architecture.

    .venv/bin/python -m pytest tests/families/test_family_hidream_i1.py -q

- caption rows equal `encode_prompt`'s pooled CLIP projections, T5 states and every Llama layer's states
  (its tokenizers' lengths and padding, the CLIP cut at 218, Llama's pad = EOS);
- one training loss equals what the pipeline's own denoising step implies (timestep = sigma x 1000, the
  negated output, no packing) for a square and a non-square (padded) latent, in eval and training mode;
- training mode's routed experts pass gradients (eval mode's `moe_infer` runs under no_grad);
- the MoE path a compiled or graphed step runs equals the routed one without shapes that depend on the routing,
  and the trained denoiser's patch layout is diffusers', made once per shape;
- the timestep shift is the scheduler's; latent normalization; the blocks block swap and checkpointing see;
  ComfyUI's names; the config checks; sampling renders the asked size.
"""

from __future__ import annotations

import json

import diffusers
import pytest
import torch

import test_families_text as shared
from conftest import FAMILIES, tiny_model
from stages.core import comfyui
from stages.core.config import CaptionsConfig, TrainConfig
from stages.core.model_source import ModelSource
from stages.core.runtime import make_runtime
from stages.families import get_family
from test_families_text import CAPTIONS, _meta

CPU = make_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def hidream(assets):
    """(family, model folder, HiDreamImagePipeline loaded from it): the tuple the shared checks take."""
    folder = tiny_model(assets, FAMILIES["hidream-i1"])
    pipe = diffusers.HiDreamImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return get_family("hidream-i1"), folder, pipe


def _encode(family, folder, max_len: int) -> dict[str, torch.Tensor]:
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=max_len), CPU)
    return encoder.encode(CAPTIONS)


@pytest.mark.parametrize("max_len", [64, 12])  # 12 cuts the long caption in every encoder
def test_text_encoding_matches_pipeline(hidream, max_len):
    family, folder, pipe = hidream
    ours = _encode(family, folder, max_len)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False,
                                                        max_sequence_length=max_len)
    torch.testing.assert_close(ours["pooled"], pooled, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["t5"], t5, rtol=1e-6, atol=1e-6)
    assert llama.shape[0] == pipe.text_encoder_4.config.num_hidden_layers, "every layer after the embeddings"
    torch.testing.assert_close(ours["llama"], llama.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert ours["t5"].shape[1] == ours["llama"].shape[2] == max_len, "rows are padded: the transformer reads the padding"
    ids = pipe.tokenizer_4(CAPTIONS, padding="max_length", max_length=max_len, truncation=True).input_ids
    assert ids[0][-1] == pipe.tokenizer_4.eos_token_id, "the short caption is padded with Llama's EOS"


def test_token_counts_report_untruncated_length(hidream):
    family, folder, pipe = hidream
    encoder = family.load_text_encoder(ModelSource(str(folder)), CaptionsConfig(max_sequence_length=12), CPU)
    t5 = [len(ids) for ids in pipe.tokenizer_3(CAPTIONS).input_ids]
    llama = [len(ids) for ids in pipe.tokenizer_4(CAPTIONS).input_ids]
    assert encoder.token_counts(CAPTIONS) == [max(a, b) for a, b in zip(t5, llama)] and max(t5[1], llama[1]) > 12


def _pipeline_velocity(family, pipe, latents: torch.Tensor, sigma: float) -> torch.Tensor:
    """The velocity the pipeline steps with at `latents` (one Euler step to sigma = 0, no CFG):
    out = latents - sigma * v. Shift 1.0 keeps sigma as asked; the family's sample context keeps the size."""
    pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    _, _, h, w = latents.shape
    size = (w * pipe.vae_scale_factor, h * pipe.vae_scale_factor)
    with family.sample_context(size):
        out = pipe(list(CAPTIONS), height=size[1], width=size[0], num_inference_steps=1, sigmas=[sigma],
                   guidance_scale=1.0, latents=latents.clone(), max_sequence_length=64, output_type="latent").images
    assert float(pipe.scheduler.sigmas[0]) == pytest.approx(sigma)
    return (latents - out) / sigma


@pytest.mark.parametrize("hw", [(8, 8), (8, 6)])  # 8 x 6: non-square, padded to the transformer's max_seq
def test_training_loss_matches_pipeline_step(hidream, hw):
    """Our loss at (x0, noise, sigma) equals the MSE between noise - x0 and the velocity of the pipeline's step,
    with the denoiser in eval mode (the pipeline's) and in training mode (the routed experts' differentiable path
    and the per-token output layout)."""
    family, folder, pipe = hidream
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, *hw, generator=g)
    sigma = 0.6
    with torch.no_grad():
        velocity = _pipeline_velocity(family, pipe, latents, sigma)
        noise = torch.randn(latents.shape, generator=g)
        x0 = (latents - sigma * noise) / (1 - sigma)  # so that (1 - sigma) x0 + sigma noise = latents
        cond = _encode(family, folder, 64)
        t = torch.full((2,), sigma)
        ours = family.loss(pipe.transformer, x0, noise, t, cond, _meta(2, *hw), TrainConfig())
        pipe.transformer.train()
        try:
            trained = family.loss(pipe.transformer, x0, noise, t, cond, _meta(2, *hw), TrainConfig())
        finally:
            pipe.transformer.eval()
    expected = ((velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(trained, expected, rtol=1e-4, atol=1e-5)
    wrong_sign = ((-velocity - (noise - x0)) ** 2).flatten(1).mean(1)
    assert (wrong_sign - expected).abs().min() > 1e-3, "the check must tell the output's sign apart"


def test_routed_experts_pass_gradients_in_training_mode(hidream):
    """A MoE feed-forward in training mode computes what eval mode does, and its input gradient is the one of
    shared expert + the gate-weighted routed experts; eval mode's `moe_infer` (under no_grad) loses the routed
    part, which the blocks before it would then miss."""
    family, folder, pipe = hidream
    moe = pipe.transformer.double_stream_blocks[0].block.ff_i
    x = torch.randn(2, 24, moe.gate.gating_dim, generator=torch.Generator().manual_seed(2), requires_grad=True)
    r = torch.randn(2, 24, moe.gate.gating_dim, generator=torch.Generator().manual_seed(3))

    def output_and_grad(fn):
        x.grad = None
        y = fn(x)
        (y * r).sum().backward()
        return y.detach(), x.grad.clone()

    def reference(v: torch.Tensor) -> torch.Tensor:  # every token through its chosen experts, densely
        idx, weight, _ = moe.gate(v)
        flat, routed = v.reshape(-1, v.shape[-1]), 0
        for k in range(idx.shape[1]):
            outs = torch.stack([expert(flat) for expert in moe.experts], dim=1)  # (tokens, experts, D)
            routed = routed + weight[:, k:k + 1] * outs[torch.arange(len(flat)), idx[:, k]]
        return routed.reshape(v.shape) + moe.shared_experts(v)

    try:
        moe.train()
        trained = output_and_grad(moe)
    finally:
        moe.eval()
    inferred = output_and_grad(moe)
    expected = output_and_grad(reference)
    for got in (trained, inferred):
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trained[1], expected[1], rtol=1e-5, atol=1e-6)
    assert (inferred[1] - expected[1]).abs().max() > 1e-3, "eval mode's routed experts pass no gradient"


def _trained_moe(folder):
    model = get_family("hidream-i1").load_denoiser(ModelSource(str(folder)), "fp32", CPU, TrainConfig())
    return model.train(), model.single_stream_blocks[0].block.ff_i


def test_the_dense_moe_is_the_routed_one_without_routing_dependent_shapes(hidream):
    """`DenseRoutedMoE.dense` (every routed expert on every token, weighted by the router) gives the routed path's
    output and gradients, input's and router's; under fake tensors (shapes without data) it runs, where the routed
    path stops at its boolean-mask `nonzero`, the op whose size the host must read back, which a CUDA graph
    cannot capture."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    from stages.families.hidream_i1.denoiser import DenseRoutedMoE

    _, moe = _trained_moe(hidream[1])
    assert isinstance(moe, DenseRoutedMoE)
    moe.gate.weight.requires_grad_(True)  # frozen in training; its gradient shows the router's path
    x = torch.randn(2, 24, moe.gate.gating_dim, generator=torch.Generator().manual_seed(5), requires_grad=True)
    r = torch.randn(2, 24, moe.gate.gating_dim, generator=torch.Generator().manual_seed(6))

    def run(fn):
        x.grad, moe.gate.weight.grad = None, None
        y = fn(x)
        (y * r).sum().backward()
        return y.detach(), x.grad.clone(), moe.gate.weight.grad.clone()

    routed, dense = run(moe), run(moe.dense)  # eager: the module's forward is the routed path
    top2 = torch.topk(moe.gate.weight @ x.detach().reshape(-1, x.shape[-1]).T, 2, dim=0).indices
    assert len(top2.flatten().unique()) > 2, "the tokens must pick different experts"
    torch.testing.assert_close(dense[0], routed[0], rtol=0, atol=0)
    for got, want in zip(dense[1:], routed[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(x.detach())
        assert moe.dense(fake).shape == x.shape
        with pytest.raises(DynamicOutputShapeException, match="nonzero"):
            super(DenseRoutedMoE, moe).forward(fake)


def test_a_compiled_moe_traces_the_dense_path(hidream):
    """Compiled (dynamo tracing the block), the MoE's training forward is `dense`: its graph holds the top-k and
    the scattered weights, and its output is the eager routed one."""
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    _, moe = _trained_moe(hidream[1])
    x = torch.randn(2, 24, moe.gate.gating_dim, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eager = moe(x)
        compiled = torch.compile(moe, backend=record, fullgraph=True)(x)
    code = "\n".join(gm.code for gm in graphs)
    assert len(graphs) == 1 and "topk" in code and "scatter" in code and "stack" in code
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("hw", [(8, 8), (8, 6)])  # 8 x 6: padded to max_seq
def test_the_trained_denoisers_patches_are_diffusers_with_the_layout_made_once(hidream, hw):
    """The patches and the mask, image sizes and ids beside them equal diffusers' `patchify`; the second batch of
    a shape reuses the layout (diffusers makes its sizes by a host-to-device copy, which a CUDA graph cannot
    capture), with that batch's own patches."""
    model, _ = _trained_moe(hidream[1])
    g = torch.Generator().manual_seed(8)
    first, second = (torch.randn(2, 16, *hw, generator=g) for _ in range(2))
    ours = [model.patchify(first), model.patchify(second)]
    for got, x in zip(ours, (first, second)):
        want = diffusers.HiDreamImageTransformer2DModel.patchify(model, x)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for a, b in zip(got[1:], want[1:]):
            assert (a is None and b is None) or torch.equal(a, b)
    assert all(a is b for a, b in zip(ours[0][1:], ours[1][1:]))
    assert not torch.equal(ours[0][0], ours[1][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a CUDA graph capture)")
def test_a_cuda_graph_captures_the_training_forward(hidream):
    """The trained denoiser's training-mode forward captures into a CUDA graph (a device sync or host-to-device
    copy would stop the capture: the routed MoE's masks, diffusers' patchify), after one eager forward of the
    shape as the trainer runs before capturing; the replay gives the eager (routed) output."""
    family, folder, _ = hidream
    model, _ = _trained_moe(folder)
    model = model.cuda()
    cond = {k: v.cuda() for k, v in _encode(family, folder, 16).items()}
    g = torch.Generator().manual_seed(9)
    latents = torch.randn(2, 16, 8, 6, generator=g).cuda()
    args = dict(hidden_states=latents, timesteps=torch.tensor([300.0, 700.0], device="cuda"),
                encoder_hidden_states_t5=cond["t5"], encoder_hidden_states_llama3=cond["llama"].transpose(0, 1),
                pooled_embeds=cond["pooled"], return_dict=False)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        eager = model(**args)[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(**args)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = model(**args)[0]
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5)


def test_checkpointed_blocks_train_as_without_checkpointing(hidream):
    """Gradient checkpointing of the HiDreamBlocks (as the trainer turns it on) recomputes the same routing:
    equal loss and LoRA gradients in training mode, on a non-square (padded) batch."""
    family, folder, _ = hidream
    model, params = shared._lora_model(family, folder)
    model.train()
    cond = _encode(family, folder, 16)
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(2, 16, 8, 6, generator=g), torch.randn(2, 16, 8, 6, generator=g)
    t = torch.tensor([0.3, 0.8])

    shared.checkpointing_changes_nothing(family, model, params, x0, noise, t, cond, _meta(2, 8, 6))


def test_timesteps_are_the_schedulers_static_shift(hidream):
    family, folder, _ = hidream
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    assert scheduler.config.shift == 3.0 and not scheduler.config.use_dynamic_shifting
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 1000, 1000).tolist())
    tcfg = TrainConfig(timestep_density="uniform", shift=3.0)
    ours = family.sample_timesteps(64, (64, 48), torch.Generator().manual_seed(4), tcfg)
    u = torch.rand(64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, scheduler.sigmas[:-1][(u * 1000).long()].float(), rtol=1e-5, atol=1e-6)


def test_latent_normalization_as_pipeline_decodes(hidream):
    shared.test_latent_normalization_as_pipeline_decodes(hidream)


def test_blocks_for_checkpointing_swap_and_the_planner(hidream):
    """diffusers' class names no repeated blocks: the trained denoiser and the train planner's meta model do."""
    from stages.core import blockswap
    from stages.core.config import load_config
    from stages.core.memory.budget import Budget
    from stages.core.memory.train import plan
    from stages.demo import demo_config

    family, folder, pipe = hidream
    assert not blockswap.repeated_blocks(pipe.transformer)
    model = family.load_denoiser(ModelSource(str(folder)), "fp32", CPU, TrainConfig())
    assert blockswap.repeated_blocks(model) == [*model.double_stream_blocks, *model.single_stream_blocks]
    cfg = load_config(demo_config("hidream-i1"), {"model": str(folder)})
    assert plan(cfg, family, ModelSource(str(folder)), Budget(None, "cpu")).settings["blocks"] == 2


def test_comfyui_names_are_the_diffusers_paths(hidream):
    """ComfyUI's HiDream keeps the diffusers names and accepts `transformer.<name>` and `lycoris_<name>`."""
    family, folder, _ = hidream
    from test_comfyui_export import shapes_of

    config = json.loads((folder / "transformer" / "config.json").read_text())
    kmap = comfyui.key_map(family.comfyui_layout, shapes_of(folder, "hidream-i1"), config)
    name = "double_stream_blocks.0.block.attn1.to_q_t"
    for key in (f"transformer.{name}", f"lycoris_{name.replace('.', '_')}", f"diffusion_model.{name}"):
        assert kmap[key].weight == name and kmap[key].modules == (name,)
    shared_w2 = "single_stream_blocks.0.block.ff_i.shared_experts.w2"
    assert kmap[f"transformer.{shared_w2}"].weight == shared_w2


@pytest.mark.parametrize("overrides, wanted", [
    ({"captions.max_sequence_length": 513}, r"'captions.max_sequence_length' = 513 .*T5 reads at most 512"),
    ({"data.resolution": 1088}, r"'data.resolution' = 1088 is above hidream-i1's 1024"),
    ({"train.dynamic_shift": True}, r"'train.dynamic_shift' = true .*train.shift"),
])
def test_config_checks(overrides, wanted):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError
    from stages.demo import demo_config

    load_config(demo_config("hidream-i1"), {"model": "unused"})
    with pytest.raises(ConfigError, match=wanted):
        load_config(demo_config("hidream-i1"), {"model": "unused", **overrides})


def test_sample_renders_the_asked_size(hidream):
    """The pipeline renders at 1024 x 1024's area (the tiny: 256 x 256) whatever it is asked; the family's
    sample context renders the asked size, and leaves the pipeline as it was."""
    family, _, pipe = hidream
    with family.sample_context((48, 32)):
        image = pipe("a red circle", height=32, width=48, num_inference_steps=1, guidance_scale=1.0,
                     max_sequence_length=8).images[0]
    assert image.size == (48, 32) and pipe.default_sample_size == 128


def test_tiny_config_relations(hidream):
    _, _, pipe = hidream
    t = pipe.transformer.config
    assert t.caption_channels == [pipe.text_encoder_3.config.d_model, pipe.text_encoder_4.config.hidden_size]
    assert t.text_emb_dim == pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    assert len(t.llama_layers) == t.num_layers + t.num_single_layers
    assert max(t.llama_layers) < pipe.text_encoder_4.config.num_hidden_layers
    assert sum(t.axes_dims_rope) == t.attention_head_dim and t.in_channels == pipe.vae.config.latent_channels
    assert not pipe.vae.config.use_quant_conv and pipe.vae.config.shift_factor == pytest.approx(0.1159)
