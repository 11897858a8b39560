"""Head training throughput and its overhead over the frozen target's forward, in one run.

For each head setting, on the same batches, interleaved round by round:
  target   the frozen target's forward alone (the features a step needs)
  online   a full training step with features recomputed: target forward + head loss/backward/AdamW
  offline  a training step reading cached features: head loss/backward/AdamW only
Ratios online/target and offline/target are the overhead the issue's goal (<= 1.5) is about.

    python benchmarks/train_throughput.py                       # embedded SmolLM2, bf16 target
    python benchmarks/train_throughput.py --heads "type=eagle" "type=eagle draft_vocab_size=8192"
    python benchmarks/train_throughput.py --heads "type=eagle3 ttt_steps=3 draft_vocab_size=8192" \
        "type=eagle3 ttt_steps=3 draft_vocab_size=8192 autocast=bfloat16"   # train.autocast
Writes JSON (--out, default benchmarks/results/train_throughput.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftkit.heads import build_head  # noqa: E402
from draftkit.target import load_target  # noqa: E402
from draftkit.train.loop import TrainWrapper  # noqa: E402


def parse_head(text: str) -> tuple[dict, torch.dtype | None]:
    """`type=eagle3 ttt_steps=3 autocast=bfloat16` -> (head settings, autocast dtype or None)."""
    head = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in text.split())}
    autocast = head.pop("autocast", "float32")
    if autocast not in ("float32", "bfloat16"):
        raise SystemExit(f"--heads {text!r}: autocast must be float32 or bfloat16, got {autocast!r}")
    return head, torch.bfloat16 if autocast == "bfloat16" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target dir/gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--heads", nargs="+", default=["type=eagle", "type=eagle draft_vocab_size=8192"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, target.vocab_size, (args.batch, args.seq), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, args.seq // 4:] = 1  # the last 3/4 are "assistant" tokens
    heads, autocast = {}, {}
    for text in args.heads:
        settings, autocast[text] = parse_head(text)
        head = build_head(settings, target)
        if getattr(head.config, "draft_vocab_size", None):
            head.set_draft_vocab(tokens=ids[loss_mask.bool()].tolist() + list(range(target.vocab_size)))
        heads[text] = (head, torch.optim.AdamW(head.parameters(), lr=1e-4))
    layers = {text: h.feature_layers for text, (h, _) in heads.items()}

    def target_forward(text):
        return target.features(ids, attn, layers[text], loss_mask)

    def head_step(text, feats):
        head, opt = heads[text]
        out = TrainWrapper(head, autocast[text])(feats)  # the trainer's own forward (train.autocast)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        return out

    # Offline features carry the target's top-1, as the feature cache stores them.
    cached = {text: target.features(ids, attn, layers[text], loss_mask, top1=True) for text in heads}
    times: dict[str, dict[str, list[float]]] = {t: {"target": [], "online": [], "offline": []} for t in heads}
    tokens = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for text in heads:
            t0 = time.perf_counter()
            target_forward(text)
            t1 = time.perf_counter()
            out = head_step(text, target_forward(text))
            t2 = time.perf_counter()
            head_step(text, cached[text])
            t3 = time.perf_counter()
            tokens[text] = float(out["tokens"])
            if r:
                times[text]["target"].append(t1 - t0)
                times[text]["online"].append(t2 - t1)
                times[text]["offline"].append(t3 - t2)
    rows = []
    print(f"target {target.name} ({args.dtype}), batch {args.batch} x {args.seq}, threads {torch.get_num_threads()}")
    print(f"{'head':40s} {'params':>9s} {'target s':>9s} {'online s':>9s} {'offline s':>9s} "
          f"{'online/tgt':>10s} {'offline/tgt':>11s} {'tok/s off':>10s}")
    for text in heads:
        med = {k: statistics.median(v) for k, v in times[text].items()}
        params = sum(p.numel() for p in heads[text][0].parameters())
        row = {"head": text, "params": params, **{f"{k}_s": v for k, v in med.items()},
               "online_over_target": med["online"] / med["target"],
               "offline_over_target": med["offline"] / med["target"],
               "supervised_tokens_per_step": tokens[text],
               "tokens_per_s_offline": tokens[text] / med["offline"],
               "tokens_per_s_online": tokens[text] / med["online"]}
        rows.append(row)
        print(f"{text:40s} {params:9d} {med['target']:9.3f} {med['online']:9.3f} {med['offline']:9.3f} "
              f"{row['online_over_target']:10.2f} {row['offline_over_target']:11.2f} {row['tokens_per_s_offline']:10.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"target": target.name, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
