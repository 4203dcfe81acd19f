"""bench/wan_musubi.py and bench/peers_video.py: the diffusers Wan transformer in Wan's original names (the inverse of
diffusers' own single-file converter; the converted shards give musubi-tuner's WanModel the diffusers model's output),
and the musubi command line and dataset config the side-by-side runs.

The musubi-tuner check needs its code carried in .carry-peers/musubi-tuner (bench/peers.md) and its imports
(easydict, ftfy, einops, voluptuous, toml, opencv): LORAPIPE_PEER_PYTHONPATH adds a folder holding them
(`pip install --target DIR ...`); without them that test is skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from bench import wan_musubi
from bench.peers_video import PEERS, peer_command
from bench.wan_musubi import convert, dataset_toml, musubi_dims, original_key, to_original

ROOT = Path(__file__).resolve().parents[2]
MUSUBI_SRC = ROOT / ".carry-peers" / "musubi-tuner" / "src"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stages.families.common.wan_tiny import wan_transformer

    folder = tmp_path_factory.mktemp("wan") / "transformer"
    wan_transformer(0, 16).save_pretrained(str(folder))
    return folder


def _diffusers(folder: Path):  # noqa: ANN202
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(str(folder)).eval()


def test_wan_names_invert_diffusers_converter(tiny_folder: Path) -> None:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    state = _diffusers(tiny_folder).state_dict()
    original = to_original(state)
    assert len(original) == len(state)  # no two diffusers names meet
    assert "blocks.0.self_attn.q.weight" in original and "head.modulation" in original
    assert "blocks.0.norm3.weight" in original and "blocks.0.norm2.weight" not in original  # the cross-attn norm
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="add_k_proj"):
        original_key("blocks.0.attn2.add_k_proj.weight")  # an image-to-video part: refused, not guessed


def test_converted_shards(tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several shards named as musubi's loader expands them, blocks.0 in the first (musubi reads the dtype there), every
    tensor once; converting again replaces the shards."""
    from safetensors import safe_open

    monkeypatch.setattr(wan_musubi, "SHARD_BYTES", 40_000)
    first = convert(tiny_folder, tmp_path / "dit")
    shards = sorted((tmp_path / "dit").glob("wan-*.safetensors"))
    assert len(shards) > 1 and first == shards[0] and first.name.endswith(f"-of-{len(shards):05d}.safetensors")
    keys: list[str] = []
    for s in shards:
        with safe_open(str(s), "pt") as fh:
            keys += list(fh.keys())
    assert len(keys) == len(set(keys)) == len(_diffusers(tiny_folder).state_dict())
    with safe_open(str(first), "pt") as fh:
        assert "blocks.0.cross_attn.k.weight" in fh.keys()
    monkeypatch.setattr(wan_musubi, "SHARD_BYTES", 1 << 30)
    assert convert(tiny_folder, tmp_path / "dit").name == "wan-00001-of-00001.safetensors"
    assert len(list((tmp_path / "dit").glob("wan-*.safetensors"))) == 1


def _musubi():  # noqa: ANN202
    extra = [p for p in os.environ.get("LORAPIPE_PEER_PYTHONPATH", "").split(os.pathsep) if p]
    if not (MUSUBI_SRC / "musubi_tuner").is_dir():
        pytest.skip("musubi-tuner is not carried in .carry-peers/musubi-tuner (bench/peers.md)")
    for p in [str(MUSUBI_SRC), *extra]:
        if p not in sys.path:
            sys.path.append(p)
    try:
        from bench.musubi_launch import prepare

        return prepare
    except ImportError as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"musubi-tuner's imports are missing ({e}); set LORAPIPE_PEER_PYTHONPATH")


