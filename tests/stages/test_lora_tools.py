"""`lorapipe lora merge|resize|extract|posthoc-ema` (stages/tools) on the tiny FLUX.1 model.

The expected results are computed here independently of the tools: dense deltas, their SVD by
torch.linalg.svd, and the power-function EMA by its step-by-step update.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import pipeline
from conftest import FAMILIES, library_lines, make_cfg, tiny_model
from stages.core.caches import lora_dir

FAMILY = "flux"
MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.proj_out")


@pytest.fixture(scope="module")
def model(assets) -> Path:
    return tiny_model(assets, FAMILIES[FAMILY])


@pytest.fixture(scope="module")
def shapes(model) -> dict[str, tuple[int, int]]:
    from stages.tools.lora_checks import denoiser

    return denoiser(FAMILY, str(model)).shapes()


def random_lora(shapes, rank: int, alpha: float, seed: int) -> tuple[dict, dict]:
    """A peft LoRA state dict on MODULES with nonzero A and B, and its config (alpha != rank)."""
    from stages.core.lora import config_dict, lora_config

    g = torch.Generator().manual_seed(seed)
    state = {}
    for m in MODULES:
        out, inp = shapes[m]
        state[f"{m}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
        state[f"{m}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1
    return state, config_dict(lora_config(rank, alpha, 0.0, MODULES))


def write_export_file(folder: Path, state: dict, lora_cfg: dict) -> Path:
    """The adapter as export-lora writes its diffusers file (scale folded into lora_B)."""
    from stages.core.caches import scale_folded, write_diffusers
    from stages.tools.lora_files import file_manifest

    folder.mkdir(parents=True, exist_ok=True)
    return write_diffusers(*scale_folded(state, lora_cfg), file_manifest(FAMILY), folder)


def dense(state: dict, lora_cfg: dict) -> dict[str, torch.Tensor]:
    """module -> alpha / rank * B @ A in float64."""
    scale = lora_cfg["lora_alpha"] / lora_cfg["r"]
    return {m: scale * state[f"{m}.lora_B.weight"].double() @ state[f"{m}.lora_A.weight"].double() for m in MODULES}


def deltas_of(path: Path, family: str | None = FAMILY) -> dict[str, torch.Tensor]:
    from stages.tools.lora_files import read_lora

    return {m: f.delta() for m, f in read_lora(path, family).modules.items()}


def eckart_young(d: torch.Tensor, r: int) -> tuple[torch.Tensor, float]:
    """The best rank-r approximation of d and its relative error, from the full SVD."""
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r], math.sqrt(float(s[r:].pow(2).sum() / s.pow(2).sum()))


@pytest.fixture(scope="module")
def pair(shapes, tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    a, b = random_lora(shapes, 8, 16.0, seed=1), random_lora(shapes, 4, 2.0, seed=2)
    return write_export_file(root / "a", *a), write_export_file(root / "b", *b), dense(*a), dense(*b)


def test_merge_at_full_rank_is_the_weighted_sum_and_below_it_the_eckart_young_truncation(pair, model, tmp_path):
    from stages.tools.lora_tools import merge

    a, b, da, db = pair
    full = merge([str(a), str(b)], [0.7, -0.3], None, None, str(tmp_path / "full.safetensors"), model=str(model))
    got = deltas_of(tmp_path / "full.safetensors")
    assert full["ranks"] == [12, 12] and full["error"]["worst"] < 1e-6
    for m in MODULES:
        want = 0.7 * da[m] - 0.3 * db[m]
        assert torch.allclose(got[m], want, atol=1e-5 * float(want.abs().max())), m

    low = merge([str(a), str(b)], [0.7, -0.3], 3, None, str(tmp_path / "low.safetensors"), model=str(model))
    got = deltas_of(tmp_path / "low.safetensors")
    errors, residual, total = {}, 0.0, 0.0
    for m in MODULES:
        want = 0.7 * da[m] - 0.3 * db[m]
        best, errors[m] = eckart_young(want, 3)
        assert torch.allclose(got[m], best, atol=1e-4 * float(best.abs().max())), m
        assert float((want - got[m]).norm() / want.norm()) == pytest.approx(errors[m], rel=1e-4)
        residual, total = residual + float((want - best).norm()) ** 2, total + float(want.norm()) ** 2
    assert low["error"]["worst"] == pytest.approx(max(errors.values()), rel=1e-5)
    assert low["error"]["worst_module"] == max(errors, key=errors.get)
    assert low["error"]["overall"] == pytest.approx(math.sqrt(residual / total), rel=1e-5)
    assert 0.05 < low["error"]["overall"] < 1


def test_resize_to_its_rank_is_lossless_and_below_it_the_svd_truncation(pair, model, tmp_path):
    from stages.tools.lora_tools import resize

    a, _, da, _ = pair
    same = resize(str(a), 8, None, str(tmp_path / "r8.safetensors"), model=str(model))
    assert same["error"]["worst"] < 1e-6
    for m, d in deltas_of(tmp_path / "r8.safetensors").items():
        assert torch.allclose(d, da[m], atol=1e-5 * float(da[m].abs().max()))
    two = resize(str(a), 2, None, str(tmp_path / "r2.safetensors"), fmt="comfyui", model=str(model))
    assert two["format"] == "comfyui" and "ComfyUI loads" in two["note"]
    from stages.tools.lora_files import read_lora

    back = read_lora(tmp_path / "r2.safetensors")
    assert back.format == "comfyui" and {f.rank for f in back.modules.values()} == {2}
    for m in MODULES:
        best, err = eckart_young(da[m], 2)
        got = back.modules[f"transformer.{m}"].delta()
        assert torch.allclose(got, best, atol=1e-4 * float(best.abs().max()))


def test_energy_keeps_the_fewest_values_and_the_output_loads_in_the_pipeline(pair, model, tmp_path):
    import diffusers

    from stages.tools.lora_tools import resize

    a, _, da, _ = pair
    report = resize(str(a), None, 0.9, str(tmp_path / "e.safetensors"), model=str(model))
    from stages.tools.lora_files import read_lora

    ranks = {m: f.rank for m, f in read_lora(tmp_path / "e.safetensors").modules.items()}
    for m in MODULES:
        s2 = torch.linalg.svdvals(da[m]).pow(2)
        kept = torch.cumsum(s2, 0) / s2.sum()
        assert ranks[m] == int((kept < 0.9).sum()) + 1
    assert report["error"]["worst"] <= math.sqrt(0.1) + 1e-9

    pipe = diffusers.FluxPipeline.from_pretrained(model)
    with library_lines() as lines:
        pipe.load_lora_weights(str(tmp_path), weight_name="e.safetensors", adapter_name="e")
    assert not [line for line in lines if "unexpected keys" in line or "missing keys" in line], lines
    loaded = {n for n, _ in pipe.transformer.named_parameters() if ".lora_" in n}
    assert loaded == {f"{m}.lora_{ab}.e.weight" for m in MODULES for ab in "AB"}
    layer = pipe.transformer.get_submodule(MODULES[0])
    got = layer.scaling["e"] * layer.lora_B["e"].weight.double() @ layer.lora_A["e"].weight.double()
    assert torch.allclose(got, deltas_of(tmp_path / "e.safetensors")[MODULES[0]], atol=1e-5)


def namesakes_file(shapes, folder: Path) -> tuple[Path, dict[str, int], dict[str, torch.Tensor]]:
    """A diffusers file of rank-4 factors whose deltas have rank 4 on the top-level `proj_out` and rank 2 on
    `single_transformer_blocks.0.proj_out` (whose path ends the same) and on one more module, so that an
    --energy near 1 keeps those ranks: 2 the common one, `proj_out` the odd one out. Returns its deltas too."""
    from stages.core.lora import config_dict, lora_config

    ranks = {"proj_out": 4, "single_transformer_blocks.0.proj_out": 2, "transformer_blocks.0.attn.to_q": 2}
    g, state = torch.Generator().manual_seed(6), {}
    for m, r in ranks.items():
        out, inp = shapes[m]
        state[f"{m}.lora_A.weight"] = torch.randn(4, inp, generator=g)
        state[f"{m}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.1
        state[f"{m}.lora_B.weight"][:, r:] = 0.0
    deltas = {m: state[f"{m}.lora_B.weight"].double() @ state[f"{m}.lora_A.weight"].double() for m in ranks}
    return write_export_file(folder, state, config_dict(lora_config(4, 4.0, 0.0, sorted(ranks)))), ranks, deltas


def test_energy_ranks_of_modules_whose_paths_end_alike_load_each_with_its_own(model, shapes, tmp_path):
    """The rank pattern of a file with several ranks names each module by its whole path: the pipeline's
    loader gives `single_transformer_blocks.0.proj_out` its own rank, not the top-level `proj_out`'s."""
    from stages.core.verify import VerifyError
    from stages.tools.lora_checks import check_output, denoiser
    from stages.tools.lora_files import read_lora
    from stages.tools.lora_tools import resize

    file, ranks, deltas = namesakes_file(shapes, tmp_path / "in")
    out = tmp_path / "e.safetensors"
    report = resize(str(file), None, 0.999999, str(out), model=str(model))
    assert "FluxPipeline loads all 3 modules" in report["note"]
    back = read_lora(out)
    assert {m: f.rank for m, f in back.modules.items()} == ranks
    for m, d in deltas.items():
        assert torch.allclose(back.modules[m].delta(), d, atol=1e-5 * float(d.abs().max())), m
    back.modules["proj_out"].up.mul_(2.0)  # a file that does not hold what it was meant to: refused, and why
    with pytest.raises(VerifyError, match=r"'proj_out' differs from the delta the tool computed for it .* as the "
                                          r"tools' own reader reads the file; nothing was written .*--rank R"):
        check_output(out, "diffusers", back, denoiser(FAMILY, str(model)))


