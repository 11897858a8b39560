"""Why a head's acceptance halves off its training distribution (issue 20): one run that separates
the hypotheses, on the Spec-Bench dev prompts per category and the recipe's held-aside prompts.

    python benchmarks/acceptance_gap.py --run runs/eagle --budget-s 840       # the recipe's head, <= 15 min
    python benchmarks/acceptance_gap.py --run runs/quick --limit 2 --max-new-tokens 32 \\
        --prepared ~/.cache/draftkit/data/prepared/<fingerprint>              # a quick look

For every prompt and every --dtypes entry (target and head in that dtype, as `draftkit eval
--dtype` runs them) the loop decodes it (head-only chain k, T = 0; inference/decoder.py, traced
step by step: inference/agreement.py loop_trace). On the continuation it verified, the head is then
teacher-forced with the TRAINING features (one target forward through train/data.py's
FeatureStore, the recipe's feature storage round trip), drafting k from every position and
feeding its own drafts from depth 2 on, as the loop does (agreement.teacher_forced). In the dtype
the head trained against (its config.json's training_dtype), the head is also teacher-forced as it
trained: fp32 weights under the recipe's train.autocast ("train" numerics, depth 1). The last
--dtypes entry is the headline (context positions, the verdicts). Counted per group (agreement.Tally):

- teacher-forced top-1 / top-k agreement by depth 1..k, and alpha_d = agreement at depth d given
  depths 1..d-1 agreed (the steps a loop reaches depth d in), beside the same tokens drafted at
  depth 1 with the target's true features (the compounding control);
- depth-1 agreement by context position of the drafted token (0-256, 256-512, 512-1024, >1024), on
  the continuation and, at every position of prompt + continuation, against the target's top-1
  (what data.loss_on: all trains on), split at the recipe's data.max_length inside the sequences
  that cross it;
- the loop's alpha_1..k, the same rule replayed on the teacher-forced drafts at the loop's own
  roots (agreement.replay), and the fraction of steps where the two accepted different counts;
- the fraction of the continuation's tokens outside the head's draft vocabulary;
- depth-1 agreement on tokens whose bigram with the token before already occurs in the context
  (what prompt lookup drafts) and on the others;
- depth-1 agreement by the target's own probability of the drafted token (its confidence), and
  what the held-aside prompts' agreement per confidence bin predicts on each group's mix of bins:
  the part of the gap owed to text the target itself is unsure of, and the head's own shortfall.

The `verdict` section is computed from these figures, one entry per hypothesis of the issue
(thresholds EFFECT and SHIFT below). Prints tables and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from draftkit.config import load_recipe
from draftkit.heads.base import load_head
from draftkit.inference.agreement import (BUCKETS, CONFIDENCE, Tally, bucket_of, confidence_bin, loop_trace,
                                         teacher_forced, training_features)
from draftkit.inference.cli_eval import resolve_head_dir
from draftkit.inference.decoder import SpecDecoder, stop_token_ids
from draftkit.inference.drafters import DraftSettings
from draftkit.inference.evaluate import _prepare, as_prompts, read_prompt_file
from draftkit.inference.report import atomic_write
from draftkit.target import cpu_flags, load_target

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "benchmarks" / "results" / "specbench_dev60.jsonl"
HELD = "held-aside"
SPEC = "spec-bench"
EFFECT = 0.05  # an agreement difference this large (absolute) explains part of the gap: confirmed
SHIFT = 0.10  # a category this far below the held-aside prompts is off the training distribution


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def held_aside(recipe, target, prepared: str | None, run: Path | None = None) -> list:
    """The recipe's held-aside prompts (data.holdout: never trained on), from its prepared data: --prepared,
    else the directory the run trained on (<run>/prepared.json, written by the trainer), else the one its
    recipe's settings give today (the key depends on the working directory for relative data.sources)."""
    from draftkit.distill.prepare import load_prepared, trained_on

    said = run / "prepared.json" if run is not None else None
    logged = Path(json.loads(said.read_text())["directory"]) if said is not None and said.is_file() else None
    if prepared:
        out = Path(prepared).expanduser()
    elif logged is not None and (logged / "manifest.json").is_file():
        out = logged
    else:
        out = trained_on(recipe, target,
                         recipe.samples_needed(recipe.train.micro_batch_size * recipe.train.grad_accum))
    if out is None:
        sys.exit("the recipe's prepared data (stage 1) is not in the cache for these settings (written by another "
                 "draftkit?): pass --prepared DIR or --no-held-aside; finished ones: " + "; ".join(_candidates(recipe)))
    prompts = as_prompts(load_prepared(out).holdout_prompts)
    for p in prompts:
        p.category = HELD
    return prompts


