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

--batching compares how training reads data instead (train.batching x train.loader_workers), on the
offline features of real samples (a prepared directory, or a prompt file's chat-formatted prompts
with their replies): random vs length_buckets micro-batches, read in the main process vs by
DataLoader workers, interleaved round by round; prints real (non-pad) tokens/s and padded/real tokens:
    python benchmarks/train_throughput.py --batching --samples ~/.cache/draftkit/data/prepared/<fp> \
        --heads "type=eagle draft_vocab_size=8192" --batch 8 --workers 0 2 --steps 20 --rounds 3 \
        --out benchmarks/results/train_batching.json
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftkit.heads import build_head  # noqa: E402
from draftkit.target import load_target  # noqa: E402
from draftkit.train.data import FeatureStore, SampleOrder, padding_ratio  # noqa: E402
from draftkit.train.loader import MicroBatches, MicroBatchStream, to_device  # noqa: E402
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
    ap.add_argument("--batching", action="store_true", help="compare train.batching x train.loader_workers")
    ap.add_argument("--samples", default=None, help="--batching: a prepared directory or a prompt file")
    ap.add_argument("--max-samples", type=int, default=None, help="--batching: use the first N samples")
    ap.add_argument("--max-length", type=int, default=2048, help="--batching: a prompt file's samples cut here")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="--batching: train.loader_workers")
    ap.add_argument("--steps", type=int, default=20, help="--batching: micro steps per setting and round")
    ap.add_argument("--prefetch", type=int, default=2, help="--batching: train.prefetch")
    ap.add_argument("--window", type=int, default=64, help="--batching: train.bucket_window (global batches)")
    ap.add_argument("--storage", default="target", help="--batching: train.feature_storage")
    ap.add_argument("--features-dir", default=None, help="--batching: offline feature cache (default: a temp dir)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype)
    if args.batching:
        return batching_main(args, target)
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


def read_samples(path: str, target, limit: int | None, max_length: int) -> list[dict]:
    """Training samples {input_ids, loss_mask}: a prepared directory's (draftkit prepare), or a prompt
    file's prompts chat-formatted with their replies where the file has them (loss on every token)."""
    p = Path(path).expanduser()
    if p.is_dir():
        from draftkit.distill.prepare import load_prepared

        return load_prepared(p).train[:limit]
    from draftkit.distill.sources import PromptSource, load_prompts

    if target.tokenizer is None or not getattr(target.tokenizer, "chat_template", None):
        raise SystemExit(f"--samples {path}: a prompt file needs a target with a chat template")
    out = []
    for pr in load_prompts([PromptSource(path=str(p))], limit, seed=0):
        turns = pr.messages + ([{"role": "assistant", "content": pr.reply}] if pr.reply else [])
        text = target.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=not pr.reply)
        ids = target.tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]
        out.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
    return out


def offline_features(args, target, layers: tuple[int, ...], samples: list[dict], pad: int) -> FeatureStore:
    """The samples' features computed once, up front, into --features-dir (default: a temp dir)."""
    feat_dir = Path(args.features_dir or tempfile.mkdtemp(prefix="draftkit-bench-features-"))
    store = FeatureStore(target, layers, feat_dir, args.storage)
    lengths = [len(s["input_ids"]) for s in samples]
    by_length = sorted(range(len(samples)), key=lengths.__getitem__)
    t0 = time.perf_counter()
    for i in range(0, len(samples), 8):  # similar lengths together
        store.ensure([samples[j] for j in by_length[i: i + 8]], pad)
    print(f"{len(samples)} samples, {sum(lengths)} tokens (median {statistics.median(lengths):.0f}, "
          f"max {max(lengths)}): features in {time.perf_counter() - t0:.0f} s -> {feat_dir}")
    return store