def test_cli_resize_prints_no_library_notices(shapes, tmp_path):
    """`lora resize` imports what the stages import (bitsandbytes, the pipelines' image processors) and is
    as quiet as they are without --verbose: only its own report."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    file, _, _ = namesakes_file(shapes, tmp_path / "in")
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPIPE_DEBUG", "LORAPIPE_VERBOSE")}
    r = subprocess.run([sys.executable, "pipeline.py", "lora", "resize", str(file), "--energy", "0.999999", "-o",
                        str(tmp_path / "e.safetensors")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 'e.safetensors'} (diffusers, flux): 3 modules at ranks 2-4"), r.stdout
    noise = [line for line in r.stderr.splitlines() if not line.startswith("[resize]")]
    assert noise == [], r.stderr


def test_a_kohya_file_of_another_trainer_resizes_in_its_own_names(model, shapes, tmp_path):
    """sd-scripts' FLUX names (Black Forest Labs' layout), one module with an alpha and one without."""
    from stages.tools.lora_tools import resize

    width = shapes["transformer_blocks.0.attn.to_out.0"][0]
    g = torch.Generator().manual_seed(3)
    tensors = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.randn(4, width, generator=g),
               "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.randn(width, 4, generator=g),
               "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(2.0),
               "lora_unet_double_blocks_0_txt_attn_proj.lora_down.weight": torch.randn(4, width, generator=g),
               "lora_unet_double_blocks_0_txt_attn_proj.lora_up.weight": torch.randn(width, 4, generator=g)}
    save_file(tensors, str(tmp_path / "other.safetensors"), metadata={"ss_network_dim": "4", "sshs_model_hash": "x"})
    report = resize(str(tmp_path / "other.safetensors"), 2, None, str(tmp_path / "small.safetensors"), family=FAMILY,
                    model=str(model))
    assert report["format"] == "kohya" and "ComfyUI loads 6/6 keys" in report["note"]
    out = load_file(str(tmp_path / "small.safetensors"))
    for stem, scale in (("lora_unet_double_blocks_0_img_attn_proj", 0.5), ("lora_unet_double_blocks_0_txt_attn_proj", 1.0)):
        d = scale * tensors[f"{stem}.lora_up.weight"].double() @ tensors[f"{stem}.lora_down.weight"].double()
        best, _ = eckart_young(d, 2)
        got = out[f"{stem}.lora_up.weight"].double() @ out[f"{stem}.lora_down.weight"].double()
        assert float(out[f"{stem}.alpha"]) == 2.0 and torch.allclose(got, best, atol=1e-4 * float(best.abs().max()))


def test_extract_recovers_a_known_rank_2_change_of_one_layer(model, tmp_path):
    from stages.tools.lora_tools import extract

    tuned = tmp_path / "tuned"
    shutil.copytree(model / "transformer", tuned)
    weights = tuned / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    key = f"{MODULES[1]}.weight"
    g = torch.Generator().manual_seed(4)
    out, inp = state[key].shape
    change = (torch.randn(out, 2, generator=g) @ torch.randn(2, inp, generator=g)) * 0.05
    state[key] = state[key] + change
    save_file(state, str(weights))

    report = extract(str(model), str(weights), FAMILY, 4, None, str(tmp_path / "x.safetensors"))
    got = deltas_of(tmp_path / "x.safetensors")
    assert list(got) == [MODULES[1]] and report["unchanged"] > 10
    base = load_file(str(model / "transformer" / "diffusion_pytorch_model.safetensors"))[key]
    want = state[key].double() - base.double()  # the change as stored in fp32
    assert torch.allclose(got[MODULES[1]], want, atol=1e-5 * float(want.abs().max()))
    assert report["error"]["worst"] < 1e-4 and "FluxPipeline loads all 1 modules" in report["note"]


def power_ema(trajectory: list[torch.Tensor], gamma: float) -> torch.Tensor:
    """Karras et al.'s power-function EMA, one update per step: beta_t = (1 - 1/t)^(gamma + 1)."""
    ema = torch.zeros_like(trajectory[0])
    for t, theta in enumerate(trajectory, start=1):
        beta = (1 - 1 / t) ** (gamma + 1)
        ema = beta * ema + (1 - beta) * theta
    return ema