def _candidates(recipe) -> list[str]:
    """Finished prepared directories in the recipe's cache, with what their manifests say."""
    from draftkit.distill.prepare import prepared_dir

    root = prepared_dir(recipe, "x").parent
    found = []
    for manifest in sorted(root.glob("*/manifest.json"), key=lambda p: p.stat().st_mtime):
        m = json.loads(manifest.read_text())
        found.append(f"{manifest.parent} ({m.get('num_samples')} samples, loss_on {m.get('loss_on')}, "
                     f"{m.get('stats', {}).get('holdout')} held aside)")
    return found or ["none"]


def grouped(target, prompts, limit: int | None, k: int, max_new: int) -> list[dict]:
    """Tokenized prompts (evaluate's rule: those that do not fit are skipped), at most `limit` per
    group, in round-robin order over the groups (so a run cut short by --budget-s covers each alike)."""
    items, skipped = _prepare(target, prompts, k, max_new)
    for s in skipped:
        print(f"skipped {s['id']}: {s['reason']}", file=sys.stderr)
    by_group: dict[str, list[dict]] = {}
    for it in items:
        by_group.setdefault(it["category"], []).append(it)
    rounds = max(map(len, by_group.values()), default=0)
    rounds = rounds if limit is None else min(rounds, limit)
    return [g[i] for i in range(rounds) for g in by_group.values() if i < len(g)]


# ---------------------------------------------------------------------------------------------
# One dtype
# ---------------------------------------------------------------------------------------------


class Measure:
    """One dtype's target, the head as `draftkit eval --dtype` runs it (cast to the target's dtype),
    optionally the head as it trained (fp32 weights under train.autocast), and the chain loop."""

    def __init__(self, args, recipe, head_dir: Path, dtype: str, train_numerics: bool, context: bool):
        from draftkit.train.deepspeed_config import head_autocast

        t = recipe.target
        self.args, self.recipe, self.context = args, recipe, context
        self.target = load_target(t.path, gguf_file=t.gguf_file, dtype=dtype, trust_remote_code=t.trust_remote_code)
        self.head = load_head(head_dir, self.target).to(dtype=self.target.dtype).eval()
        self.trained = load_head(head_dir, self.target).eval() if train_numerics else None
        self.autocast = head_autocast(recipe.train, self.target.device)
        drafter, kw = DraftSettings(mode="chain", k=args.k).decoder_args(self.head)
        self.stops = stop_token_ids(self.target)
        self.decoder = SpecDecoder(self.target, drafter, stop_ids=self.stops, **kw)
        vocab = getattr(self.head, "draft_vocab", None)  # the draft vocabulary's target ids, or None
        self.vocab = set(vocab.tolist()) if vocab is not None else None
        self.groups: dict[str, dict[str, Tally]] = {"loop": {}, "train": {}}

    def prompt(self, it: dict) -> None:
        """Loop, then teacher-forced on what the loop verified; counted in its group and the pool."""
        a_, ids = self.args, it["ids"]
        names = [it["category"]] + ([SPEC] if it["category"] != HELD else [])
        trace = loop_trace(self.decoder, ids, a_.max_new_tokens)
        feats, top1, prob = training_features(self.target, self.head.feature_layers, ids + trace.continuation,
                                              self.recipe.train.feature_storage)
        a = teacher_forced(self.head, ids, trace.continuation, feats, top1, a_.k, a_.topk, context=self.context,
                           top1_prob=prob)
        err = trace.feature_error(feats, len(ids))
        for name in names:
            self.tally("loop", name, a_.k).add(a, self.vocab, trace, a_.max_new_tokens, self.stops, err)
        if self.trained is not None:  # the same features, the head as it trained: depth 1 (a quarter of the cost)
            b = teacher_forced(self.trained, ids, trace.continuation, feats, top1, 1, a_.topk,
                               autocast=self.autocast, context=False)
            for name in names:
                self.tally("train", name, 1).add(b, self.vocab)

    def tally(self, kind: str, name: str, k: int) -> Tally:
        groups = self.groups[kind]
        if name not in groups:
            groups[name] = Tally(k, self.recipe.data.max_length)
        return groups[name]

    def facts(self) -> dict:
        return {"target_dtype": str(self.target.dtype).removeprefix("torch."),
                "autocast": str(self.autocast).removeprefix("torch.") if self.autocast else None,
                "draft_vocab_size": len(self.vocab) if self.vocab is not None else None}