def test_musubi_wan_model_gives_the_diffusers_output(tiny_folder: Path, tmp_path: Path) -> None:
    """musubi's own loader (load_wan_model, strict) on the converted shards: its WanModel's prediction is the diffusers
    transformer's for the same latents, timestep and zero-padded caption, with one timestep per sample (the
    side-by-side's --force_v2_1_time_embedding) and with musubi's per-token Wan 2.2 embedding. musubi runs attention
    in bf16 even for fp32 weights (wan/modules/attention.py casts q, k, v), so the outputs agree to ~5e-4 of their
    largest value, where swapping one block's q and k weights moves them by ~5e-2."""
    prepare = _musubi()
    try:
        wan_model = prepare(musubi_dims(tiny_folder), PEERS["wan2.2-14b"].task)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"musubi-tuner's imports are missing ({e}); set LORAPIPE_PEER_PYTHONPATH")
    from musubi_tuner.wan.configs import WAN_CONFIGS

    first = convert(tiny_folder, tmp_path / "dit")
    model = wan_model.load_wan_model(WAN_CONFIGS["t2v-A14B"], "cpu", str(first), "torch", False, "cpu", torch.float32)
    model.eval()
    ref = _diffusers(tiny_folder)
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(16, 3, 6, 10, generator=g)
    caption = torch.randn(7, ref.config.text_dim, generator=g)
    padded = torch.cat([caption, caption.new_zeros(512 - 7, caption.shape[1])])[None]
    t, seq = torch.tensor([930.0]), 3 * 3 * 5

    def gap() -> float:
        got = model([lat], t, [caption], seq)[0]
        assert got.shape == want.shape
        return float((got - want).abs().max() / want.abs().max())

    with torch.no_grad():
        want = ref(hidden_states=lat[None], timestep=t, encoder_hidden_states=padded, return_dict=False)[0][0]
        for v2_1 in (True, False):
            model.set_time_embedding_v2_1(v2_1)
            assert gap() < 5e-3
        state = model.state_dict()
        q, k = "blocks.0.self_attn.q.weight", "blocks.0.self_attn.k.weight"
        model.load_state_dict({**state, q: state[k], k: state[q]})
        assert gap() > 2e-2


def test_musubi_command_and_dataset(tmp_path: Path) -> None:
    a = argparse.Namespace(family="wan2.2-14b", tiny=False, steps=10, batch=1)
    cmd = peer_command(a, tmp_path / "dims.json", tmp_path / "wan-00001-of-00006.safetensors", tmp_path / "d.toml",
                       tmp_path / "out")
    args = cmd[cmd.index("--") + 1:]
    flag = {k: args[i + 1] for i, k in enumerate(args[:-1]) if k.startswith("--") and not args[i + 1].startswith("--")}
    assert flag["--task"] == "t2v-A14B" and flag["--network_dim"] == flag["--network_alpha"] == "16"
    assert flag["--mixed_precision"] == "bf16" and flag["--max_train_steps"] == "10" and "--gradient_checkpointing" in args
    assert (flag["--min_timestep"], flag["--max_timestep"]) == ("875", "1000")  # the high-noise expert's range
    assert flag["--discrete_flow_shift"] == "3.0" and flag["--optimizer_args"] == "fused=True"
    assert "--force_v2_1_time_embedding" in args and "--sdpa" in args
    tiny = peer_command(argparse.Namespace(family="wan2.2-14b", tiny=True, steps=4, batch=1), tmp_path, tmp_path,
                        tmp_path, tmp_path)
    assert "--optimizer_args" not in tiny and tiny[tiny.index("--mixed_precision") + 1] == "no"
    cfg = tomllib.loads(dataset_toml(tmp_path / "cache", tmp_path / "clips", 832, 480, 33, 1))
    assert cfg["general"]["resolution"] == [832, 480] and cfg["general"]["batch_size"] == 1
    assert cfg["datasets"][0]["target_frames"] == [33] and cfg["datasets"][0]["cache_directory"] == str(tmp_path / "cache")


def test_clips_are_frame_folders_without_stills(tmp_path: Path) -> None:
    """The side-by-side's clips need no PyAV (the GPU machine's wheels carry none): every clip a folder of frames."""
    from bench.peers_video import ensure_clips

    clips = ensure_clips(tmp_path, tiny=True, frames=9)
    assert len(clips) == 8 and all(c.is_dir() and len(list(c.glob("*.png"))) == 9 for c in clips)
    assert all((tmp_path / f"{c.name}.txt").read_text() for c in clips) and not list(tmp_path.glob("still_*"))
    assert ensure_clips(tmp_path, tiny=True, frames=9) == clips  # made once


def test_cv2_stand_in(tmp_path: Path) -> None:
    """Without OpenCV the peer imports a cv2 whose attributes are missing with a line naming the stand-in."""
    import subprocess

    code = "import cv2\ntry:\n    cv2.resize\nexcept AttributeError as e:\n    print(e)\n"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT / "bench" / "peer_site"),
           "LORAPIPE_PEER_CV2_STANDIN": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert "cv2.resize: OpenCV is not installed" in out.stdout, out.stderr
