"""qwen-image-edit-2511 against diffusers' QwenImageEditPlusPipeline with a `zero_cond_t` transformer: the
training loss is the pipeline's transformer call (target tokens then the control's, `img_shapes` in that
order, timestep sigma), which the transformer turns into timestep-0 modulation of the control tokens; the
same weights without the flag (the qwen-image-edit family's model) give another loss."""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch

from stages.core.events import EventLog
from stages.families import get_family, pipeline_class
from stages.train.trainer import Trainer

QWEN_2511 = pytest.mark.parametrize("built_run", ["qwen-image-edit-2511"], indirect=True)


def _pipeline_prediction(transformer, pipe, x0, noise, t, control, text, bucket):
    """The prediction QwenImageEditPlusPipeline.__call__ makes at sigma t (target tokens) and its flow-matching loss."""
    (bw, bh), (h, w), (ch, cw) = bucket[:2], x0.shape[-2:], control.shape[-2:]
    latents = pipe._pack_latents((1 - t) * x0 + t * noise, 1, 16, h, w)
    with torch.no_grad():
        pred = transformer(
            hidden_states=torch.cat([latents, pipe._pack_latents(control, 1, 16, ch, cw)], dim=1), timestep=t,
            guidance=None, encoder_hidden_states_mask=None, encoder_hidden_states=text,
            img_shapes=[[(1, h // 2, w // 2), (1, ch // 2, cw // 2)]], return_dict=False)[0][:, : latents.size(1)]
    return pred, ((pipe._unpack_latents(pred, bh, bw, pipe.vae_scale_factor)[:, :, 0] - (noise - x0)) ** 2).mean()


@QWEN_2511
def test_loss_is_the_pipelines_zero_cond_t_call_and_the_flag_changes_it(built_run):
    cfg = built_run
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    trainer.setup_model()
    pair, batch = trainer.data.pairs[2], trainer.data.load([2], [0])
    family, pipe = trainer.family, pipeline_class(trainer.family).from_pretrained(cfg.model)
    assert pipe.transformer.config.zero_cond_t and trainer.model.config.zero_cond_t
    x0 = family.normalize_latents(batch.mean, trainer.norm)
    control = family.normalize_latents(batch.controls[0][0], trainer.norm)
    text = batch.cond["prompt_embeds"][:, : int(batch.cond["prompt_length"][0])]
    g = torch.Generator().manual_seed(0)
    noise, t = torch.randn(x0.shape, generator=g), torch.tensor([0.6])
    with torch.no_grad():
        ours = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)
        # the caption rounded up to the stored length (runtime.caption_tokens_multiple), its padding masked
        assert text.shape[1] < batch.cond["prompt_embeds"].shape[1]
        trainer.cfg.runtime.caption_tokens_multiple = batch.cond["prompt_embeds"].shape[1]
        rounded = trainer.compute_loss(batch, torch.zeros_like(batch.mean), noise, t)
    pred, theirs = _pipeline_prediction(pipe.transformer, pipe, x0, noise, t, control, text, pair.bucket)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rounded, theirs, rtol=1e-5, atol=1e-6)

    # the plain edit family's model: the same weights, the flag off (every token modulated at t)
    init = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    plain = diffusers.QwenImageTransformer2DModel(**{**init, "zero_cond_t": False})
    plain.load_state_dict(pipe.transformer.state_dict())
    plain.eval()
    with torch.no_grad():
        meta = dataclasses.replace(batch.meta, controls=trainer.control_latents(batch))
        edit = get_family("qwen-image-edit").loss(plain, x0, noise, t, batch.cond, meta, cfg.train)
    plain_pred, plain_loss = _pipeline_prediction(plain, pipe, x0, noise, t, control, text, pair.bucket)
    torch.testing.assert_close(edit.mean(), plain_loss, rtol=1e-5, atol=1e-6)
    # the controls' timestep-0 modulation reaches the target tokens' prediction (the tiny random model's
    # modulation weights are small: ~2e-3 of it, far above the 1e-6 of float32 rounding) ...
    change = float((pred - plain_pred).abs().max() / plain_pred.abs().max())
    assert change > 1e-4, change
    # ... and it is all the flag does: at timestep 0 every token has the modulation of timestep 0 either way
    zero = torch.tensor([0.0])
    at_zero = [_pipeline_prediction(m, pipe, x0, noise, zero, control, text, pair.bucket)[0] for m in (pipe.transformer, plain)]
    torch.testing.assert_close(at_zero[0], at_zero[1], rtol=1e-5, atol=1e-6)  # float32 rounding of a batch of 2
    assert abs(float(edit.mean()) - float(ours)) > 1e-6, (float(edit.mean()), float(ours))


def test_tiny_models_share_the_edit_familys_weights_with_the_flag_set():
    """The tests' tiny 2511 transformer is qwen-image-edit's with only `zero_cond_t` changed (as small)."""
    from stages.tiny.models import build_tiny_components

    edit = build_tiny_components("qwen-image-edit")["transformer"]
    flagged = build_tiny_components("qwen-image-edit-2511")["transformer"]
    assert flagged.config.zero_cond_t and not edit.config.zero_cond_t
    def rest(config):
        return {k: v for k, v in config.items() if k != "zero_cond_t" and not k.startswith("_")}

    assert rest(flagged.config) == rest(edit.config)
    a, b = edit.state_dict(), flagged.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@QWEN_2511
def test_the_trained_class_is_the_stock_forward_with_its_modulation_index_built_once(built_run, monkeypatch):
    """train loads the transformer as ZeroCondTrainable: its forward gives the stock forward's prediction and
    gradients, with and without gradient checkpointing, and builds its modulation index once per layout (the
    stock forward builds it from Python numbers on every call, a copy a CUDA graph's capture refuses)."""
    from stages.families.qwen_image_edit_2511.denoiser import ZeroCondTrainable

    cfg = built_run
    trainer = Trainer(cfg, EventLog(cfg.run_dir, cfg.run, "test", enabled=False))
    trainer.setup_model()
    assert isinstance(trainer.model, ZeroCondTrainable)
    ours = ZeroCondTrainable.from_pretrained(cfg.model, subfolder="transformer")
    stock = diffusers.QwenImageTransformer2DModel.from_pretrained(cfg.model, subfolder="transformer")
    g = torch.Generator().manual_seed(0)
    shapes = [[(1, 2, 2), (1, 2, 2)], [(1, 2, 2), (1, 2, 2)]]
    inputs = {"hidden_states": torch.randn(2, 8, ours.config.in_channels, generator=g),
              "encoder_hidden_states": torch.randn(2, 5, ours.config.joint_attention_dim, generator=g),
              "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool),
              "timestep": torch.tensor([0.3, 0.8]), "img_shapes": shapes, "guidance": None, "return_dict": False}
    for checkpointing in (False, True):
        grads = []
        for model in (ours, stock):
            model.zero_grad()
            model.enable_gradient_checkpointing() if checkpointing else model.disable_gradient_checkpointing()
            out = model(**inputs)[0]
            out.square().mean().backward()
            grads.append((out.detach(), model.img_in.weight.grad.clone()))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), checkpointing
    made = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or tensor(*a, **k))
    with torch.no_grad():
        ours(**inputs)
    assert made == [], "the index is reused"
