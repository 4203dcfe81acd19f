"""Hand-set weights that the edit demos' tiny models share (FLUX.1 Kontext's "flux-kontext-edit",
Qwen-Image-Edit-Plus's "qwen-image-edit-edit"): an MMDiT whose base reproduces the control, so the
LoRA has an edit to learn, and the conv-weight helpers with which each family sets its VAE to a
near-exact 2x2 pixel-unshuffle.

How a VAE stays linear through its nonlinear layers: every signal travels as a (+x, -x) channel pair
beside a (+C, -C) constant pair, and the residual branches are zero. A normalization over channels
then divides by a fixed multiple of C (to within (x / C)^2; GroupNorm also subtracts a mean of
exactly 0), and SiLU's odd part is exact: silu(d) - silu(-d) = d.

The transformer (`copy_transformer`): the residual stream holds the 64 token channels and a (+C, -C)
pair (LayerNorm then only divides by a fixed C / sqrt(d / 2) and subtracts the channel mean, which a
zero channel reads back); the double block's attention routes each target token to the control token
at its place (constant query and key, RoPE decides) and subtracts its latent; the timestep embedding
carries 100 + 1 / sigma (in SiLU's linear range) into norm_out's scale. So the model predicts
v = (x_t - control) / sigma: the sampler lands on the control, as a trained edit model does for an
edit it does not know. Beside the stream, the control's pixels feed a random-feature MLP whose zero
output layer the LoRA learns: the edit. FLUX.1 and Qwen-Image lay out these parts alike (joint
attention [text, image], RoPE pairs (id0, row, col) with the control one frame later, AdaLN gates in
the order shift, scale, gate), so only the modules' names differ (`MMDiTParts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKEN_CONST = 100.0  # the transformer's constant pair: LayerNorm's std is C / 8 to within ~0.3 %
PIXEL_TOKEN = 48  # a packed token's channels that carry pixels: 12 latent channels x 2 x 2
MLP_GAIN = 50.0  # LayerNorm divides the control's pixels by 12.5: the MLP's first layer x 50
ROUTE = 400.0  # attention logit scale per RoPE pair weight: 900 at the match, >= 9 lower at any other token
HEADS = 8  # x 16 = inner width 128: above a 2x2-packed token's 64 channels (at 32 it cannot carry its input)


def clear(module: Any) -> None:
    for p in module.parameters():
        p.zero_()


def _pairs(conv: Any, out_first: int, weight: Any, tap: tuple[int, ...]) -> None:
    """Out channels out_first + 2j (+) and + 2j + 1 (-) get `weight[j]` (a row over in-channels) at `tap`
    (the kernel index: (row, col) for a 2-D conv, (frame, row, col) for a 3-D one)."""
    for j, row in enumerate(weight):
        conv.weight[(out_first + 2 * j, slice(None), *tap)] = row
        conv.weight[(out_first + 2 * j + 1, slice(None), *tap)] = -row


def _pass_pair(conv: Any, channel: int, from_channel: int, tap: tuple[int, ...]) -> None:
    """Channels `channel`, +1 take the pair at `from_channel`, +1 through at `tap`."""
    conv.weight[(channel, from_channel, *tap)] = 1.0
    conv.weight[(channel + 1, from_channel + 1, *tap)] = 1.0


def pairs_in(conv: Any, weight: Any, tap: tuple[int, ...], const: float) -> None:
    """A VAE half's conv_in: out pair j = (+, -) `weight[j]` (a row over in-channels) at `tap`, then the
    constant pair (+C, -C) from the bias right after the len(weight) signal pairs; nothing else."""
    clear(conv)
    _pairs(conv, 0, weight, tap)
    c = 2 * len(weight)
    conv.bias[c], conv.bias[c + 1] = const, -const


def unshuffle_conv(conv: Any, colours: int = 3) -> None:
    """A stride-2 conv whose kernel tap (a, b) reads sub-pixel (a, b): out pair k * 4 + a * 2 + b
    (torch's pixel_unshuffle order) from colour pair k; the constant pair (after the colours) passes on
    after the 4 x colours pairs."""
    clear(conv)
    for k in range(colours):
        for a in range(2):
            for b in range(2):
                s = 2 * (k * 4 + a * 2 + b)
                conv.weight[s, 2 * k, a, b] = 1.0
                conv.weight[s + 1, 2 * k + 1, a, b] = 1.0
    _pass_pair(conv, 8 * colours, 2 * colours, (0, 0))


def average_conv(conv: Any, colours: int = 3) -> None:
    """After a nearest x2 upsample, colour pair k is the mean of its 4 sub-pixel pairs (centre tap); the
    constant pair (after the 4 x colours pairs) passes on after the colours."""
    clear(conv)
    for k in range(colours):
        for sub in range(4):
            conv.weight[2 * k, 2 * (k * 4 + sub), 1, 1] = 0.25
            conv.weight[2 * k + 1, 2 * (k * 4 + sub) + 1, 1, 1] = 0.25
    _pass_pair(conv, 2 * colours, 8 * colours, (1, 1))


def pair_differences(conv: Any, n: int, gain: float, tap: tuple[int, ...]) -> None:
    """A VAE half's conv_out: out channel j = gain x (in 2j - in 2j + 1) at `tap` (SiLU's odd part gives
    the signal back from its pair), j < n; nothing else."""
    clear(conv)
    for j in range(n):
        conv.weight[(j, 2 * j, *tap)] = gain
        conv.weight[(j, 2 * j + 1, *tap)] = -gain


def inverse_sigma_weights() -> Any:
    """Weights w over the 256 sinusoidal features of the timestep (diffusers' Timesteps(256) of
    1000 sigma) with w . features ~ 1 / sigma: least squares on sigma in [0, 1] (1 / sigma capped at
    50, relative error weighted), features up to 120 rad only so float32 timesteps stay exact enough.
    Relative error at most 4.7 % for sigma >= 0.05 (rcond 1e-4 keeps |w| at 72, so float32 sums agree
    batched and single to ~1e-5; rcond 1e-6 fits to 1.3 % but |w| is 1400)."""
    import math

    import torch
    from diffusers.models.embeddings import get_timestep_embedding

    s = torch.linspace(0.0, 1.0, 8001, dtype=torch.float64)
    features = get_timestep_embedding(s * 1000, 256, flip_sin_to_cos=True, downscale_freq_shift=0).double()
    freqs = 1000 * torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float64) / 128)
    keep = torch.cat([freqs <= 120, freqs <= 120])
    target = torch.clamp(1 / s.clamp_min(1e-9), max=50.0)
    w = torch.zeros(256, dtype=torch.float64)
    w[keep] = torch.linalg.lstsq(features[:, keep] / target[:, None], torch.ones_like(s), rcond=1e-4,
                                 driver="gelsd").solution
    return w.float()


def rope_query_key(heads: int) -> tuple[Any, Any]:
    """One head's query and key (16 dims, RoPE pairs: id0 x2, row x3, col x3) whose rotated score is
    highest for the key token at the query's (row, col) with id0 one more: a target token attends
    to the control token at its own place. Logits: ~`ROUTE` at the match, >= 20 lower elsewhere."""
    import math

    import torch

    q, k = torch.zeros(16), torch.zeros(16)
    amp = {0: 2.0, 2: 0.0, 4: 1.0, 6: 1.5, 8: 1.0, 10: 1.0, 12: 1.5, 14: 1.0}  # pair start -> weight
    for i, a in amp.items():
        k[i], q[i] = math.sqrt(ROUTE * a), math.sqrt(ROUTE * a)
    # id0 pair (frequency 1): the query turned by +1 rad, so the score peaks at id0_k = id0_q + 1
    q[0], q[1] = math.sqrt(ROUTE * 2.0) * math.cos(1.0), math.sqrt(ROUTE * 2.0) * math.sin(1.0)
    return q.repeat(heads), k.repeat(heads)


@dataclass
class MMDiTParts:
    """The modules of a one-double-block MMDiT that `copy_transformer` sets, by their family's names."""

    inner_dim: int
    embedder: Any  # Linear: packed token (64) -> stream
    timestep: Any  # TimestepEmbedding (linear_1, linear_2) of the 256 sinusoidal features
    image_modulation: Any  # Linear: temb -> the image stream's shift, scale, gate (attention) and (MLP)
    text_modulation: Any  # Linear: the same for the text stream
    attn: Any  # the joint Attention (to_q/to_k/to_v with norm_q/norm_k, add_k_proj, to_out)
    mlp: Any  # the image stream's FeedForward (net[0].proj, net[2])
    norm_out: Any  # AdaLayerNormContinuous's Linear: temb -> scale, shift
    proj_out: Any  # Linear: stream -> packed token (64)
    silenced: tuple[Any, ...] = ()  # further modules that must add nothing (zeroed)