def train_round(run: dict, r: int, args, samples: list[dict], store: FeatureStore, pad: int, autocast) -> None:
    """Micro steps r * steps ... (r + 1) * steps of one setting, from a fresh loader (as a run starts
    one); the first step (the workers' start) and round 0 are not counted."""
    data = MicroBatches(run["order"], samples, store, pad, args.batch, 1, 1, 0, read=run["workers"] > 0)
    stream = MicroBatchStream(data, (args.rounds + 1) * args.steps, run["workers"], args.prefetch)
    for k in range(r * args.steps, (r + 1) * args.steps):
        t0 = time.perf_counter()
        item = stream.get(k, 0)
        feats = item["features"]  # the Trainer's micro_batch: read by a worker, or here
        feats = to_device(feats, store.target.device) if feats is not None else store.batch(
            [samples[i] for i in item["indices"]], pad)
        out = TrainWrapper(run["head"], autocast)(feats)
        run["opt"].zero_grad(set_to_none=True)
        out["loss"].backward()
        run["opt"].step()
        if r and k > r * args.steps:
            run["time"] += time.perf_counter() - t0
            run["real"] += int(feats.attention_mask.sum())
            run["padded"] += feats.attention_mask.numel()
            run["supervised"] += float(out["tokens"])
            run["steps"] += 1


def batching_main(args, target) -> None:
    """random vs length_buckets x loader workers, each setting training its own copy of the head on
    the same offline features; settings interleaved round by round, a fresh loader each round (its
    first micro step, the workers' start, is not timed)."""
    if not args.samples:
        raise SystemExit("--batching needs --samples (a prepared directory or a prompt file)")
    samples = read_samples(args.samples, target, args.max_samples, args.max_length)
    lengths = [len(s["input_ids"]) for s in samples]
    settings, autocast = parse_head(args.heads[0])
    head = build_head(settings, target)
    if getattr(head.config, "draft_vocab_size", None):
        head.set_draft_vocab(tokens=[t for s in samples for t in s["input_ids"]] + list(range(target.vocab_size)))
    pad = (target.tokenizer.pad_token_id if target.tokenizer is not None else None) or 0
    store = offline_features(args, target, head.feature_layers, samples, pad)
    runs = {}
    for batching in ("random", "length_buckets"):
        order = SampleOrder(len(samples), 0, batching, lengths, args.batch, args.window * args.batch)
        for workers in args.workers:
            h = copy.deepcopy(head)
            runs[(batching, workers)] = {"order": order, "workers": workers, "head": h,
                                         "opt": torch.optim.AdamW(h.parameters(), lr=1e-4),
                                         "time": 0.0, "real": 0, "padded": 0, "supervised": 0.0, "steps": 0}
    for r in range(args.rounds + 1):  # round 0 warms up
        for run in runs.values():
            train_round(run, r, args, samples, store, pad, autocast)
    rows = []
    print(f"target {target.name} ({args.dtype}), head {args.heads[0]!r}, micro-batch {args.batch}, "
          f"window {args.window} batches, storage {args.storage}, threads {torch.get_num_threads()}")
    print(f"{'batching':16s} {'workers':>7s} {'pad/real':>8s} {'epoch pad':>9s} {'s/step':>7s} "
          f"{'real tok/s':>10s} {'sup tok/s':>10s}")
    for (batching, workers), run in runs.items():
        epoch = [run["order"].indices(k, 0, args.batch, 1, 1, 0) for k in range(len(samples) // args.batch)]
        row = {"batching": batching, "loader_workers": workers, "steps_timed": run["steps"],
               "padded_over_real": run["padded"] / run["real"], "epoch_padded_over_real": padding_ratio(epoch, lengths),
               "s_per_step": run["time"] / run["steps"], "real_tokens_per_s": run["real"] / run["time"],
               "supervised_tokens_per_s": run["supervised"] / run["time"]}
        rows.append(row)
        print(f"{batching:16s} {workers:7d} {row['padded_over_real']:8.3f} {row['epoch_padded_over_real']:9.3f} "
              f"{row['s_per_step']:7.3f} {row['real_tokens_per_s']:10.0f} {row['supervised_tokens_per_s']:10.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": "batching", "target": target.name, "dtype": args.dtype, "head": args.heads[0],
                               "samples": str(args.samples), "num_samples": len(samples), "tokens": sum(lengths),
                               "micro_batch": args.batch, "window": args.window, "storage": args.storage,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
