"""Evaluation reports: report.json (everything), report.md (the tables), acceptance.png (the plot).

report.json keys (top level = the first temperature; `runs` holds one entry per temperature):
  status ("complete" | "partial"), error, num_prompts, skipped, k, temperature, temperatures,
  acceptance                "rejection (lossless)" or "typical (lossy, eps=..., delta=...)"; lossless (bool)
  tau                       tokens per target forward per row, the bonus / recovered token included
  acceptance_per_position   alpha_i = P(draft i accepted | drafts before it accepted), i = 1..k
  accepted_length_histogram row-steps that accepted 0..k drafts
  tokens_per_s, baseline_tokens_per_s, speedup   speculative vs plain decoding, same run, interleaved
  draft_ms_per_step, verify_ms_per_step          the cost model: one head draft vs one target verify
  greedy_mismatches, greedy_near_ties, greedy_divergences   (T = 0 only) vs plain decoding; a bug
                            when lossless, for information under typical acceptance
  greedy_tie_gap, greedy_max_gap, greedy_failures   the near-tie gap (nats of the float32 top), the
                            largest gap seen, and one line per divergence outside it (stats.compare_greedy)
  ngram                     the prompt-lookup baseline: tau, alpha, tokens_per_s, speedup
  main, draft, draft_description   the measured drafting (hybrid / head / lookup) and its DraftSettings
  draft_source, dtype_choice        (draftkit eval) where the draft shape came from (flags, a saved choice,
                            measured now) and how the dtype was chosen (auto: from which CPU flags)
  methods                   every speculative method of the run side by side (lookup, head, hybrid):
                            tau, alpha, accepted_by_source (head / lookup / both), tokens_per_s, speedup
  per_category              the same numbers per prompt category (with its own `methods`)
  draft.measured.per_category   (--draft auto/calibrate, prompts of 2+ categories) the shape the cost model
                            picks on each category's calibration prompts alone, beside the global choice
matplotlib is optional: without it acceptance.png is skipped with a warning.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [atomic_write(out / "report.json", json.dumps(report, indent=2, default=str)),
             atomic_write(out / "report.md", format_markdown(report))]
    png = write_plot(report, out / "acceptance.png")
    return paths + ([png] if png else [])


def atomic_write(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it: a crash leaves the old file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def _f(x, spec: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _alpha(alphas) -> str:
    return " ".join(_f(a, ".2f") for a in alphas or [])


def summary_rows(report: dict) -> list[list[str]]:
    rows = []
    for run in report.get("runs", []):
        ng = run.get("ngram") or {}
        mism = run.get("greedy_mismatches")
        if mism is not None and report.get("dtype") != "float32":
            mism = f"{mism} ({run.get('greedy_near_ties', 0)} near-ties)"
        if mism is not None and not report.get("lossless", True):
            mism = f"{mism} (lossy)"
        rows.append([_f(run["temperature"], "g"), str(run.get("done_prompts", "")), _f(run.get("tau")),
                     _alpha(run.get("acceptance_per_position")), _f(run.get("tokens_per_s"), ".1f"),
                     _f(run.get("baseline_tokens_per_s"), ".1f"), _f(run.get("speedup"), ".2f") + "x",
                     _f(ng.get("tau")), _f(ng.get("speedup"), ".2f") + "x",
                     _f(run.get("draft_ms_per_step"), ".1f"), _f(run.get("verify_ms_per_step"), ".1f"),
                     _f(run.get("plain_ms_per_step"), ".1f"), "–" if mism is None else str(mism)])
    return rows


SUMMARY_HEADER = ["T", "prompts", "tau", "alpha_1..k", "tok/s", "plain tok/s", "speedup", "ngram tau",
                  "ngram speedup", "draft ms/step", "verify ms/step", "plain ms/tok", "T=0 mismatches"]
CATEGORY_HEADER = ["T", "category", "prompts", "tau", "alpha_1..k", "tok/s", "plain tok/s", "speedup",
                   "ngram tau", "ngram speedup"]


METHOD_HEADER = ["T", "category", "method", "prompts", "tau", "alpha_1..k", "tok/s", "speedup", "accepted head/lookup/both",
                 "T=0 mismatches"]


def _sources(m: dict) -> str:
    src = m.get("accepted_by_source") or {}
    return "/".join(str(src.get(k, 0)) for k in ("head", "lookup", "both"))


def method_rows(report: dict, categories: bool = True) -> list[list[str]]:
    """One row per (temperature, category, method): the side-by-side comparison."""
    rows = []
    for run in report.get("runs", []):
        groups = [("all prompts", run)] + (sorted((run.get("per_category") or {}).items()) if categories else [])
        for cat, c in groups:
            for name, m in (c.get("methods") or {}).items():
                mism = m.get("greedy_mismatches")
                rows.append([_f(run["temperature"], "g"), cat, name + (" *" if name == report.get("main") else ""),
                             str(c.get("num_prompts", run.get("done_prompts", ""))), _f(m.get("tau")),
                             _alpha(m.get("acceptance_per_position")), _f(m.get("tokens_per_s"), ".1f"),
                             _f(m.get("speedup"), ".2f") + "x", _sources(m),
                             "–" if mism is None else f"{mism} ({m.get('greedy_near_ties', 0)} near-ties)"])
    return rows


def category_rows(report: dict) -> list[list[str]]:
    rows = []
    for run in report.get("runs", []):
        for cat, c in sorted((run.get("per_category") or {}).items()):
            ng = c.get("ngram") or {}
            rows.append([_f(run["temperature"], "g"), cat, str(c.get("num_prompts")), _f(c.get("tau")),
                         _alpha(c.get("acceptance_per_position")), _f(c.get("tokens_per_s"), ".1f"),
                         _f(c.get("baseline_tokens_per_s"), ".1f"), _f(c.get("speedup"), ".2f") + "x",
                         _f(ng.get("tau")), _f(ng.get("speedup"), ".2f") + "x"])
    return rows


CHOICE_HEADER = ["category", "calibration prompts", "best shape here", "predicted speedup", "best candidate",
                 "its speedup"]


def choice_category_rows(report: dict) -> list[list[str]]:
    """One row per category of calibration's per-category choice (cost.choose_per_category): the
    shape that pays most on that category's prompts, plain decoding where none pays."""
    per = ((report.get("draft") or {}).get("measured") or {}).get("per_category") or {}
    return [[cat, str(r.get("prompts")), r.get("shape") or "–", _f(r.get("speedup"), ".2f") + "x",
             r.get("best") or "–", _f(r.get("best_speedup"), ".2f") + "x"] for cat, r in per.items()]


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _title(report: dict) -> str:
    t = report.get("target") or {}
    draft = report.get("draft_description") or f"k={report.get('k')}"
    return (f"{report.get('drafter')} head on {t.get('name')} ({report.get('dtype')}, {report.get('device')}), "
            f"{draft}, batch {report.get('batch_size')}, max {report.get('max_new_tokens')} new tokens, "
            f"{report.get('num_prompts')} prompts, acceptance {report.get('acceptance', 'rejection (lossless)')}")