def copy_transformer(parts: MMDiTParts) -> None:
    """Sets the modules in `parts` (see the module docstring) so that the model predicts the velocity
    that lands on the control: v = (x_t - control) / sigma per target token."""
    import torch

    d, p = parts.inner_dim, parts
    big, zero_ch = TOKEN_CONST, d - 1
    std = big * (2 / d) ** 0.5  # LayerNorm's std over the d channels, the pair dominating
    with torch.no_grad():
        for lin in (p.timestep.linear_2, *p.silenced):
            clear(lin)
        p.timestep.linear_1.weight[0] = inverse_sigma_weights()
        p.timestep.linear_1.bias[0] = 100.0
        p.timestep.linear_2.weight[0, 0] = 1.0  # temb[0] = 100 + 1 / sigma, the rest 0
        clear(p.embedder)
        p.embedder.weight[:64, :64] = torch.eye(64)
        p.embedder.bias[64], p.embedder.bias[65] = big, -big
        for norm in (p.image_modulation, p.text_modulation):
            clear(norm)
        p.image_modulation.bias[2 * d:3 * d] = 1.0  # gate_msa 1
        p.image_modulation.bias[5 * d:] = 1.0  # gate_mlp 1 (its output layer is 0)
        at = p.attn
        q, k = rope_query_key(d // 16)
        for lin, vec, norm in ((at.to_q, q, at.norm_q), (at.to_k, k, at.norm_k)):
            clear(lin)
            lin.bias.copy_(vec)
            norm.weight.copy_(vec[:16].pow(2).mean().sqrt())  # RMSNorm gives the vector back
        clear(at.add_k_proj)  # text keys 0: logit 0 against ~ROUTE
        clear(at.to_v)
        for j in range(64):
            at.to_v.weight[j, j], at.to_v.weight[j, zero_ch] = std, -std  # the control's latent
        clear(at.to_out[0])
        at.to_out[0].weight[:64, :64] = -torch.eye(64)  # x_t - control
        at.to_out[0].weight[66:66 + PIXEL_TOKEN, :PIXEL_TOKEN] = torch.eye(PIXEL_TOKEN)  # and the control's pixels beside
        ff_in = p.mlp.net[0].proj.weight
        ff_in[:, :66] = 0.0  # the MLP reads only the control's pixels: random features of the colours there
        ff_in[:, 66 + PIXEL_TOKEN:] = 0.0
        ff_in *= MLP_GAIN  # pre-activations of std ~1 (GELU's bend), the constant pair not amplified
        clear(p.mlp.net[2])  # ... which the LoRA learns to read out: the edit
        clear(p.norm_out)
        p.norm_out.weight[:d, 0] = 1.0
        p.norm_out.bias[:d] = -101.0  # 1 + scale = 1 / sigma, shift 0
        clear(p.proj_out)
        for j in range(64):
            p.proj_out.weight[j, j], p.proj_out.weight[j, zero_ch] = std, -std
