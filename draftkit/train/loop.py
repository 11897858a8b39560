"""The training loop: prepare data sized to the run, distill the head with DeepSpeed, export it."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from draftkit.config import Recipe
from draftkit.distill.prepare import Prepared
from draftkit.engines.vllm_train_eval import preflight_ranks
from draftkit.heads import DraftHead, build_head
from draftkit.heads.vocab import coverage, sample_counts
from draftkit.target import Target, load_target
from draftkit.train import checkpoint
from draftkit.train.data import feature_store, padding_ratio, sample_order
from draftkit.train.deepspeed_config import build_deepspeed_config, head_autocast, make_scheduler
from draftkit.train.distributed import Dist, any_true, barrier, init_distributed, mean_across, sum_across
from draftkit.train.loader import MicroBatches, MicroBatchStream, to_device

log = logging.getLogger("draftkit.train")
FAULT_KILL = "DRAFTKIT_FAULT_KILL_AFTER_STEP"  # SIGKILL this process after that step (tests only)
FAULT_RANK = "DRAFTKIT_FAULT_KILL_RANK"  # ... only on this rank (default: every rank)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf; the run stops and keeps the last good checkpoint."""


class TrainWrapper(torch.nn.Module):
    """What DeepSpeed drives: forward(features) = head.loss(features), under autocast when asked."""

    def __init__(self, head: DraftHead, autocast: torch.dtype | None = None):
        super().__init__()
        self.head = head
        self.autocast = autocast

    def forward(self, features):
        device = next(self.head.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            return self.head.loss(features)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def holdout_shard(num_chunks: int, world: int, rank: int) -> list[tuple[int, float]]:
    """(chunk index, weight) per forward of `rank`: chunks rank, rank + world, ... with weight 1,
    then weight-0 repeats of chunk 0 until every rank has ceil(num_chunks / world) forwards."""
    rounds = -(-num_chunks // world)
    mine = [(i, 1.0) for i in range(rank, num_chunks, world)]
    return mine + [(0, 0.0)] * (rounds - len(mine))


@torch.no_grad()
def heldout_sums(forward, samples: list[dict], micro: int, world: int = 1, rank: int = 0,
                 positions: tuple[int, ...] = ()) -> torch.Tensor:
    """(loss x tokens, top-1 agreement x tokens, tokens, then for each of `positions` i: acc_i x
    tokens_i, tokens_i) of `forward` (a micro-batch of samples -> the head's loss dict) over this
    rank's share of `samples`: micro-batches of similar lengths (less padding), every world-th one
    from `rank`. Every rank runs the same number of forwards (weight-0 repeats fill the short ones):
    under ZeRO-3 each forward gathers the partitioned weights collectively."""
    samples = sorted(samples, key=lambda s: len(s["input_ids"]))
    chunks = [samples[i: i + micro] for i in range(0, len(samples), micro)]
    sums = torch.zeros(3 + 2 * len(positions), dtype=torch.float64)
    for index, weight in holdout_shard(len(chunks), world, rank):
        out = forward(chunks[index])
        w = float(out["tokens"]) * weight
        row = [float(out["loss"]) * w, float(out["acc"]) * w, w]
        for i in positions:  # each position weighted by its own rows (fewer near the samples' ends)
            n = float(out[f"tokens_{i}"]) * weight
            row += [float(out[f"acc_{i}"]) * n, n]
        sums += torch.tensor(row, dtype=torch.float64)
    return sums


def draft_vocab_coverage(head: DraftHead, data: Prepared, vocab_size: int) -> dict:
    """How much of the data the head's draft vocabulary holds ({} for a head drafting over the whole
    vocabulary): {size, train_inside (of the training loss tokens it was chosen from), heldout_inside (of
    the held-aside responses' tokens: what the target says on prompts never trained on), heldout_tokens}."""
    if not hasattr(head, "t2d") or not getattr(head, "has_draft_vocab", True):
        return {}
    train = coverage(head.t2d, sample_counts(data.train, vocab_size))
    held = coverage(head.t2d, sample_counts(data.holdout_samples, vocab_size))
    return {"size": int(head.d2t.shape[0]), "train_inside": train["inside_fraction"],
            "heldout_inside": held["inside_fraction"], "heldout_tokens": held["tokens"]}


def prepare_data(recipe: Recipe, target: Target, dist: Dist, num_samples: int) -> Prepared:
    """Stage 1 (distill/prepare.py: responses -> shards, or the finished shards found), then read them."""
    from draftkit.distill.prepare import load_prepared, prepare

    return checked(load_prepared(prepare(recipe, target, dist, num_samples)))


def checked(data: Prepared) -> Prepared:
    if not data.train:
        raise ValueError(f"data: no training samples left after filtering ({data.stats})")
    return data


def unstored_features(recipe: Recipe, shell: Target, num_samples: int) -> tuple[str | None, Prepared | None]:
    """(why offline training would still need the target's transformer, or None when it would not;
    the prepared data when stage 1 is finished, read once here so the trainer need not read it again).
    Needed: stage 1 unfinished, or some training or held-aside sample without stored features.
    Reads configs, the manifest, the shards and file names only; `shell` may be a target loaded
    without its transformer."""
    from draftkit.distill.prepare import finished, load_prepared
    from draftkit.heads import head_class

    out = finished(recipe, shell, num_samples)
    if out is None:
        return "stage 1 (draftkit prepare) is not finished for this recipe", None
    data = load_prepared(out)
    family = head_class(recipe.head.get("type", ""))
    config = family.config_from_dict(dict(recipe.head))
    config.fill_from_target(shell)
    store = feature_store(recipe, shell, family.feature_layers_of(config))
    missing = len(store.missing(data.train + data.holdout_samples))
    return (f"features of {missing} samples are not stored in {store.dir}" if missing else None), data


class Trainer:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.out = Path(recipe.output_dir)
        self.dist = init_distributed()
        self.main = self.dist.is_main
        logging.basicConfig(level=logging.INFO if self.main else logging.WARNING,
                            format="%(asctime)s %(name)s: %(message)s")
        self.ds_config = build_deepspeed_config(recipe, self.dist.world_size, self.dist.device.type == "cuda")
        self.micro = self.ds_config["train_micro_batch_size_per_gpu"]
        self.accum = self.ds_config["gradient_accumulation_steps"]
        self.global_batch = self.micro * self.accum * self.dist.world_size
        self.target = self.target_for_training()
        seed_everything(recipe.train.seed)  # the head starts the same whichever way the target loaded
        self.head = build_head(recipe.head, self.target).to(self.dist.device)
        self.head.check_target_topk(recipe.train.target_topk)
        self.engine_eval = preflight_ranks(recipe, self.target, self.head, self.out, self.main, self.dist.device)
        self.autocast = head_autocast(recipe.train, self.dist.device)
        self.recipe_hash = recipe.fingerprint()
        self.pad_id = self.target.tokenizer.pad_token_id if self.target.tokenizer is not None else 0
        self.pad_id = 0 if self.pad_id is None else self.pad_id

    # ---- setup ----
    def target_for_training(self) -> Target:
        """The target without its transformer when training runs no target forward (offline
        features, train.eval_every 0, stage 1 finished and every sample's features stored: see
        unstored_features), else the full target. Every rank loads the same kind."""
        r, t = self.recipe, self.recipe.target
        def load(transformer: bool) -> Target:
            return load_target(t.path, gguf_file=t.gguf_file, dtype=t.dtype, trust_remote_code=t.trust_remote_code,
                               device=self.dist.device, transformer=transformer)
        self.stage1_before_decoder(load)
        why = ("train.features is online" if r.train.features != "offline" else
               "train.eval_every runs the draft-verify loop" if r.train.eval_every else None)
        self.found = None  # stage 1's data when the shell was chosen (read once, in unstored_features)
        if why is None:
            shell = load(transformer=False)
            why, found = unstored_features(r, shell, r.samples_needed(self.global_batch))
            if not any_true(why is not None, self.dist.device):
                self.found = found
                if self.main:
                    log.info("target %s: loaded without its transformer (embeddings, final norm, lm_head; "
                             "0 of %d decoder layers): every sample's features are stored", shell.name,
                             shell.num_layers)
                return shell
            why = why or "another rank lacks stored features"
        target = load(transformer=True)
        if self.main:
            log.info("target %s: full target loaded (%d decoder layers): %s", target.name, target.num_layers, why)
        return target

    def stage1_before_decoder(self, load) -> None:
        """Stage 1 with a shell target first when vLLM answers it (data.responses.engine vllm, or auto
        resolving to it): vLLM takes its own share of the GPU's memory, so the HF decoder is loaded
        only after vLLM has stopped. Nothing to do when stage 1 is finished (prepare finds it)."""
        from draftkit.distill.prepare import needs_decoder, prepare

        if needs_decoder(self.recipe):
            return
        with checkpoint.rng_unchanged():  # the same random numbers whether stage 1 ran here or was cached
            prepare(self.recipe, load(transformer=False), self.dist, self.recipe.samples_needed(self.global_batch))

    def prepare(self) -> None:
        r = self.recipe
        t0 = time.time()
        with checkpoint.rng_unchanged():  # the same random numbers whether stage 1 ran here or was cached
            self.data = (checked(self.found) if self.found is not None else
                         prepare_data(r, self.target, self.dist, r.samples_needed(self.global_batch)))
        if hasattr(self.head, "set_draft_vocab"):  # EAGLE-3 / EAGLE-1: the most frequent loss tokens
            self.head.set_draft_vocab(counts=sample_counts(self.data.train, self.target.vocab_size))
        self.vocab_coverage = draft_vocab_coverage(self.head, self.data, self.target.vocab_size)
        if self.vocab_coverage:
            self.data.stats["draft_vocab"] = self.vocab_coverage
        if self.main:
            log.info("data: %d training samples, %d held-aside (%.0f s): %s", len(self.data.train),
                     len(self.data.holdout_samples), time.time() - t0, json.dumps(self.data.stats, default=str))
        self.order = sample_order(r.train, self.data.train, self.micro, self.global_batch)
        self.features = feature_store(r, self.target, self.head.feature_layers)
        disk = self.features.check_disk(sum(len(s["input_ids"]) for s in self.data.train + self.data.holdout_samples))
        if self.main:
            log.info(disk)

    def build_engine(self) -> None:
        import deepspeed

        params = [p for p in self.head.parameters() if p.requires_grad]
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=TrainWrapper(self.head, self.autocast), model_parameters=params, config=self.ds_config,
            lr_scheduler=make_scheduler(self.recipe.train))
        if self.main:
            log.info("head: fp32 weights, %s matmuls (train.autocast: %s)",
                     str(self.autocast or torch.float32).replace("torch.", ""), self.recipe.train.autocast)

    def resume(self) -> int:
        r = self.recipe.train
        root = self.out / "checkpoints"
        if r.resume == "none":
            return 0
        if r.resume == "auto":
            tag = checkpoint.latest(root)
            if tag is None:
                return 0
        else:
            path = Path(r.resume)
            root, tag = path.parent, path.name
            if not path.is_dir():
                raise checkpoint.ResumeError(f"train.resume: no checkpoint directory at {path}")
        client = checkpoint.load(self.engine, root, tag, self.dist.rank, self.recipe_hash)
        if self.main:
            log.info("resumed from %s at step %d", root / tag, client["step"])
        return int(client["step"])

    # ---- the loop ----
    def micro_batch(self, step: int, micro: int):
        """This rank's features for (step, micro): read by a loader worker ahead of time, or here
        (synchronously, and whatever a worker could not read: online, or not on disk yet)."""
        item = self.batches().get(step, micro)
        if item["features"] is not None:
            return to_device(item["features"], self.target.device)
        return self.features.batch([self.data.train[i] for i in item["indices"]], self.pad_id)

    def batches(self) -> MicroBatchStream:
        """The micro-batch stream (train.loader_workers, train.prefetch), made on first use."""
        if getattr(self, "_stream", None) is None:
            r = self.recipe.train
            workers = r.loader_workers
            if workers and self.features.dir is None:
                log.warning("train.loader_workers: %d ignored: online features run the target in the main "
                            "process (set train.features: offline to read features in workers)", workers)
                workers = 0
            data = MicroBatches(self.order, self.data.train, self.features, self.pad_id, self.micro, self.accum,
                                self.dist.world_size, self.dist.rank, read=workers > 0)
            self._stream = MicroBatchStream(data, r.max_steps, workers, r.prefetch)
            if self.main:
                how = f"read by loader_workers {workers}, prefetch {r.prefetch}" if workers else "read in the main process"
                log.info("batches: %s, padded/real tokens %.3f over an epoch; %s", r.batching, self.epoch_padding(), how)
        return self._stream

    def epoch_padding(self) -> float:
        """Padded over real tokens of the micro-batches of the first epoch (all ranks)."""
        lengths = [len(s["input_ids"]) for s in self.data.train]
        epoch = [self.order.indices(k, 0, self.micro, 1, 1, 0) for k in range(max(len(lengths) // self.micro, 1))]
        return padding_ratio(epoch, lengths)

    def train_step(self, step: int) -> dict[str, float]:
        totals: dict[str, float] = {}
        self.head.steps_done = step  # a loss's schedule (DraftHead.steps_done) follows the loop's counter
        for micro in range(self.accum):
            out = self.engine(self.micro_batch(step, micro))
            loss = out["loss"]
            if any_true(not torch.isfinite(loss).item(), self.dist.device):
                raise NonFiniteLoss(f"step {step + 1}: loss is {loss.item()} (non-finite) on some rank; "
                                    "stopping; the last good checkpoint is kept")
            self.engine.backward(loss)
            self.engine.step()
            for k, v in out.items():
                totals[k] = totals.get(k, 0.0) + float(v.detach()) / self.accum
        return totals

    def heldout_agreement(self) -> dict[str, float]:
        """Top-1 agreement and loss on held-aside samples (never trained on), sharded across ranks:
        each rank takes its share (heldout_sums) and the sums are all-reduced, so the work is done once."""
        if not self.data.holdout_samples:
            return {}
        self.head.eval()
        positions = tuple(self.head.agreement_positions)
        sums = heldout_sums(lambda chunk: self.engine(self.features.batch(chunk, self.pad_id)),
                            self.data.holdout_samples, self.micro, self.dist.world_size, self.dist.rank, positions)
        self.head.train()
        loss, acc, n, *per = sum_across(sums.to(self.dist.device)).tolist()
        out = {"heldout_loss": loss / max(n, 1), "heldout_acc": acc / max(n, 1)}
        out.update({f"heldout_acc_{i}": per[2 * j] / max(per[2 * j + 1], 1) for j, i in enumerate(positions)})
        return out

    def speculative_eval(self) -> dict[str, float]:
        """τ and α_i of the real draft-verify loop on held-aside prompts (recipe: train.eval_every).

        Runs once, on rank 0; the other ranks wait. Under ZeRO-3 rank 0 evaluates a plain copy of
        the gathered head (the engine's own modules would gather collectively on every call).
        """
        from draftkit.inference.drafters import DraftSettings
        from draftkit.inference.evaluate import EvalSettings, evaluate

        r = self.recipe.train
        if not self.data.holdout_prompts:
            return {}
        head = self.eval_head()  # collective under ZeRO-3; None on the other ranks
        out: dict[str, float] = {}
        if self.main:
            head.eval()
            try:
                chain = EvalSettings(draft=DraftSettings(mode="chain", k=r.eval_k), compare=(),
                                     max_new_tokens=r.eval_max_new_tokens)  # the head's chain alone: cheap
                rep = evaluate(self.target, head, self.data.holdout_prompts, chain)
            finally:
                head.train()
            out = {"tau": rep["tau"]}
            out.update({f"alpha_{i + 1}": a for i, a in enumerate(rep["acceptance_per_position"])})
        barrier()
        return out

    def engine_eval_step(self, step: int) -> dict[str, float]:
        """vLLM's tau and acceptance of the head as it is now (train.engine_eval_every; rank 0 serves,
        engines/vllm_train_eval.py), on the held-aside prompts; the other ranks wait at the barrier."""
        head = self.eval_head()  # collective under ZeRO-3; None on the other ranks
        out = self.engine_eval.measure(head, self.data.holdout_prompts, step) if self.main else {}
        barrier()
        return out

    def eval_head(self) -> DraftHead | None:
        """The head rank 0 evaluates: itself, or under ZeRO-3 a copy of its gathered weights."""
        if self.ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
            return self.head if self.main else None
        copy = None
        with self.gathered():
            if self.main:
                state = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
                copy = type(self.head)(self.head.config, self.head.shared).to(self.dist.device)
                copy.load_state_dict(state)
        return copy

    def run(self) -> Path:
        r = self.recipe.train
        self.prepare()
        self.build_engine()
        start = self.resume()
        logger = RunLogger(self.recipe, self.main)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.json").write_text(json.dumps(self.recipe.to_dict(), indent=2, default=str))
            if self.data.directory is not None:  # which data: found again from any directory, whatever the cache
                (self.out / "prepared.json").write_text(json.dumps({"directory": str(self.data.directory)}))
        bar = tqdm(total=r.max_steps, initial=start, disable=not self.main, desc="train", dynamic_ncols=True)
        t_last, tok_last = time.time(), 0.0
        for step in range(start, r.max_steps):
            stats = self.train_step(step)
            tok_last += stats.get("tokens", 0.0) * self.accum * self.dist.world_size
            done = step + 1
            engine_now = bool(r.engine_eval_every) and done % r.engine_eval_every == 0
            if done % r.log_every == 0 or done == r.max_steps or engine_now:
                stats = mean_across(stats, self.dist.device)
                stats["lr"] = self.scheduler.get_last_lr()[0]
                stats["tokens_per_s"] = tok_last / max(time.time() - t_last, 1e-9)
                t_last, tok_last = time.time(), 0.0
                stats.update(self.heldout_agreement())
                if self.vocab_coverage.get("heldout_inside") is not None:  # the bound beside heldout_acc
                    stats["heldout_in_draft_vocab"] = self.vocab_coverage["heldout_inside"]
                if r.eval_every and done % r.eval_every == 0:
                    stats.update(self.speculative_eval())
                if engine_now:
                    stats.update(self.engine_eval_step(done))
                    t_last = time.time()  # the engine's minute is not the next interval's training time
                logger.log(done, stats)
                bar.set_postfix({k: f"{v:.3g}" for k, v in stats.items()
                                 if k in ("loss", "acc", "heldout_acc", "tokens_per_s", "tau", "engine_tau")})
            bar.update(1)
            if (r.save_every and done % r.save_every == 0) or done == r.max_steps:
                checkpoint.save(self.engine, self.out / "checkpoints", done,
                                {"step": done, "recipe_hash": self.recipe_hash}, self.dist.rank, r.keep_checkpoints)
            if os.environ.get(FAULT_KILL) == str(done) and os.environ.get(FAULT_RANK, str(self.dist.rank)) == str(
                    self.dist.rank):  # fault injection for the kill-and-resume tests
                os.kill(os.getpid(), signal.SIGKILL)
        bar.close()
        head_dir = self.export()
        logger.finish()
        return head_dir

    def gathered(self):
        """Full head weights on every rank for the duration (ZeRO-3 partitions them)."""
        if self.ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.head.parameters()), modifier_rank=None)

    def export(self) -> Path:
        """Write <output_dir>/head/ (config.json + model.safetensors), atomically, from rank 0."""
        head_dir = self.out / "head"
        with self.gathered():
            if self.main:
                self._save_head(head_dir)
        barrier()
        return head_dir

    def _save_head(self, head_dir: Path) -> None:
        extra = {"recipe_hash": self.recipe_hash, "train_steps": self.recipe.train.max_steps,
                 "training_dtype": str(self.target.dtype).replace("torch.", ""),
                 "head_autocast": str(self.autocast or torch.float32).replace("torch.", "")}
        if self.vocab_coverage:
            extra["draft_vocab_coverage"] = self.vocab_coverage
        self.head.save_pretrained(head_dir, extra=extra)
        log.info("exported head to %s", head_dir)


class RunLogger:
    """wandb on rank 0 (offline without a key; WANDB_MODE wins) plus a JSONL log in output_dir."""

    def __init__(self, recipe: Recipe, main: bool):
        self.main, self.run = main, None
        self.path = Path(recipe.output_dir) / "train_log.jsonl"
        cfg = recipe.logging
        if not main or cfg.wandb_project is None:
            return
        mode = os.environ.get("WANDB_MODE") or (cfg.wandb_mode if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "disabled":
            return
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, name=cfg.run_name, mode=mode,
                              dir=str(Path(recipe.output_dir)), config=recipe.to_dict())

    def log(self, step: int, stats: dict[str, float]) -> None:
        if not self.main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **stats}) + "\n")
        if self.run is not None:
            self.run.log(stats, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def train(recipe: Recipe) -> Path:
    return Trainer(recipe).run()
