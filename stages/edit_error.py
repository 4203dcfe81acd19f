"""How close an edit family's sample outputs come to the dataset's targets (the sample stage's `edit_error`).

    lorapipe sample --config configs/demo-flux-kontext.toml   # writes it into samples/manifest.json

For each column (base, checkpoints, LoRA) the mean squared error, over the sample rows and seeds,
between the latent the pipeline decoded into that cell's image and the row's target image encoded by
the same VAE, both normalized as training normalizes them. A random-weight demo VAE decodes any
latent to a noisy picture, so pixels would say little; the latents are what the denoiser makes.
The target and the control are resized to the sample size, as the sample stage passes the control.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

CONTROL = "control (unedited)"  # the reference row: the control's own latent, i.e. an output that edits nothing


@contextlib.contextmanager
def decoded_latents(vae: Any) -> Iterator[list[Any]]:
    """Records every latent the pipeline hands `vae.decode` (one per image it returns), on the CPU."""
    seen: list[Any] = []
    original = vae.decode

    def decode(z: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(z.detach().float().cpu())
        return original(z, *args, **kwargs)

    vae.decode = decode
    try:
        yield seen
    finally:
        del vae.decode  # the class's method again


def image_latent(pipe: Any, family: Any, image: Any, size: tuple[int, int]) -> Any:
    """`image` (PIL) resized to `size`, VAE-encoded (posterior mean), normalized; float32 on the CPU."""
    import numpy as np
    import torch
    from PIL import Image

    arr = np.asarray(image.convert("RGB").resize(size, Image.Resampling.LANCZOS), dtype=np.float32) / 127.5 - 1.0
    pixels = torch.from_numpy(arr).permute(2, 0, 1)[None]
    with torch.no_grad():
        mean, _ = family.encode_posterior(pipe.vae, pixels)
        return family.normalize_latents(mean.float().cpu(), family.latent_normalization(pipe.vae))


def normalized(family: Any, pipe: Any, decoded: Any, like: Any) -> Any:
    """A decoded latent (Qwen-Image's VAE gets a frame axis) as `like`'s shape, normalized."""
    return family.normalize_latents(decoded.reshape(like.shape), family.latent_normalization(pipe.vae))


def column_errors(pipe: Any, family: Any, labels: list[str], decoded: list[Any], targets: list[Path],
                  controls: list[Any], size: tuple[int, int], background: str, seeds: int) -> dict[str, float]:
    """{column label: mean latent MSE to the targets} for the rendered columns (`decoded` in render
    order: column, row, seed), plus CONTROL: the unedited control's own error."""
    from stages.core import image_io

    wanted = [image_latent(pipe, family, image_io.load_image(t, background), size) for t in targets]
    if len(decoded) != len(labels) * len(wanted) * seeds:
        raise RuntimeError(f"edit error: {len(decoded)} decoded latents for {len(labels)} columns x "
                           f"{len(wanted)} rows x {seeds} seeds (the pipeline decoded other than once per image)")
    out, per_column = {}, len(wanted) * seeds
    for c, label in enumerate(labels):
        cells = decoded[c * per_column:(c + 1) * per_column]
        errors = [float(((normalized(family, pipe, z, wanted[i // seeds]) - wanted[i // seeds]) ** 2).mean())
                  for i, z in enumerate(cells)]
        out[label] = sum(errors) / len(errors)
    copies = [float(((image_latent(pipe, family, c[0], size) - w) ** 2).mean()) for c, w in zip(controls, wanted)]
    out[CONTROL] = sum(copies) / len(copies)
    return {k: round(v, 6) for k, v in out.items()}


def closer_percent(errors: dict[str, float], final: str) -> float:
    """How much closer the final LoRA's outputs are to the targets than the base's: 100 (1 - lora / base)."""
    return round(100.0 * (1.0 - errors[final] / errors["base"]), 1)


def summary(errors: dict[str, float], final: str) -> str:
    """One line for the demo and the sample stage's log."""
    pct = closer_percent(errors, final)
    word = "closer to" if pct >= 0 else "further from"
    return (f"edit: LoRA output is {abs(pct):.1f}% {word} the targets than the base (latent MSE "
            f"{errors['base']:.4f} -> {errors[final]:.4f}; the unedited control: {errors[CONTROL]:.4f})")
