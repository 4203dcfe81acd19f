"""The artifact schema: which manifest each artifact has, its fields and their JSON types, and the
`Bucket` type that names a latent store.

Like EVENT_SCHEMA (stages/core/events.py) for events.jsonl. Every manifest also carries
COMMON_FIELDS. `write_manifest` validates what it writes (a violation is a bug and raises);
`read_manifest` validates what it reads (a violation means a damaged or foreign file, treated as
missing with a warning). A kind with `extra` may carry more fields than listed (a stage summary).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from stages.core.events import record_problems

COMMON_FIELDS: dict[str, Any] = {"schema_version": "integer", "code_version": "string", "stage": "string",
                                 "written_at": "string"}
_PROVENANCE = {"fingerprint": "string", "fingerprint_parts": "object"}
_COST = {"seconds": "number", "peak_vram_gb": ["number", "object", "null"], "world_size": "integer"}

MANIFEST_SCHEMA: dict[str, dict[str, Any]] = {
    # captions.zarr: rows by caption id, dataset items -> caption id, caption lengths (not texts:
    # inspect reads those from the dataset), field shapes, truncated captions (item -> tokens)
    "captions": {"required": {**_PROVENANCE, "family": "string", "model": "string", "rows": "object",
                              "items": "object", "lengths": "object", "fields": "object", "truncated": "object",
                              "encoded_this_run": "integer"},
                 # items -> all their caption ids (caption variants); the empty caption's id (dropout), or per
                 # item its own (empty, controls) row id when the text encoder sees the controls
                 "optional": {**_COST, "variants": "object", "empty_caption": "string", "empty_captions": "object",
                              # on a GPU: the plan its fingerprint asked for, and the key of what it depends on
                              "planned": "object"}},
    # latents.zarr: image id -> {bucket, row}, items -> image id, images per bucket, the family's
    # normalization, variants per image, skipped / duplicated items and size warnings
    "latents": {"required": {**_PROVENANCE, "family": "string", "model": "string", "index": "object",
                             "items": "object", "buckets": "object", "normalization": "object",
                             "variants": "integer", "skipped": "array", "duplicates": "object",
                             "warnings": "array", "encoded_this_run": "integer"},
                # latent id -> variants cached, where datasets cache different numbers ("variants": the most)
                # the layout parts the free memory forced on an "auto" run, and why (cache_latents._forced)
                "optional": {**_COST, "variants_of": "object", "memory_forced": "object", "planned": "object",
                             # the encode loop's pace: images per second, and the share of it the encoder worked
                             "images_per_second": "number", "encoder_busy": "number", "gpu_busy": "number"}},
    "checkpoint": {"required": {**_PROVENANCE, "kind": "string", "step": "integer"}, "optional": _COST, "extra": True},
    "final": {"required": {**_PROVENANCE, "kind": "string", "step": "integer", "complete": "boolean"},
              "optional": _COST, "extra": True},
    "export": {"required": {**_PROVENANCE, "family": "string", "pipeline_class": "string", "files": "array"},
               "optional": {**_COST, "step": ["integer", "null"]}, "extra": True},
    "samples": {"required": {**_PROVENANCE, "files": "array"}, "optional": _COST, "extra": True},
}
_KIND_OF_STAGE = {"encode-captions": "captions", "cache-latents": "latents", "export-lora": "export",
                  "sample": "samples"}


def manifest_kind(stage: str, fields: dict[str, Any]) -> str | None:
    """The schema kind of a manifest written by `stage` (train writes two: checkpoint and final)."""
    return fields.get("kind") if stage == "train" else _KIND_OF_STAGE.get(stage)


def validate_manifest(kind: str | None, manifest: Any) -> list[str]:
    """Every way a manifest breaks MANIFEST_SCHEMA[kind] (empty when it conforms)."""
    if not isinstance(manifest, dict):
        return [f"a manifest is a JSON object, not {type(manifest).__name__}"]
    if kind not in MANIFEST_SCHEMA:
        return [f"unknown manifest kind {kind!r} (stage {manifest.get('stage')!r})"]
    return record_problems(kind, MANIFEST_SCHEMA[kind], COMMON_FIELDS, manifest, "MANIFEST_SCHEMA")


class Bucket(NamedTuple):
    """An aspect bucket in pixels, and frames for clips; `str()` is its store's folder name: "WxH" for
    images, "WxHxFf" for clips of F frames (e.g. "832x480x33f")."""

    width: int
    height: int
    frames: int = 1

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}f" if self.frames > 1 else "")

    @classmethod
    def parse(cls, name: str) -> "Bucket":
        """"512x768" -> Bucket(512, 768), "832x480x33f" -> Bucket(832, 480, 33); anything else is a
        ValueError naming it."""
        parts = name.split("x")
        frames = parts.pop()[:-1] if len(parts) == 3 and parts[2].endswith("f") else "1"
        if len(parts) != 2 or not all(p.isdigit() for p in (*parts, frames)) or int(frames) < 1:
            raise ValueError(f"'{name}' is not a bucket name (WxH, e.g. 512x768, or WxHxFf for clips, e.g. 832x480x33f)")
        return cls(int(parts[0]), int(parts[1]), int(frames))


def control_count(fields: list[str]) -> int:
    """How many control images a latent store's rows hold (`control_<k>_mean` fields, k = 0..n-1, as
    cache-latents writes them beside the target's `mean` and `logvar`)."""
    return sum(1 for f in fields if f.startswith("control_") and f.endswith("_mean"))