def provenance_line(report: dict) -> str:
    """Where the draft shape and the dtype came from (empty when evaluate() ran without the CLI)."""
    parts = [f"draft shape from {report['draft_source']}" if report.get("draft_source") else "",
             f"target {report['dtype_choice']}" if report.get("dtype_choice") else ""]
    return "; ".join(p for p in parts if p)


def acceptance_line(report: dict) -> str:
    """One line naming the verify rule; under typical acceptance it says the output is lossy."""
    rule = report.get("acceptance", "rejection (lossless)")
    if report.get("lossless", True):
        return (f"Acceptance: {rule}: every token follows the target's distribution; T = 0 output must equal "
                f"plain decoding (up to bf16 near-ties).")
    extra = " (the n-gram baseline uses rejection sampling, lossless)" if report.get("drafter") != "ngram" else ""
    return (f"Acceptance: {rule}: LOSSY, the output no longer follows the target's distribution at T > 0 "
            f"(at T = 0 the processed distribution is one-hot, so the rule is exact match); T = 0 mismatches "
            f"vs plain decoding are reported for information, not as a bug{extra}.")


def format_table(report: dict) -> str:
    """The table `draftkit eval` prints."""
    parts = [_title(report), provenance_line(report), acceptance_line(report),
             _text_table(SUMMARY_HEADER, summary_rows(report))]
    parts = [p for p in parts if p]
    methods = method_rows(report)
    if methods:
        parts += ["", "Side by side (* = the drafting measured above; speedup over plain decoding, same run):",
                  _text_table(METHOD_HEADER, methods)]
    cats = category_rows(report)
    if len({r[1] for r in cats}) > 1:
        parts += ["", _text_table(CATEGORY_HEADER, cats)]
    choices = choice_category_rows(report)
    if choices:
        parts += ["", f"Draft shape per category (calibration; the run above used {report.get('draft_description')}):",
                  _text_table(CHOICE_HEADER, choices)]
    for run in report.get("runs", []):
        if run.get("accepted_length_histogram"):
            parts.append(f"T={run['temperature']:g} accepted drafts per step (0..k): {run['accepted_length_histogram']}")
    if report.get("skipped"):
        parts.append(f"skipped {len(report['skipped'])} prompts (see report.json)")
    if report.get("status") != "complete":
        parts.append(f"PARTIAL: {report.get('error')}")
    return "\n".join(parts)


