"""Rejection sampler speed: vectorised torch vs the per-row loop (CPU), Triton vs torch (CUDA).

    python benchmarks/rejection_sampler.py [--quick] [--out benchmarks/results/rejection_sampler.json]

CPU section: `rejection_sample` (vectorised) against `rejection_sample_loop` (Python loop over
rows and positions) on the same inputs, timed interleaved in one run (torch, loop, torch, loop,
...) so drift in machine load hits both; the ratio is loop / torch of the medians.

CUDA section (skipped without CUDA): Triton kernels against the torch reference on the GPU, and
an effective bandwidth: nominal bytes = the fp32 draft probs q [B, k, V] plus target probs
p [B, k+1, V], divided by the Triton time, next to a measured device-to-device copy bandwidth.
The stochastic kernels only gather k values and stream one (V,) row of p and q per batch row,
so their effective GB/s may exceed the copy bandwidth: it says how far they are from a sampler
that must read the whole tensors. The greedy path does read all of p (blocked argmax).
Timings cover the sampling function only; logits -> probs is excluded (same for both paths).
"""

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from draftkit.inference.rejection import rejection_sample, rejection_sample_loop

K = 5


ACCEPT_RATE = 0.8  # per-position draft quality, roughly that of a good head


def make_inputs(B: int, V: int, greedy: bool, device: str, seed: int = 0) -> dict:
    """A step with realistic acceptance (~ACCEPT_RATE per position), so runs vary in length.

    greedy: each draft is the target's argmax with probability ACCEPT_RATE, else random.
    stochastic: q = ACCEPT_RATE * p + (1 - ACCEPT_RATE) * noise, so sum(min(p, q)) >= ACCEPT_RATE,
    and drafts are sampled from q.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    p = (3 * torch.randn(B, K + 1, V, generator=gen, device=device)).softmax(-1)  # (B, k+1, V)
    if greedy:
        keep = torch.rand(B, K, generator=gen, device=device) < ACCEPT_RATE
        random_tokens = torch.randint(0, V, (B, K), generator=gen, device=device)
        drafts, q = torch.where(keep, p[:, :K].argmax(-1), random_tokens), None
    else:
        other = torch.randn(B, K, V, generator=gen, device=device).softmax(-1)
        q = ACCEPT_RATE * p[:, :K] + (1 - ACCEPT_RATE) * other  # (B, k, V)
        drafts = torch.multinomial(q.reshape(B * K, V), 1, generator=gen).reshape(B, K)
    return dict(
        draft_tokens=drafts,
        draft_probs=q,
        target_probs=p,
        num_draft=torch.full((B,), K, device=device),
        accept_uniform=torch.rand(B, K, generator=gen, device=device),
        sample_noise=torch.empty(B, V, device=device).exponential_(generator=gen).reciprocal(),
        greedy=greedy,
    )


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def interleaved_medians(fns: list[Callable[[], object]], reps: int, sync: Callable[[], None]) -> list[float]:
    """Median seconds per fn, alternating the fns inside every repetition (one warm-up round)."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for times, fn in zip(samples, fns):
            times.append(timed(fn, sync))
    return [statistics.median(times) for times in samples]


def nominal_bytes(B: int, V: int) -> int:
    return 4 * (B * K * V + B * (K + 1) * V)  # fp32 q [B, k, V] + p [B, k+1, V]


def bench_cpu(batch_sizes: list[int], vocab_sizes: list[int], reps: int) -> list[dict]:
    rows = []
    for greedy in (True, False):
        for V in vocab_sizes:
            for B in batch_sizes:
                args = make_inputs(B, V, greedy, "cpu")
                methods = [lambda: rejection_sample(**args), lambda: rejection_sample_loop(**args)]
                torch_s, loop_s = interleaved_medians(methods, reps, sync=lambda: None)
                mean_accepted = rejection_sample(**args)[1].float().mean().item()
                rows.append(dict(
                    mode="greedy" if greedy else "stochastic", B=B, V=V, k=K, mean_accepted=mean_accepted,
                    torch_ms=1e3 * torch_s, loop_ms=1e3 * loop_s, loop_over_torch=loop_s / torch_s,
                ))
    return rows


def copy_bandwidth_gbps(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy: bytes read + bytes written per second."""
    src = torch.empty(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    (seconds,) = interleaved_medians([lambda: dst.copy_(src)], 10, torch.cuda.synchronize)
    return 2 * n_bytes / seconds / 1e9


def bench_cuda(batch_sizes: list[int], vocab_sizes: list[int], reps: int) -> dict:
    from draftkit.inference.triton_rejection import rejection_sample_triton

    peak = copy_bandwidth_gbps()
    rows = []
    for greedy in (True, False):
        for V in vocab_sizes:
            for B in batch_sizes:
                args = make_inputs(B, V, greedy, "cuda")
                triton_s, torch_s = interleaved_medians(
                    [lambda: rejection_sample_triton(**args), lambda: rejection_sample(**args)], reps,
                    torch.cuda.synchronize,
                )
                gbps = nominal_bytes(B, V) / triton_s / 1e9
                rows.append(dict(
                    mode="greedy" if greedy else "stochastic", B=B, V=V, k=K,
                    triton_us=1e6 * triton_s, torch_us=1e6 * torch_s, torch_over_triton=torch_s / triton_s,
                    effective_gbps=gbps, fraction_of_copy_bw=gbps / peak,
                ))
    return dict(device=torch.cuda.get_device_name(), copy_bandwidth_gbps=peak, rows=rows)


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    cells = [[fmt(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/rejection_sampler.json")
    parser.add_argument("--quick", action="store_true", help="small config: B in {1, 4}, V in {1k, 32k}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: multi-threaded reductions on a loaded, "
                             "shared machine spin and distort small ops by 10-50x)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per method (default 20; quick 5)")
    args = parser.parse_args()
    batch_sizes = [1, 4] if args.quick else [1, 4, 16]
    vocab_sizes = [1000, 32000] if args.quick else [1000, 32000, 49152]
    reps = args.reps or (5 if args.quick else 20)
    torch.set_num_threads(args.threads)

    print(f"== CPU: vectorised torch vs per-row loop (k={K}, median of {reps}, interleaved, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}) ==")
    cpu_rows = bench_cpu(batch_sizes, vocab_sizes, reps)
    print_table(cpu_rows, ["mode", "B", "V", "mean_accepted", "torch_ms", "loop_ms", "loop_over_torch"])

    print(f"\n== CUDA: Triton vs torch (k={K}) ==")
    if torch.cuda.is_available():
        cuda = bench_cuda(batch_sizes, vocab_sizes, reps)
        print(f"{cuda['device']}: device-to-device copy {cuda['copy_bandwidth_gbps']:.0f} GB/s")
        print_table(cuda["rows"], ["mode", "B", "V", "triton_us", "torch_us", "torch_over_triton",
                                   "effective_gbps", "fraction_of_copy_bw"])
    else:
        cuda = {"skipped": "no CUDA"}
        print("skipped: no CUDA")

    result = dict(k=K, reps=reps, torch=torch.__version__, machine=platform.machine(),
                  cpu_threads=torch.get_num_threads(),
                  load_average=os.getloadavg()[0], cpu=cpu_rows, cuda=cuda)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