def test_posthoc_ema_is_the_power_ema_of_the_checkpoint_trajectory(shapes, assets, demo_data, tmp_path):
    from stages.core.artifacts import write_manifest
    from stages.core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from stages.tools.lora_files import file_manifest
    from stages.tools.posthoc_ema import run, sigma_rel_to_gamma

    cfg = make_cfg(FAMILY, assets, demo_data, tmp_path)
    steps, states = (10, 25, 40), []
    for i, step in enumerate(steps):
        state, lora_cfg = random_lora(shapes, 4, 8.0, seed=10 + i)
        folder = lora_dir(cfg) / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file(state, str(folder / ADAPTER_WEIGHTS))
        (folder / ADAPTER_CONFIG).write_text(json.dumps(lora_cfg))
        write_manifest(folder, "train", kind="checkpoint", step=step, fingerprint="f", fingerprint_parts={},
                       lineage="l", **file_manifest(FAMILY), lora_config=lora_cfg)
        states.append(state)

    gamma = sigma_rel_to_gamma(0.1)
    g = gamma  # sigma_rel of a power profile (Karras et al., eq. 3) gives it back
    assert math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3))) == pytest.approx(0.1, rel=1e-9)
    result = run(cfg, 0.1, None)
    out = load_file(str(Path(result["folder"]) / "pytorch_lora_weights.safetensors"))
    holds = [states[next(i for i, s in enumerate(steps) if t <= s)] for t in range(1, steps[-1] + 1)]
    for key in states[0]:
        want = power_ema([s[key].double() for s in holds], gamma)
        scale = 2.0 if "lora_B" in key else 1.0  # alpha 8 / rank 4, folded into lora_B by the diffusers file
        assert torch.allclose(out[f"transformer.{key}"].double(), want * scale, atol=1e-5), key
    assert sum(result["weights"]) == pytest.approx(1.0) and result["steps"] == list(steps)
    assert any("ComfyUI loads" in n for n in result["notes"])


