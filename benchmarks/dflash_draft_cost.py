"""Draft milliseconds per verify step of a DFlash block vs an EAGLE-3 chain, k = 1..7, in the real loop.

    python benchmarks/dflash_draft_cost.py --out benchmarks/results/dflash_draft_cost.json
    python benchmarks/dflash_draft_cost.py --dtype float32 --out benchmarks/results/dflash_draft_cost_avx2_fp32.json
    python benchmarks/dflash_draft_cost.py --prompt-file benchmarks/results/specbench_dev60.jsonl --limit 10
    python benchmarks/dflash_draft_cost.py --temperature 1 --ks 7 ...  # T > 0: each drafted position sampled
    python benchmarks/dflash_draft_cost.py --dflash-layers 2 5 ...       # the recipe's DFlash beside a 5-layer one

Both heads are built fresh (untrained) from the `head:` sections of recipes/dflash.yaml (its block
widened to max(--ks) + 1 where shorter, and printed) and recipes/eagle3.yaml on the embedded target
in --dtype (default bf16; float32 on a CPU without native bf16, e.g. AVX2-only, where bf16 matmuls
are emulated): drafting cost does not depend on the weights.
For each k, each head decodes the same prompts with SpecDecoder (chain of k, T = --temperature,
default 0; at T > 0 each drafted position is sampled from q, seed i for prompt i), interleaved
prompt by prompt (the heads' order rotated each prompt, so no head always runs first); reported:
draft_ms_per_step (head.draft, consuming the confirmed positions included) and verify_ms_per_step.
EAGLE-3 pays one head forward per drafted token, DFlash one per block.
Prompts: one short built-in prompt, decoded --prompts times; or --prompt-file (a prompt file as
`draftkit eval --prompts` reads it), --limit of them spread over the file, each decoded once: the
contexts of served traffic, whose length the heads' attention and first consume pay for.
--dflash-layers N ... builds one DFlash head per depth (the recipe's otherwise; rows named dflash-L{N}),
interleaved with the rest, each compared with EAGLE-3's chain of the same k.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import draftkit
from draftkit.config import load_recipe
from draftkit.heads import build_head
from draftkit.inference.decoder import SpecDecoder
from draftkit.inference.sampling import SamplingParams
from draftkit.inference.stats import SpecStats
from draftkit.target import cpu_flags, load_target

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("Summarize the following passage in three sentences. The history of the printing press begins "
          "with movable type in East Asia and continues with Gutenberg's press in Mainz around 1450, which "
          "made books cheaper, spread literacy and changed how science and religion were argued.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4, 7])
    ap.add_argument("--prompts", type=int, default=4, help="copies of the prompt, decoded one by one")
    ap.add_argument("--prompt-file", type=Path, default=None, help="prompts instead of the built-in one")
    ap.add_argument("--limit", type=int, default=10, help="with --prompt-file: how many, spread over the file")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="target and heads (float32 where the CPU has no native bf16)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dflash-layers", type=int, nargs="*", default=None,
                    help="DFlash draft depths to compare (default: recipes/dflash.yaml's head.num_layers)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    params = SamplingParams(temperature=a.temperature)
    target = load_target(None, dtype=a.dtype)
    heads = {}
    specs = {"eagle3": dict(load_recipe(ROOT / "recipes" / "eagle3.yaml").head)}
    dflash = dict(load_recipe(ROOT / "recipes" / "dflash.yaml").head)
    widest = max(a.ks) + 1  # a block drafts at most B - 1 tokens: widen it to the longest k
    if widest > dflash["block_size"]:
        print(f"dflash: block_size {dflash['block_size']} -> {widest} for k = {widest - 1}", flush=True)
        dflash["block_size"] = widest
    if a.dflash_layers is None:
        specs["dflash"] = dflash
    for n in a.dflash_layers or ():
        if n < 1:
            ap.error(f"--dflash-layers: {n} is not a depth (>= 1)")
        specs[f"dflash-L{n}"] = {**dflash, "num_layers": n}
    for name, spec in specs.items():
        head = build_head(spec, target)
        head.set_draft_vocab(tokens=torch.arange(target.vocab_size))  # any 8k tokens: cost only
        heads[name] = head.to(dtype).eval()
    if a.prompt_file is None:
        prompts = [target.tokenizer(PROMPT)["input_ids"]] * a.prompts
    else:
        from draftkit.inference.evaluate import encode, read_prompt_file

        every = read_prompt_file(a.prompt_file)
        step = max(1, len(every) // a.limit)
        prompts = [encode(target.tokenizer, p) for p in every[::step][:a.limit]]
    rows = []
    for k in a.ks:
        decs = {name: SpecDecoder(target, head, k=k, stop_ids=[]) for name, head in heads.items()}
        for dec in decs.values():
            dec.generate(prompts[:1], 4, params, [0])  # warm-up
        totals = {name: SpecStats(k) for name in decs}
        names = list(decs)
        for i, ids in enumerate(prompts):  # prompt by prompt, the heads' order rotated each prompt
            for name in names[i % len(names):] + names[:i % len(names)]:
                totals[name] += decs[name].generate([ids], a.max_new_tokens, params, [i])[1]
        for name, st in totals.items():
            rows.append({"head": name, "k": k, "draft_ms_per_step": 1e3 * st.draft_s / st.steps,
                         "verify_ms_per_step": 1e3 * st.verify_s / st.steps, "steps": st.steps})
            print(f"{name:7s} k={k}  draft {rows[-1]['draft_ms_per_step']:6.1f} ms/step  "
                  f"verify {rows[-1]['verify_ms_per_step']:6.1f} ms/step", flush=True)
    ms = {(r["head"], r["k"]): r["draft_ms_per_step"] for r in rows}
    ratios = {name: {str(k): ms[name, k] / ms["eagle3", k] for k in a.ks} for name in heads if name != "eagle3"}
    for name, ratio in ratios.items():  # DFlash over EAGLE-3's chain of k
        print(f"{name} / eagle3 draft ms per step: " + ", ".join(f"k={k} {v:.2f}x" for k, v in ratio.items()), flush=True)
    report = {"rows": rows, "dflash_over_eagle3_draft": ratios.get("dflash"), "over_eagle3_draft": ratios, "dtype": a.dtype, "temperature": a.temperature, "cpu_flags": cpu_flags(),
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "prompt_file": None if a.prompt_file is None else str(a.prompt_file), "num_prompts": len(prompts),
              "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
              "note": "untrained heads: cost only, acceptance not measured",
              "draftkit": str(Path(draftkit.__file__).parent)}  # which code ran (PYTHONPATH=<clone> to compare)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