def measure_dtype(args, recipe, head_dir: Path, dtype: str, prompts, train_numerics: bool, context: bool,
                  budget_s: float | None = None) -> dict:
    """The prompts in `dtype` (no new one after budget_s seconds): the facts, the seconds, and per
    kind ("loop", "train") and group the Tally's figures. context: also depth 1 at every prompt
    position (a head call each)."""
    m = Measure(args, recipe, head_dir, dtype, train_numerics, context)
    items = grouped(m.target, prompts, args.limit, args.k, args.max_new_tokens)
    t0, done = time.perf_counter(), 0
    for it in items:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            print(f"  {dtype}: --budget-s spent: stopped after {done} of {len(items)} prompts", file=sys.stderr)
            break
        m.prompt(it)
        done += 1
        print(f"  {dtype}: {done}/{len(items)} prompts, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    out = {**m.facts(), "seconds": time.perf_counter() - t0, "prompts_done": done, "prompts_planned": len(items)}
    out.update({kind: {g: t.to_dict() for g, t in tallies.items()} for kind, tallies in m.groups.items() if tallies})
    return out


# ---------------------------------------------------------------------------------------------
# Verdicts: one per hypothesis of the issue, from the figures
# ---------------------------------------------------------------------------------------------


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def verdict_mismatch(res: dict) -> dict:
    """Train/inference mismatch: the loop accepts less than the teacher-forced drafts on the same
    steps (features, positions, the head's cache after roll-back), the head as trained agrees more
    than in the loop's dtype, or the draft vocabulary misses more of what the target says on
    Spec-Bench than on the held-aside prompts. Each tested against EFFECT."""
    tested, figures = {}, {}
    for dtype, cfg in res["configs"].items():
        s = cfg["loop"].get(SPEC) or next(iter(cfg["loop"].values()))
        tested[f"{dtype} replay - loop alpha_1"] = _minus(s["replay_alpha"][0], s["loop_alpha"][0])
        figures[f"{dtype} steps where loop and teacher-forced differ"] = s["steps_differing"]
        figures[f"{dtype} loop vs training features, relative error"] = s["loop_feature_rel_error"]
        if cfg.get("train"):
            t = cfg["train"].get(SPEC) or next(iter(cfg["train"].values()))
            tested[f"{dtype} depth-1 top-1 as trained (fp32 + {cfg['autocast']} autocast) - as loaded"] = _minus(
                t["tf_top1"][0], s["tf_top1"][0])
    spec, held = _pooled(res, SPEC), _pooled(res, HELD)
    if spec is not None:
        oov_held = held["outside_draft_vocab"] if held else 0.0
        tested["Spec-Bench - held-aside tokens outside the draft vocabulary"] = _minus(
            spec["outside_draft_vocab"], oov_held)
        figures["outside the draft vocabulary"] = {c: g["outside_draft_vocab"] for c, g in ordered(_groups(res))}
    confirmed = [f"{name} {v:.3f}" for name, v in tested.items() if v is not None and v >= EFFECT]
    said = "; ".join(f"{name} {_fmt(v)}" for name, v in tested.items())
    return _verdict(confirmed, {**tested, **figures}, f"each below {EFFECT}: {said}")


def verdict_long_context(res: dict) -> dict:
    """Contexts longer than training: agreement inside sequences that cross data.max_length falls
    from the positions before it to those after."""
    s = _pooled(res, SPEC, "context_split") or _pooled(res, HELD, "context_split")
    figures = {"max_length": s["max_length"] if s else None}
    if not s or not s["n_from"] or not s["n_before"]:
        return {"verdict": "not measured", "why": "no sequence crosses data.max_length (or --no-context)",
                "figures": figures}
    drop = s["top1_before"] - s["top1_from"]
    figures.update({"depth-1 vs target top-1 before max_length": s["top1_before"],
                    "from max_length on": s["top1_from"], "drop": drop,
                    "positions before / from": [s["n_before"], s["n_from"]]})
    spec = _pooled(res, SPEC)
    if spec:
        figures["continuation depth-1 top-1 by position"] = {b: v["top1"] for b, v in spec["by_position"].items()}
    why = f"depth-1 agreement falls {drop:.3f} from positions < {s['max_length']} to >= {s['max_length']}"
    return _verdict([why] if drop >= EFFECT else [], figures, why.replace("falls", "changes by"))


def verdict_compounding(res: dict) -> dict:
    """Compounding at depth >= 2: fed its own drafts and features, the head agrees less than it does
    on the same tokens from the target's features (same steps, depths 1..d-1 agreed)."""
    s = _pooled(res, SPEC)
    if s is None:
        return {"verdict": "not measured", "figures": {}}
    own, true = s["tf_alpha"][1:], s["tf_alpha_true_features"][1:]
    drops = [t - o for o, t in zip(own, true) if o is not None and t is not None]
    mean = sum(drops) / len(drops) if drops else None
    figures = {"tf_alpha (own drafts)": s["tf_alpha"], "same tokens from true features": s["tf_alpha_true_features"],
               "mean drop at depth >= 2": mean}
    if mean is None:
        return {"verdict": "not measured", "figures": figures}
    why = f"at depth 2..{len(s['tf_alpha'])} its own features cost {mean:.3f} agreement on average"
    return _verdict([why] if mean >= EFFECT else [], figures, why)


def verdict_shift(res: dict) -> dict:
    """Distribution shift: a category's teacher-forced depth-1 agreement lies SHIFT below the
    held-aside prompts', on the continuation overall and within positions < max_length too."""
    held = _pooled(res, HELD)
    if held is None:
        return {"verdict": "not measured", "why": "no held-aside prompts (--no-held-aside)", "figures": {}}
    short = _short(held)
    figures, low = {"held-aside depth-1 top-1": held["tf_top1"][0], "held-aside, positions < 512": short}, []
    for cat, s in _groups(res).items():
        if cat in (HELD, SPEC):
            continue
        gap, gap_short = held["tf_top1"][0] - s["tf_top1"][0], None
        if short is not None and _short(s) is not None:
            gap_short = short - _short(s)
        figures[cat] = {"depth-1 top-1": s["tf_top1"][0], "gap": gap, "gap at positions < 512": gap_short}
        if gap >= SHIFT and (gap_short is None or gap_short >= SHIFT):
            low.append(f"{cat} ({gap:.3f} below)")
    worst = max(((c, f["gap"]) for c, f in figures.items() if isinstance(f, dict)), key=lambda cf: cf[1],
                default=(None, None))
    why = "teacher-forced depth-1 agreement low on " + ", ".join(low) if low else (
        f"no category lies {SHIFT} below the held-aside prompts (largest gap {_fmt(worst[1])}, {worst[0]})")
    return _verdict([why] if low else [], figures, why)


def confidence_split(group: dict, ref: dict) -> dict | None:
    """`group`'s depth-1 agreement beside what `ref`'s agreement per bin of the target's confidence
    would give on `group`'s mix of bins: the gap ref - group = (ref - expected), the part owed to
    text the target itself is less sure of, + (expected - group), the head's own shortfall at equal
    confidence. Bins `ref` has no position in are left out of both."""
    g, r = group.get("by_target_confidence") or {}, ref.get("by_target_confidence") or {}
    bins = [b for b in g if r.get(b, {}).get("n")]
    n, n_ref = sum(g[b]["n"] for b in bins), sum(v["n"] for v in r.values())
    if not n or not n_ref:
        return None
    actual = sum(g[b]["n"] * g[b]["top1"] for b in bins) / n
    expected = sum(g[b]["n"] * r[b]["top1"] for b in bins) / n
    ref_top1 = sum(v["n"] * v["top1"] for v in r.values()) / n_ref
    return {"depth-1 top-1": actual, "expected": expected, "reference depth-1 top-1": ref_top1,
            "gap": ref_top1 - actual, "from the target's confidence": ref_top1 - expected,
            "at equal confidence": expected - actual, "mean target confidence": group.get("mean_target_confidence"),
            "reference mean target confidence": ref.get("mean_target_confidence"),
            "share of positions by bin": {b: g[b]["n"] / n for b in bins}}


def verdict_uncertainty(res: dict) -> dict:
    """The target's own uncertainty: Spec-Bench's text is less settled for the target than the
    held-aside prompts' (a lower probability of the token it emits), and the head's agreement at each
    level of that probability, taken from the held-aside prompts, explains EFFECT or more of the gap
    (confidence_split). What is left is the head's shortfall on this traffic at equal confidence."""
    spec, held = _pooled(res, SPEC), _pooled(res, HELD)
    split = confidence_split(spec, held) if spec and held else None
    if split is None:
        return {"verdict": "not measured", "why": "no held-aside prompts or no target probabilities", "figures": {}}
    figures = {SPEC: split, **{c: confidence_split(s, held) for c, s in _groups(res).items() if c not in (SPEC, HELD)}}
    part = split["from the target's confidence"]
    why = (f"{part:.3f} of the {split['gap']:.3f} depth-1 gap comes from the target's lower confidence on Spec-Bench "
           f"(mean {_fmt(split['mean target confidence'])} vs {_fmt(split['reference mean target confidence'])}); "
           f"{split['at equal confidence']:.3f} is the head's at equal confidence")
    return _verdict([why] if part >= EFFECT else [], figures, why)


def gap_summary(res: dict) -> dict:
    """Held-aside minus Spec-Bench, per dtype: the loop's alpha_1 and tau, and the teacher-forced
    depth-1 agreement (the part of the gap that is there before any loop runs)."""
    out = {}
    for dtype, cfg in res["configs"].items():
        held, spec = cfg["loop"].get(HELD), cfg["loop"].get(SPEC)
        if held is None or spec is None:
            continue
        out[dtype] = {"loop_alpha_1": [held["loop_alpha"][0], spec["loop_alpha"][0]],
                      "loop_tau": [held["loop_tau"], spec["loop_tau"]],
                      "tf_top1_depth1": [held["tf_top1"][0], spec["tf_top1"][0]],
                      "gap_loop_alpha_1": _minus(held["loop_alpha"][0], spec["loop_alpha"][0]),
                      "gap_tf_top1_depth1": _minus(held["tf_top1"][0], spec["tf_top1"][0])}
    return out


def _minus(a, b):
    return None if a is None or b is None else a - b


def _short(s: dict) -> float | None:
    """Depth-1 continuation agreement at positions < 512 (the buckets below it, pooled)."""
    parts = [v for b, v in s["by_position"].items() if not b.startswith(">") and int(b.split("-")[1]) <= 512]
    n = sum(v["n"] for v in parts)
    return sum(v["top1"] * v["n"] for v in parts) / n if n else None


def _verdict(confirmed: list[str], figures: dict, otherwise: str) -> dict:
    if confirmed:
        return {"verdict": "confirmed", "why": "; ".join(confirmed), "figures": figures}
    return {"verdict": "ruled out", "why": otherwise, "figures": figures}


def _groups(res: dict) -> dict:
    """The groups of the headline configuration (the served dtype's loop)."""
    return res["configs"][res["headline"]]["loop"]


def _pooled(res: dict, name: str, key: str | None = None):
    s = _groups(res).get(name)
    return s if s is None or key is None else s[key]


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def ordered(groups: dict) -> list[tuple[str, dict]]:
    """Categories by name, then the Spec-Bench pool, then the held-aside prompts."""
    return sorted(groups.items(), key=lambda kv: ({SPEC: 1, HELD: 2}.get(kv[0], 0), kv[0]))


def print_tables(res: dict) -> None:
    k = res["k"]
    for dtype, cfg in res["configs"].items():
        print(f"\n[{dtype}] {cfg['prompts_done']} of {cfg['prompts_planned']} prompts in {cfg['seconds']:.0f} s: "
              f"teacher-forced (training features, {dtype} head) vs the loop, chain k={k}, T=0; "
              f"oov = outside the draft vocabulary, tf1/tfk = depth-1 top-1/top-{res['topk']}")
        print(f"{'group':<15}{'n':>3}{'len':>6}{'oov':>6}{'tf1':>7}{'tfk':>7}  " + f"tf alpha_1..{k}".ljust(6 * k + 1)
              + f"loop alpha_1..{k}".ljust(6 * k + 1) + f"{'replay a1':>9}{'differ':>7}{'feat err':>9}{'tau':>6}")
        for name, s in ordered(cfg["loop"]):
            print(f"{name:<15}{s['prompts']:>3}{s['mean_prompt_tokens']:>6.0f}{_fmt(s['outside_draft_vocab']):>6}"
                  f"{_fmt(s['tf_top1'][0]):>7}{_fmt(s['tf_topk'][0]):>7}  " + _row(s["tf_alpha"], k)
                  + _row(s["loop_alpha"], k) + f"{_fmt(s['replay_alpha'][0]):>9}{_fmt(s['steps_differing']):>7}"
                  f"{s['loop_feature_rel_error'] or 0:>9.1e}{s['loop_tau']:>6.2f}")
        if cfg.get("train"):
            print(f"  the head as trained (fp32 weights, {cfg['autocast']} autocast), same features: depth-1 "
                  f"top-1, top-{res['topk']}, top-1 minus the {dtype} head's")
            for name, s in ordered(cfg["train"]):
                print(f"  {name:<15}{_fmt(s['tf_top1'][0]):>7}{_fmt(s['tf_topk'][0]):>7}"
                      f"{_fmt(_minus(s['tf_top1'][0], cfg['loop'][name]['tf_top1'][0])):>8}")
        print(f"  compounding control, tf alpha_1..{k} with depth d drafted from the true features instead:")
        for name, s in ordered(cfg["loop"]):
            print(f"  {name:<15}" + _row(s["tf_alpha_true_features"], k))
    print_positions(res)
    print_confidence(res)
    for dtype, g in res.get("gap", {}).items():
        print(f"\n[{dtype}] held-aside vs Spec-Bench: loop alpha_1 {_fmt(g['loop_alpha_1'][0])} vs "
              f"{_fmt(g['loop_alpha_1'][1])} (gap {_fmt(g['gap_loop_alpha_1'])}), teacher-forced depth-1 "
              f"{_fmt(g['tf_top1_depth1'][0])} vs {_fmt(g['tf_top1_depth1'][1])} "
              f"(gap {_fmt(g['gap_tf_top1_depth1'])}), "
              f"tau {g['loop_tau'][0]:.2f} vs {g['loop_tau'][1]:.2f}")
    print("\nverdicts:")
    for name, v in res["verdict"].items():
        print(f"  {name}: {v['verdict'].upper()} - {v.get('why', '')}")


def _row(values, k: int) -> str:
    return " ".join(f"{_fmt(v):>5}" for v in values).ljust(6 * k + 1)


def print_positions(res: dict) -> None:
    labels = [bucket_of(b) for b in BUCKETS]
    print(f"\n[{res['headline']}] depth-1 top-1 by position of the drafted token (n): on the continuation | at every "
          f"position, vs the target's top-1")
    print(f"{'group':<15}" + "".join(f"{b:>15}" for b in labels) + " |" + "".join(f"{b:>15}" for b in labels))
    cell = lambda d, b: f"{_fmt(d[b]['top1'])} ({d[b]['n']})" if b in d else "-"  # noqa: E731
    for name, s in ordered(_groups(res)):
        print(f"{name:<15}" + "".join(f"{cell(s['by_position'], b):>15}" for b in labels) + " |"
              + "".join(f"{cell(s['context_by_position'], b):>15}" for b in labels))


def print_confidence(res: dict) -> None:
    labels = [confidence_bin(c) for c in CONFIDENCE]
    print(f"\n[{res['headline']}] depth-1 top-1 by the target's probability of the drafted token (share of "
          f"positions); expected: at the held-aside prompts' rate per bin; and on tokens whose bigram with the "
          f"token before occurs earlier in the context (what prompt lookup drafts) or not")
    print(f"{'group':<15}{'mean p':>7}" + "".join(f"{b:>14}" for b in labels) + f"{'tf1':>7}{'expected':>9}"
          + f"{'seen bigram':>15}{'new bigram':>15}")
    held = _pooled(res, HELD)
    for name, s in ordered(_groups(res)):
        bins = s.get("by_target_confidence") or {}
        n = sum(v["n"] for v in bins.values())
        cells = [f"{_fmt(bins[b]['top1'])} ({bins[b]['n'] / n:.2f})" if b in bins else "-" for b in labels]
        split = confidence_split(s, held) if held else None
        copy = s.get("by_copy") or {}
        m = sum(v["n"] for v in copy.values())
        kinds = [f"{_fmt(copy[c]['top1'])} ({copy[c]['n'] / m:.2f})" if m else "-"
                 for c in ("seen bigram", "new bigram")]
        print(f"{name:<15}{_fmt(s.get('mean_target_confidence')):>7}" + "".join(f"{c:>14}" for c in cells)
              + f"{_fmt(s['tf_top1'][0]):>7}{_fmt(split['expected'] if split else None):>9}"
              + "".join(f"{k:>15}" for k in kinds))


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a training run's output_dir (recipe.json, head/)")
    p.add_argument("--head", help="head directory (default: RUN/head)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="Spec-Bench prompts with categories")
    p.add_argument("--prepared", help="the recipe's prepared data directory (default: the run's prepared.json, "
                                      "else found from recipe.json)")
    p.add_argument("--no-held-aside", dest="held_aside", action="store_false")
    p.add_argument("--limit", type=int, help="prompts per category (and of the held-aside ones)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; the last is the headline")
    p.add_argument("--k", type=int, default=4, help="chain length (depths)")
    p.add_argument("--topk", type=int, default=4, help="the k of top-k agreement")
    p.add_argument("--no-context", dest="context", action="store_false",
                   help="skip depth-1 at every prompt position (faster; no long-context split)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for the whole run: each dtype gets a share of what is left (the headline "
                        "twice the others') and starts no prompt after it (prompts go round-robin over the groups; "
                        "the JSON says how many ran)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "acceptance_gap.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Path(args.run)
    recipe = load_recipe(run / "recipe.json")  # JSON is YAML: the recipe as the run resolved it
    head_dir = resolve_head_dir(args.head or str(run / "head"))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    trained_dtype = training_dtype(recipe, head_dir)
    prompts = read_prompt_file(args.prompts)
    if args.held_aside:
        t = recipe.target
        prompts += held_aside(recipe, load_target(t.path, gguf_file=t.gguf_file, dtype=t.dtype,
                                                  trust_remote_code=t.trust_remote_code, transformer=False),
                              args.prepared, run)
    t0 = time.perf_counter()
    configs = {}
    for i, dtype in enumerate(dtypes):
        weights = [2 if d == dtypes[-1] else 1 for d in dtypes[i:]]  # the headline does more per prompt
        left = None if args.budget_s is None else (
            (args.budget_s - (time.perf_counter() - t0)) * weights[0] / sum(weights))
        configs[dtype] = measure_dtype(args, recipe, head_dir, dtype, prompts,
                                       train_numerics=dtype == trained_dtype,
                                       context=args.context and dtype == dtypes[-1], budget_s=left)
    res = {"what": "issue 20: where acceptance is lost off the training distribution (benchmarks/acceptance_gap.py)",
           "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
           "head": str(head_dir), "recipe": str(run / "recipe.json"), "prompts": args.prompts,
           "k": args.k, "topk": args.topk, "max_new_tokens": args.max_new_tokens, "limit": args.limit,
           "budget_s": args.budget_s,
           "max_length": recipe.data.max_length, "headline": dtypes[-1],
           "dtypes": dtype_facts(recipe, trained_dtype, configs), "configs": configs,
           "machine": {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
                       "python": platform.python_version(), "torch": torch.__version__},
           "seconds": time.perf_counter() - t0}
    res["gap"] = gap_summary(res)
    res["verdict"] = {"train_inference_mismatch": verdict_mismatch(res), "long_context": verdict_long_context(res),
                      "compounding": verdict_compounding(res), "distribution_shift": verdict_shift(res),
                      "target_uncertainty": verdict_uncertainty(res)}
    print_tables(res)
    atomic_write(Path(args.out), json.dumps(res, indent=1, default=str))
    print(f"\nwrote {args.out} ({res['seconds']:.0f} s)")
    return 0


def training_dtype(recipe, head_dir: Path) -> str:
    """The target dtype the head trained against: what the trainer wrote into its config.json, else
    the recipe's target.dtype as `auto` resolves it here."""
    from draftkit.heads.base import read_head_config
    from draftkit.target import resolve_dtype

    return read_head_config(head_dir).get("training_dtype") or resolve_dtype(recipe.target.dtype)[0]


def dtype_facts(recipe, trained_dtype: str, configs: dict) -> dict:
    """What dtype each stage ran its features and head in."""
    tr = recipe.train
    trained = next((c for c in configs.values() if c.get("train")), None)
    return {"stored_features": f"{trained_dtype} target, train.feature_storage {tr.feature_storage}",
            "training_head": f"fp32 weights, train.autocast {tr.autocast}"
                             + (f" -> {trained['autocast']}" if trained else ""),
            "in_training_eval": f"{trained_dtype} target, fp32 head weights, no autocast "
                                "(Trainer.speculative_eval)",
            "loop": {d: f"{c['target_dtype']} target and head (draftkit eval --dtype {d})" for d, c in configs.items()}}


if __name__ == "__main__":
    sys.exit(main())