def test_cli_resize_and_a_bad_file_in_one_line(pair, model, tmp_path):
    a = pair[0]
    ok = CliRunner().invoke(pipeline.cli, ["lora", "resize", str(a), "--rank", "2", "-o", str(tmp_path / "r.safetensors"),
                                           "--model", str(model)])
    assert ok.exit_code == 0, ok.output
    assert "relative error" in ok.output and (tmp_path / "r.safetensors").is_file()
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "not-a-lora.safetensors"))
    bad = CliRunner().invoke(pipeline.cli, ["lora", "merge", str(tmp_path / "not-a-lora.safetensors"), "-o",
                                            str(tmp_path / "m.safetensors")])
    assert bad.exit_code == 2 and "not-a-lora.safetensors" in bad.output and "'weight'" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "m.safetensors").exists()


def test_the_randomized_svd_of_a_large_difference_reports_the_measured_error():
    from stages.tools.lowrank import LOWRANK_FROM, svd_of_matrix, truncate

    n, g = LOWRANK_FROM + 16, torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(n, 6, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, 6, generator=g, dtype=torch.float64))
    s = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    d = (u * s) @ v.T
    kept = truncate(svd_of_matrix(d, 2), rank=2)
    assert kept.factors.rank == 2
    assert kept.rel_error == pytest.approx(math.sqrt(float(s[2:].pow(2).sum() / s.pow(2).sum())), rel=1e-3)
    got = kept.factors.delta()
    assert torch.allclose(got, (u[:, :2] * s[:2]) @ v[:, :2].T, atol=1e-4)