def format_markdown(report: dict) -> str:
    md = [f"# Speculative decoding evaluation\n\n{_title(report)}.\n",
          *([provenance_line(report) + ".", ""] if provenance_line(report) else []),
          f"Status: **{report.get('status')}**" + (f" — {report['error']}" if report.get("error") else ""), "",
          ("" if report.get("lossless", True) else "**") + acceptance_line(report)
          + ("" if report.get("lossless", True) else "**"), "",
          "tau = tokens per target forward per row (bonus included); alpha_i = acceptance of draft i given "
          "drafts 1..i-1 were accepted; speedup = speculative tokens/s over plain decoding of the same target "
          "on the same prompts, measured interleaved in this run.", "", "## Summary", "",
          _md_table(SUMMARY_HEADER, summary_rows(report)), ""]
    methods = method_rows(report)
    if methods:
        md += ["## Side by side", "", "Every method decoded the same prompts in this run, interleaved prompt by prompt; "
               "* marks the drafting of the summary. Accepted head/lookup/both: accepted draft tokens by the "
               "source that proposed them (both = a node head and lookup proposed alike).", "",
               _md_table(METHOD_HEADER, methods), ""]
    cats = category_rows(report)
    if cats:
        md += ["## Per category", "", _md_table(CATEGORY_HEADER, cats), ""]
    choices = choice_category_rows(report)
    if choices:
        md += ["## Draft shape per category (calibration)", "",
               f"The cost model's pick on each category's calibration prompts alone (plain decoding where no shape "
               f"is predicted to pay); the run above used the global choice, {report.get('draft_description')}.", "",
               _md_table(CHOICE_HEADER, choices), ""]
    md += ["## Accepted drafts per step", "", _md_table(
        ["T"] + [str(i) for i in range(report.get("k", 0) + 1)],
        [[_f(r["temperature"], "g")] + [str(n) for n in r.get("accepted_length_histogram") or []]
         for r in report.get("runs", [])]), ""]
    for run in report.get("runs", []):
        divs = run.get("greedy_divergences")
        if divs is None:
            continue
        fails = run.get("greedy_failures") or []
        md += ["## T = 0 equality with plain decoding", "",
               f"{run.get('greedy_mismatches')} of {run.get('done_prompts')} prompts differ: "
               f"{run.get('greedy_near_ties', 0)} near-ties (both tokens within {_f(run.get('greedy_tie_gap'), 'g')} "
               f"nats of the float32 top on the shared prefix; largest gap {_f(run.get('greedy_max_gap'), '.4f')}), "
               f"{len(fails)} outside"
               + (f"; acceptance is {report.get('acceptance')}, so differences are not a bug."
                  if not report.get("lossless", True) else ": a bug, acceptance is lossless." if fails else "."), ""]
        md += [f"- {line}" for line in fails[:50]] + ([""] if fails else [])
        if divs:
            md += [_md_table(["prompt", "token index", "got", "expected", "gap (nats)", "tolerance", "near-tie"],
                             [[str(d["prompt"]), str(d["index"]), str(d["got"]), str(d["expected"]),
                               _f(d.get("gap"), ".4f"), _f(d.get("tolerance"), ".4f"), str(d.get("near_tie", "–"))]
                              for d in divs[:50]]), ""]
    if report.get("skipped"):
        md += ["## Skipped prompts", ""] + [f"- {s['id']}: {s['reason']}" for s in report["skipped"]] + [""]
    md += ["![acceptance](acceptance.png)", ""]
    return "\n".join(md)


