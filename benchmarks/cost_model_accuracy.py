"""Does the cost model say what it will deliver? Calibrate `--draft auto` on some prompts, then
measure, on OTHER prompts, the shape it chose and three others (the best lookup alone, the best
head tree without lookup, a big hybrid), each interleaved with plain decoding prompt by prompt,
and set the predicted speedup (and tau) beside the measured one, per temperature.

    python benchmarks/cost_model_accuracy.py --head runs/quick/head \
        --prompts benchmarks/results/specbench_dev60.jsonl --calibration 16 --measure 12 \
        --max-new-tokens 64 --temperatures 0 1 --dtype bfloat16

Prints a table and writes benchmarks/results/cost_model_accuracy.json (atomically). Run it alone
on the machine (../shared/bin/one-at-a-time): timings taken beside another job mean nothing.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from draftkit.heads.base import load_head
from draftkit.target import cpu_flags
from draftkit.inference.calibrate import CALIBRATION_PROMPTS, calibration_prompts
from draftkit.inference.cost import (OTHERS_CORES, Candidate, auto_draft, others_meter, predict,
                                     simulate, trace_prompt)
from draftkit.inference.decoder import SpecDecoder, plain_generate, stop_token_ids
from draftkit.inference.evaluate import _prepare, read_prompt_file
from draftkit.inference.report import atomic_write
from draftkit.inference.sampling import SamplingParams
from draftkit.target import load_target


def others(rows: list[dict], chosen: Candidate | None) -> list[Candidate]:
    """The chosen shape (or the best when plain was chosen) and three of other kinds."""
    first = chosen or rows[0]["candidate"]
    picks = [first]
    kinds = [lambda c: c.topk == 0,  # lookup alone
             lambda c: c.topk and not c.lookup_len,  # the head's tree alone
             lambda c: c.topk >= 4 and c.depth >= 3 and c.budget >= 16 and c.lookup_len]  # a big hybrid
    for kind in kinds:
        c = next((r["candidate"] for r in rows if kind(r["candidate"]) and r["candidate"] not in picks), None)
        if c is not None:
            picks.append(c)
    return picks


def measure(target, head, shapes: list[Candidate], prompts, max_new: int, params: SamplingParams, seed: int,
            retries: int = 2):
    """tokens/s and tau of plain decoding and every shape on `prompts`, interleaved prompt by prompt;
    per shape also every step's verify time by width (the loop's on_step hook). A run during which
    other processes took more than OTHERS_CORES is run again (up to `retries` times) and the least
    disturbed kept; what others took is reported per method."""
    stop = stop_token_ids(target)
    decs, widths = {}, {c: {} for c in shapes}
    for c in shapes:
        drafter, kw = c.settings(_base()).decoder_args(head)
        decs[c] = SpecDecoder(target, drafter, stop_ids=stop, **kw)
    names = ["plain", *shapes]
    for d in decs.values():  # warm-up, untimed
        d.generate([prompts[0]], 4, SamplingParams(), [0])
    plain_generate(target, [prompts[0]], 4)
    tot = {n: [0.0, 0, 0, 0] for n in names}  # seconds, new tokens, emitted, row steps
    part = {c: [0.0, 0.0, 0.0, 0] for c in shapes}  # prefill s, draft s, verify s, steps
    others = {n: [0.0, 0] for n in names}  # others' core-seconds during the kept runs, reruns
    for i, p in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            st, busy, steps, reruns = _quietest(lambda: _run(decs.get(n), target, p, max_new, params, seed + i, stop),
                                                retries)
            others[n][0] += busy * st.total_s
            others[n][1] += reruns
            tot[n][0] += st.total_s
            tot[n][1] += st.new_tokens
            if n != "plain":
                tot[n][2] += st.emitted
                tot[n][3] += st.row_steps
                for j, v in enumerate((st.prefill_s, st.draft_s, st.verify_s, st.steps)):
                    part[n][j] += v
                for w, ms in steps:
                    widths[n].setdefault(w, []).append(ms)
        print(f"  measured {i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    plain_tps = tot["plain"][1] / tot["plain"][0]
    return {c: {"speedup": (tot[c][1] / tot[c][0]) / plain_tps, "tau": tot[c][2] / max(tot[c][3], 1),
                "tokens_per_s": tot[c][1] / tot[c][0], "parts_ms": _measured_parts(tot[c][0], *part[c]),
                "verify_ms_by_width": widths[c], "others_cores": others[c][0] / tot[c][0], "reruns": others[c][1]}
            for c in shapes}, plain_tps, {"others_cores": others["plain"][0] / tot["plain"][0],
                                          "reruns": others["plain"][1]}


def _run(dec, target, prompt, max_new, params, seed, stop):
    """One measured run: (stats, [(verify width, verify_step ms)] per step) of dec, or plain decoding (dec None)."""
    if dec is None:
        _, st, _ = plain_generate(target, [prompt], max_new, params, [seed], stop)
        return st, []
    steps = []
    dec.on_step = lambda tree, draft_s, verify_s: steps.append((int(tree.num_nodes[0]) + 1, 1e3 * verify_s))
    _, st = dec.generate([prompt], max_new, params, [seed])
    dec.on_step = None
    return st, steps


def _quietest(run, retries: int):
    """run() up to 1 + retries times while other processes took more than OTHERS_CORES during it:
    (stats, others' cores, per-step widths and times) of the quietest, and the number of reruns."""
    best, reruns = None, 0
    for attempt in range(1 + retries):
        meter = others_meter()
        st, steps = run()
        busy = meter()
        if best is None or busy < best[1]:
            best = (st, busy, steps)
        if busy <= OTHERS_CORES:
            break
        reruns += attempt < retries
    return (*best, reruns)


def verify_by_width(measured: dict, costs) -> dict:
    """Per verify width of the measured runs: steps, the loop's verify_step mean and minimum (ms),
    and the model's calibrated verify(w) beside them."""
    return {str(w): {"steps": len(ms), "measured_mean": round(sum(ms) / len(ms), 2), "measured_min": round(min(ms), 2),
                     "calibrated": round(costs.verify(w), 2)} for w, ms in sorted(measured.items())}


def _measured_parts(total_s, prefill_s, draft_s, verify_s, steps) -> dict:
    """A measured run's ms per step by the loop's own timers: draft (head + lookup), verify (forward,
    walk, commit), the rest (bookkeeping between them), and its prefill per prompt-less total."""
    n = max(steps, 1)
    return {"steps": steps, "prefill_s": round(prefill_s, 3), "step": 1e3 * (total_s - prefill_s) / n,
            "draft": 1e3 * draft_s / n, "verify": 1e3 * verify_s / n,
            "rest": 1e3 * (total_s - prefill_s - draft_s - verify_s) / n}


def predicted_parts(traces, costs, c: Candidate) -> dict:
    """The model's ms per step of c on the traces, by term: verify forward (by width), head drafting,
    lookup, loop overhead, noise rows; and the plain step it compares with against the plain runs
    that made the traces (their wall time less the timed prefill, per token)."""
    steps = [s for tr in traces for s in simulate(tr, c)]  # (tokens, width, head drafted?)
    n = max(len(steps), 1)
    draft = sum(((costs.draft_ms[(c.topk, c.depth)] if h else costs.consume_ms) if c.topk else 0.0)
                for _, _, h in steps) / n
    noise = costs.noise_ms_per_row * c.noise_rows if costs.temperature > 0 else 0.0
    plain_run = sum(1e3 * tr.plain_s - tr.prefill_ms for tr in traces) / max(sum(len(tr.tokens) - 1 for tr in traces), 1)
    return {"verify": sum(costs.verify(w) for _, w, _ in steps) / n,
            "mean_width": sum(w for _, w, _ in steps) / n,
            "draft": draft, "lookup": costs.lookup_ms if c.lookup_len else 0.0,
            "overhead": costs.overhead(c),
            "noise": noise, "step": sum(costs.step(c, w, h) for _, w, h in steps) / n,
            "plain_step_model": costs.plain_step(), "plain_step_min": costs.plain_step_ms, "plain_step_in_traces": plain_run}


def _base():
    from draftkit.inference.drafters import DraftSettings
    return DraftSettings()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--prompts", default="benchmarks/results/specbench_dev60.jsonl")
    ap.add_argument("--calibration", type=int, default=CALIBRATION_PROMPTS,
                    help=f"calibration prompts (spread over the file; default {CALIBRATION_PROMPTS}, eval's)")
    ap.add_argument("--measure", type=int, default=12, help="measured prompts, none of the calibration's")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=float, default=None, help="calibration budget per temperature, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retries", type=int, default=2,
                    help="reruns of a measured run during which other processes took > 0.1 cores (default 2)")
    ap.add_argument("--no-own-traces", dest="own_traces", action="store_false",
                    help="skip predicting from the measured prompts' own traces (the model's error alone)")
    ap.add_argument("--out", default="benchmarks/results/cost_model_accuracy.json")
    args = ap.parse_args(argv)

    target = load_target(args.target, dtype=args.dtype, device="cpu")
    head = load_head(Path(args.head), target).to(dtype=target.dtype).eval()
    items, _ = _prepare(target, read_prompt_file(args.prompts), 16, args.max_new_tokens)
    calib = calibration_prompts(items, args.calibration)
    held = calibration_prompts(items, args.measure, skip={tuple(p) for p in calib})  # balanced, disjoint
    result = {"head": args.head, "prompts": args.prompts, "calibration_prompts": len(calib),
              "measured_prompts": len(held), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
              "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "cpu_flags": cpu_flags(), "runs": []}
    lines, parts, wlines = [], [], []
    for T in args.temperatures:
        t0 = time.perf_counter()
        chosen, cal = auto_draft(target, head, calib, temperatures=(T,), max_new_tokens=args.max_new_tokens,
                                 budget_s=args.budget, seed=args.seed, progress=True)
        cal_s = time.perf_counter() - t0
        print(f"T={T:g}: chose {chosen.describe()} ({chosen.chosen_by})", file=sys.stderr, flush=True)
        shapes = others(cal.rows, cal.choice)
        pred = {r["candidate"]: r["by_temperature"][f"{T:g}"] for r in cal.rows if r["candidate"] in shapes}
        got, plain_tps, plain_load = measure(target, head, shapes, held, args.max_new_tokens, SamplingParams(T),
                                             args.seed + 1000, args.retries)
        # the same costs on the measured prompts' own traces: the model's error without the calibration
        # prompts' sampling error (how far 8 prompts' tau is from 12 others')
        depth = max(c.depth for r in cal.rows for c in [r["candidate"]])
        own = [trace_prompt(target, head, p, args.max_new_tokens, SamplingParams(T), args.seed + 1000 + i,
                            (1, 2, 4, 8), depth) for i, p in enumerate(held)] if args.own_traces else None
        run = {"temperature": T, "calibration_s": round(cal_s, 1), "chosen": chosen.describe(),
               "plain_chosen": cal.choice is None, "warnings": cal.warnings, "plain_tokens_per_s": plain_tps,
               "plain_others_cores": round(plain_load["others_cores"], 3), "plain_reruns": plain_load["reruns"],
               "costs": chosen.measured.get("costs"), "shapes": []}
        for c in shapes:
            p, m = pred[c], got[c]
            err = p["speedup"] / m["speedup"] - 1
            o = predict(own, cal.costs[T], c, args.max_new_tokens) if own else None
            run["shapes"].append({"shape": c.label(), "chosen": c == cal.choice, "predicted_speedup": p["speedup"],
                                  "measured_speedup": m["speedup"], "error": err, "predicted_tau": p["tau"],
                                  "measured_tau": m["tau"], "within_10pct": abs(err) <= 0.10,
                                  "own_traces": o and {"tau": o["tau"], "speedup": o["speedup"],
                                                       "error": o["speedup"] / m["speedup"] - 1,
                                                       "parts_ms": predicted_parts(own, cal.costs[T], c)},
                                  "measured_parts_ms": m["parts_ms"],
                                  "verify_by_width": verify_by_width(m["verify_ms_by_width"], cal.costs[T]),
                                  "others_cores": round(m["others_cores"], 3), "reruns": m["reruns"]})
            own_cells = (f" {o['tau']:.2f} / {o['speedup']:.2f}x ({100 * (o['speedup'] / m['speedup'] - 1):+.1f}%) |"
                         if o else " - |")
            lines.append(f"| {T:g} | {c.label()}{' *' if c == cal.choice else ''} | {p['tau']:.2f} | {m['tau']:.2f} | "
                         f"{p['speedup']:.2f}x | {m['speedup']:.2f}x | {100 * err:+.1f}% |{own_cells}")
            vw = run["shapes"][-1]["verify_by_width"]
            wlines.append(f"| {T:g} | {c.label()} | " + ", ".join(
                f"{w}: {v['measured_mean']:.1f} / {v['measured_min']:.1f} vs {v['calibrated']:.1f} ({v['steps']})"
                for w, v in sorted(vw.items(), key=lambda kv: -kv[1]["steps"])[:4]) + f" | {m['others_cores']:.2f} "
                f"({m['reruns']} reruns) |")
            if o:
                q, r = run["shapes"][-1]["own_traces"]["parts_ms"], m["parts_ms"]
                parts.append(f"| {T:g} | {c.label()} | {q['step']:.1f} = verify {q['verify']:.1f} (w {q['mean_width']:.1f}) "
                             f"+ draft {q['draft']:.1f} + lookup {q['lookup']:.1f} + overhead {q['overhead']:.1f} + noise "
                             f"{q['noise']:.1f} | {r['step']:.1f} = verify {r['verify']:.1f} + draft {r['draft']:.1f} + "
                             f"rest {r['rest']:.1f} | {q['plain_step_model']:.1f} / {q['plain_step_in_traces']:.1f} |")
        result["runs"].append(run)
        atomic_write(Path(args.out), json.dumps(result, indent=2, default=str))
    print("| T | shape (* = auto's choice) | tau predicted | tau measured | speedup predicted | measured | error | "
          "on the measured prompts' own traces: tau / speedup (error) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    if parts:
        print("\n| T | shape | predicted ms/step on the measured prompts' traces | measured ms/step (loop timers) | "
              "plain step: model / in the traces' plain runs |")
        print("|---|---|---|---|---|")
        print("\n".join(parts))
    print("\n| T | shape | the loop's verify step by width (most steps first): mean / min ms vs calibrated verify(w) "
          "(steps) | other processes' cores during its runs |")
    print("|---|---|---|---|")
    print("\n".join(wlines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
