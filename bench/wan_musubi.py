"""musubi-tuner's Wan trainer beside the product (bench/peers_video.py): the product's diffusers transformer in Wan's
original key names, the model's dimensions for musubi's config, and musubi's cache files made from the product's.

    python bench/wan_musubi.py convert --transformer /dev/shm/m/wan2.2-14b/transformer --out /dev/shm/musubi-dit
    python bench/wan_musubi.py caches --run-dir RUN --data DATA --out CACHE     # in the peer's environment

musubi-tuner (kohya-ss) loads Wan's original checkpoint layout (`blocks.0.self_attn.q.weight`, `head.head.weight`),
not diffusers' (`blocks.0.attn1.to_q.weight`, `proj_out.weight`). `original_key` is the inverse of diffusers'
`convert_wan_transformer_to_diffusers` (diffusers/loaders/single_file_utils.py) for a text-to-video transformer;
tests/bench/test_wan_musubi.py holds the two equal and the converted weights' output equal to the diffusers model's.

`caches` writes, through musubi's own `save_latent_cache_wan` / `save_text_encoder_output_cache_wan`, one latent file
per clip (the product's cached posterior mean, normalized per channel as musubi's Wan VAE returns it) and one text file
per clip (the product's umT5 rows up to the caption's length: musubi pads them back to 512 with zeros), so both
trainers train on the same latents and the same text features.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# diffusers' name -> Wan's, inside `blocks.<n>.` (applied in order, each once)
BLOCK_RENAMES = (
    (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."),
    (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), (".to_out.0.", ".o."),
    (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
    # the cross-attention's LayerNorm (affine): Wan's norm3; Wan's norm2 (before the FFN) has no weights, nor diffusers' norm3
    (".norm2.", ".norm3."),
    (".scale_shift_table", ".modulation"),
)
TOP_RENAMES = {
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "patch_embedding.": "patch_embedding.",
    "proj_out.": "head.head.",
    "scale_shift_table": "head.modulation",
}
# every parameter of a text-to-video WanAttentionBlock, in Wan's names
BLOCK_PARAM = re.compile(r"^\.((self_attn|cross_attn)\.(q|k|v|o|norm_q|norm_k)|ffn\.[02]|norm3)\.(weight|bias)$|^\.modulation$")
SHARD_BYTES = 5 << 30  # one shard in host memory while converting


def original_key(key: str) -> str:
    """Wan's original name of a diffusers WanTransformer3DModel (text-to-video) parameter; refuses what a T2V
    transformer does not have (image embedder, VACE, Animate parts)."""
    if key.startswith("blocks."):
        n, rest = key[len("blocks."):].split(".", 1)
        rest = "." + rest
        for a, b in BLOCK_RENAMES:
            rest = rest.replace(a, b, 1)
        if not BLOCK_PARAM.match(rest):
            raise KeyError(f"no Wan name for {key!r} (a text-to-video Wan transformer has no such parameter)")
        return f"blocks.{n}{rest}"
    for a, b in TOP_RENAMES.items():
        if key.startswith(a):
            return b + key[len(a):]
    raise KeyError(f"no Wan name for {key!r} (a text-to-video Wan transformer has no such parameter)")


def to_original(state: dict[str, Any]) -> dict[str, Any]:
    return {original_key(k): v for k, v in state.items()}


def _block_order(key: str) -> tuple[int, str]:
    """Blocks in order (blocks.0 in the first shard: musubi reads the weights' dtype from blocks.0), then the rest."""
    if key.startswith("blocks."):
        return int(key.split(".")[1]), key
    return 1 << 30, key


def convert(transformer: Path, out: Path) -> Path:
    """A diffusers transformer folder's safetensors -> Wan-named shards `wan-0000i-of-0000n.safetensors` in `out`
    (musubi's loader reads every shard named like the first), tensor by tensor, one shard in memory at a time.
    Returns the first shard: musubi's --dit."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(transformer.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{transformer}: no .safetensors files (a diffusers transformer folder is needed)")
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            where.update({k: f for k in fh.keys()})
    sizes = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                sizes[k] = n * {"BF16": 2, "F16": 2, "F32": 4}.get(sl.get_dtype(), 4)
    groups, cur, size = [], [], 0
    for k in sorted(where, key=lambda k: _block_order(original_key(k))):
        if cur and size + sizes[k] > SHARD_BYTES:
            groups.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += sizes[k]
    groups.append(cur)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("wan-*.safetensors"):
        old.unlink()
    n = len(groups)
    for i, keys in enumerate(groups, 1):
        shard = {}
        for k in keys:
            with safe_open(str(where[k]), "pt") as fh:
                shard[original_key(k)] = fh.get_tensor(k).contiguous()
        tmp = out / f"wan-{i:05d}-of-{n:05d}.safetensors.tmp"
        save_file(shard, str(tmp))
        tmp.replace(out / f"wan-{i:05d}-of-{n:05d}.safetensors")
    return out / f"wan-00001-of-{n:05d}.safetensors"


def musubi_dims(transformer: Path) -> dict[str, Any]:
    """musubi's Wan config fields (wan/configs) from the diffusers transformer's config.json."""
    cfg = json.loads((transformer / "config.json").read_text())
    return {"dim": cfg["num_attention_heads"] * cfg["attention_head_dim"], "ffn_dim": cfg["ffn_dim"],
            "num_heads": cfg["num_attention_heads"], "num_layers": cfg["num_layers"], "in_dim": cfg["in_channels"],
            "out_dim": cfg["out_channels"], "freq_dim": cfg["freq_dim"], "text_dim": cfg["text_dim"], "eps": cfg["eps"]}


# ---- caches (run in the peer's environment: musubi's cache writers, the product's stores) ----------------------


def write_caches(run_dir: Path, data: Path, out: Path) -> list[str]:
    """musubi's Wan cache files for every clip of the product's latents.zarr (variant 0 of each) with its caption's
    umT5 rows from captions.zarr. Returns the cache files written."""
    import numpy as np
    import torch
    from musubi_tuner.dataset.cache_io import save_latent_cache_wan, save_text_encoder_output_cache_wan
    from musubi_tuner.dataset.image_video_dataset import ItemInfo

    from stages.core.dataset import caption_id
    from stages.core.rowstore import RowStore

    latents = run_dir / "latents.zarr"
    manifest = json.loads((latents / "manifest.json").read_text())
    norm = manifest["normalization"]
    mean = torch.tensor(norm["latents_mean"]).view(-1, 1, 1, 1)
    std = torch.tensor(norm["latents_std"]).view(-1, 1, 1, 1)
    captions = RowStore.open(run_dir / "captions.zarr")
    caption_rows = captions.row_of()
    stores: dict[str, Any] = {}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, latent_id in sorted(manifest["items"].items()):
        entry = manifest["index"][latent_id]
        bucket = entry["bucket"]
        if "x" not in bucket or not bucket.endswith("f"):
            continue  # a still: the side-by-side trains clips only
        store = stores.setdefault(bucket, RowStore.open(latents / bucket))
        z = torch.from_numpy(np.asarray(store.read_row(entry["row"], ["mean"])["mean"], dtype=np.float32))
        if z.dim() == 5:  # variants first
            z = z[0]
        z = (z - mean) / std  # (C, F, H, W), as musubi's WanVAE.encode returns it
        stem = Path(rel).name.split(".")[0]
        text = (data / Path(rel).parent / f"{stem}.txt").read_text().strip()
        rows = captions.read_row(caption_rows[caption_id(text)], ["prompt_embeds"])["prompt_embeds"]
        emb = torch.from_numpy(np.asarray(rows, dtype=np.float32))
        nonzero = (emb.abs().sum(-1) > 0).nonzero()
        emb = emb[: int(nonzero.max()) + 1 if len(nonzero) else 1]  # WanPipeline zero-pads past the caption's tokens
        w, h, frames = (int(v) for v in bucket[:-1].split("x"))
        key = f"{stem}_00000-{frames:03d}"
        item = ItemInfo(key, text, (w, h), (w, h, frames), frame_count=frames)
        item.latent_cache_path = str(out / f"{key}_{w:04d}x{h:04d}_wan.safetensors")
        item.text_encoder_output_cache_path = str(out / f"{stem}_wan_te.safetensors")
        save_latent_cache_wan(item, z.contiguous(), None, None, None)
        save_text_encoder_output_cache_wan(item, emb.contiguous())
        written += [item.latent_cache_path, item.text_encoder_output_cache_path]
    if not written:
        raise SystemExit(f"{latents}: no clip latents (cache-latents of a clip dataset first)")
    return written


def dataset_toml(cache: Path, data: Path, width: int, height: int, frames: int, batch: int) -> str:
    """musubi's dataset config over `cache` (training reads only the cache files; the video folder is required by
    its schema, not read)."""
    return (f'[general]\nresolution = [{width}, {height}]\ncaption_extension = ".txt"\nbatch_size = {batch}\n'
            f'enable_bucket = false\n\n[[datasets]]\nvideo_directory = "{data}"\ncache_directory = "{cache}"\n'
            f'target_frames = [{frames}]\nframe_extraction = "head"\n')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="diffusers transformer folder -> Wan-named shards")
    c.add_argument("--transformer", required=True)
    c.add_argument("--out", required=True)
    k = sub.add_parser("caches", help="musubi's cache files from the product's caches (peer environment)")
    k.add_argument("--run-dir", required=True)
    k.add_argument("--data", required=True)
    k.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cmd == "convert":
        print(convert(Path(a.transformer), Path(a.out)))
    else:
        print("\n".join(write_caches(Path(a.run_dir), Path(a.data), Path(a.out))))


if __name__ == "__main__":
    main()
