"""Prepared data on disk: parquet shards (loadable with `datasets`) and a manifest that names them.

    directory/
      train-00000-of-00003.parquet   one row per training sample: the conversation and its tokens
      holdout-00000-of-00001.parquet the held-aside prompts, answered, with their tokens
      manifest.json                  written last: the fingerprint of what was prepared, and per
                                     shard its rows, tokens and sha256

`datasets.load_dataset("parquet", data_files=str(directory / "train-*.parquet"))` reads them. Every
file is written atomically (temp file + os.replace), and a shard is read only after its bytes
match the manifest's sha256, so a truncated or corrupt shard is named, never silently read.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1  # bump when the columns or their meaning change: older directories are prepared again


class ShardError(ValueError):
    """A prepared data directory that cannot be used as it is (missing, corrupt, another recipe's)."""


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.parquet"


def write_shard(path: Path, rows: list[dict]) -> dict:
    """rows (dicts of ROW fields) -> one parquet file, atomically; returns its manifest entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "category": pa.array([r["category"] for r in rows], pa.string()),
        "messages": pa.array([json.dumps(r["messages"], sort_keys=True) for r in rows], pa.string()),  # JSON
        "target_text": pa.array([list(r["target_text"]) for r in rows], pa.list_(pa.string())),
        "response": pa.array([r["response"] for r in rows], pa.string()),
        "truncated": pa.array([r["truncated"] for r in rows], pa.bool_()),
        "num_tokens": pa.array([r["num_tokens"] for r in rows], pa.int32()),
        "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),  # (L,) per row
        "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8())),  # (L,) per row
    })
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return {"file": path.name, "rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
            "loss_tokens": sum(sum(r["loss_mask"]) for r in rows), "bytes": path.stat().st_size,
            "sha256": file_sha256(path)}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True, default=str))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path) -> dict | None:
    """The manifest, or None when the directory has none yet; ShardError when it is unreadable."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: corrupt manifest ({e})") from None


def problems(directory: Path, manifest: dict, fingerprint: str) -> list[str]:
    """Why `directory` cannot be used for `fingerprint` (empty when it can): each bad shard named."""
    if manifest.get("format") != FORMAT:
        return [f"{directory / MANIFEST}: format {manifest.get('format')}, this draftkit writes {FORMAT}"]
    if manifest.get("fingerprint") != fingerprint:
        return [f"{directory / MANIFEST}: prepared for another recipe, target or size "
                f"(fingerprint {manifest.get('fingerprint')}, this run {fingerprint})"]
    bad = []
    for split, entries in manifest["splits"].items():
        for e in entries:
            path = Path(directory) / e["file"]
            if not path.is_file():
                bad.append(f"{path}: missing")
            elif path.stat().st_size != e["bytes"]:
                bad.append(f"{path}: truncated or corrupt ({path.stat().st_size} bytes, the manifest says {e['bytes']})")
            elif file_sha256(path) != e["sha256"]:
                bad.append(f"{path}: corrupt (sha256 differs from the manifest)")
    return bad


def read_split(directory: Path, manifest: dict, split: str) -> list[dict]:
    """Every row of one split, in shard order; ShardError naming any shard whose bytes differ."""
    import pyarrow.parquet as pq

    rows = []
    for e in manifest["splits"].get(split, []):
        path = Path(directory) / e["file"]
        if not path.is_file() or path.stat().st_size != e["bytes"] or file_sha256(path) != e["sha256"]:
            raise ShardError(f"{path}: truncated, corrupt or missing (does not match {directory / MANIFEST}); "
                             f"rerun `draftkit prepare` to regenerate it")
        table = pq.read_table(path)
        cols = {name: table.column(name).to_pylist() for name in table.column_names}
        for i in range(table.num_rows):
            row = {name: cols[name][i] for name in cols}
            row["messages"] = json.loads(row["messages"])
            rows.append(row)
    return rows