SOURCE_COLORS = {"head": "tab:blue", "lookup": "tab:orange", "both": "tab:green", "bonus": "lightgrey"}


def _plot_sources(ax, runs: list[dict]) -> None:
    """Stacked bars: where each method's tokens per step came from (head, lookup, both, the
    target's own bonus / correction token)."""
    labels, bottoms = [], []
    for run in runs:
        for name, m in (run.get("methods") or {}).items():
            labels.append(f"{name}\nT={run['temperature']:g}")
            src = m.get("accepted_by_source") or {}
            steps = max(sum(m.get("accepted_length_histogram") or []), 1)
            bottoms.append({key: src.get(key, 0) / steps for key in ("head", "lookup", "both")} | {"bonus": 1.0})
    x = range(len(labels))
    base = [0.0] * len(labels)
    for key, color in SOURCE_COLORS.items():
        vals = [b[key] for b in bottoms]
        ax.bar(x, vals, 0.6, bottom=base, color=color, label=key)
        base = [a + v for a, v in zip(base, vals)]
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="tokens per target forward (tau)", title="where accepted tokens came from")
    ax.legend(fontsize=8)


def write_plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: skipping %s (pip install matplotlib)", path.name)
        return None
    runs = [r for r in report.get("runs", []) if r.get("acceptance_per_position")]
    if not runs:
        return None
    k = report.get("k", len(runs[0]["acceptance_per_position"]))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / (len(runs) + any(r.get("ngram") for r in runs))
    for j, run in enumerate(runs):
        alphas = [a if a is not None else 0.0 for a in run["acceptance_per_position"]]
        ax1.bar([i + 1 + j * width for i in range(k)], alphas, width,
                label=f"{report.get('drafter')} T={run['temperature']:g} (tau {run.get('tau') or 0:.2f})")
        hist = run.get("accepted_length_histogram") or []
        total = max(sum(hist), 1)
        ax2.bar([i + j * width for i in range(len(hist))], [h / total for h in hist], width,
                label=f"T={run['temperature']:g}")
    ng = runs[0].get("ngram")
    if ng and ng.get("acceptance_per_position"):
        ng_alpha = ng["acceptance_per_position"][:k]
        ax1.bar([i + 1 + len(runs) * width for i in range(len(ng_alpha))],
                [a if a is not None else 0.0 for a in ng_alpha], width, color="grey",
                label=f"n-gram T={runs[0]['temperature']:g} (tau {ng.get('tau') or 0:.2f})")
    ax1.set(xlabel="draft position i", ylabel="alpha_i (given earlier accepted)", ylim=(0, 1),
            title="acceptance per draft position")
    ax1.set_xticks(range(1, k + 1))
    ax1.legend(fontsize=8)
    ax2.set(xlabel="drafts accepted in a step", ylabel="fraction of steps", title="accepted length")
    ax2.set_xticks(range(k + 1))
    ax2.legend(fontsize=8)
    _plot_sources(ax3, runs)
    speed = runs[0].get("speedup")
    fig.suptitle(_title(report) + (f" — speedup {speed:.2f}x" if speed else ""), fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path
