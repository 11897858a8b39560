"""Peak host memory of one head training step (loss + backward) at a long length, today vs this tree.

Each (family, code) pair runs in a fresh process; the peak resident set above the process's
size just before the step is the step's memory. "today" is another draftkit source tree (e.g. the
commit before the chunked losses, unpacked with `git archive`); "new" is this one. Same seed, same
random target and features: the losses must agree too.

    git archive 31e6d24 draftkit | tar -x -C /tmp/draftkit-before
    python benchmarks/loss_memory.py --baseline-src /tmp/draftkit-before --length 2048
Writes JSON (--out, default benchmarks/results/loss_memory.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS = {
    "eagle": {"type": "eagle"},  # full target vocabulary (the default; 8B recipes)
    "eagle3": {"type": "eagle3", "draft_vocab_size": 32000, "ttt_steps": 7},
    "medusa": {"type": "medusa", "num_heads": 3, "share_lm_head": True},
    "mtp": {"type": "mtp", "num_depths": 1},
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(args) -> dict:
    """In the child: build a random target of the given sizes, fake features, one loss + backward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftkit.heads import build_head
    from draftkit.target import Target, TargetFeatures

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=4, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(4096, args.length + 16), tie_word_embeddings=True)
    target = Target(LlamaForCausalLM(cfg).to(torch.bfloat16), None, name="random")
    settings = dict(HEADS[args.one])
    if "draft_vocab_size" in settings:
        settings["draft_vocab_size"] = min(settings["draft_vocab_size"], args.vocab // 2)
    head = build_head(settings, target)
    B, T, H = args.batch, args.length, args.hidden
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (B, T), generator=g)
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(tokens=ids)
    attn = torch.ones(B, T, dtype=torch.long)
    loss_mask = attn.clone()
    loss_mask[:, :T // 8] = 0  # a prompt outside the loss
    hidden = torch.randn(B, T, len(head.feature_layers) * H, generator=g).to(torch.bfloat16)
    final = torch.randn(B, T, H, generator=g).to(torch.bfloat16)
    with torch.no_grad():  # the cached top-1, as the offline feature store gives it
        top1 = torch.cat([target.logits(final[:, i:i + 256]).argmax(-1) for i in range(0, T, 256)], 1)
    feats = TargetFeatures(ids, attn, hidden if head.feature_layers != (-1,) else final, final, loss_mask, top1)
    before = rss_bytes()
    t0 = time.time()
    out = head.loss(feats)
    out["loss"].backward()
    seconds = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak - before, "loss": float(out["loss"]), "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-src", type=Path, required=False, help="draftkit source tree to compare against")
    p.add_argument("--families", nargs="+", default=list(HEADS))
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=128256, help="Llama-3's vocabulary")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/loss_memory.json")
    p.add_argument("--one", choices=list(HEADS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    versions = {"new": ROOT}
    if args.baseline_src is not None:
        versions = {"today": args.baseline_src.resolve(), **versions}
    child = [a for a in sys.argv[1:] if not a.startswith("--baseline-src") and a != str(args.baseline_src)]
    rows = []
    for family in args.families:
        row = {"family": family, "head": HEADS[family]}
        for name, src in versions.items():
            env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
            res = subprocess.run([sys.executable, __file__, *child, "--one", family], env=env,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{family} ({name}) failed:\n{res.stderr[-3000:]}")
            row[name] = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(row)
        cells = "  ".join(f"{n} {row[n]['peak_bytes'] / 2**30:6.2f} GiB {row[n]['seconds']:6.1f} s loss {row[n]['loss']:.6f}"
                          for n in versions)
        print(f"{family:7s} {cells}", flush=True)
    settings = {k: getattr(args, k) for k in ("length", "batch", "vocab", "hidden", "intermediate", "heads",
                                              "kv_heads", "threads")}
    result = {"settings": settings, "command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": rows}
    from draftkit.inference.report import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
