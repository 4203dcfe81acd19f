"""The training loop of the `train` stage: model + LoRA + optimizer + schedule, steps.

All step randomness (variant choice, posterior eps, noise, timesteps) comes from one CPU generator
seeded by `seed`, saved in every checkpoint with the sampler position, the optimizer, the LR
scheduler and torch's global RNG (LoRA dropout), so a resumed run continues bit for bit. Saving,
loading and retention of checkpoints are `stages/train/checkpoints.py`'s; the optimizer, its LR
schedule and schedule-free evaluation weights `stages/train/optimizers.py`'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from stages.core import blockswap, distributed, fastpath, faults, flow, lora, memory, validation
from stages.core.caches import load_captions, load_latents, lora_dir, scan_items
from stages.core.artifacts import ArtifactError, atomic_dir, fingerprint, sweep_leftovers, write_manifest
from stages.core.config import command
from stages.core.errors import TrainingDiverged
from stages.core.events import loss_ends, read_events, step_losses
from stages.core.model_source import model_source
from stages.core.profiling import StepProfiler
from stages.core.runtime import alloc_retries, attention_notice, make_runtime, pick_device, resolve_precision, peak_vram_gb, require_cuda_for_nf4, reset_peak, torch_flags
from stages.core.train_data import BucketSampler, TrainData, join_items, sample_posterior
from stages.families import get_family
from stages.train import optimizers
from stages.train.checkpoints import Checkpoints
from stages.train.stage import fingerprint_parts


def compile_wanted(mode: str, is_cuda: bool) -> bool:
    """runtime.compile_transformer: `auto` compiles on CUDA, over bf16, fp8 and nf4 bases alike (on the
    H200 the compiled nf4 step was 1.08-1.57x faster than uncompiled nf4 on all four families, same loss;
    docs/performance.md), and leaves CPU runs eager (inductor's CPU build costs more than it gives there)."""
    return mode == "on" or (mode == "auto" and is_cuda)


DISTILLED = ("turbo", "schnell")  # words in a model id that name a step-distilled checkpoint


def distilled_note(model: str) -> str | None:
    """An info line when the model id looks step-distilled and no train.assistant_adapter is set."""
    name = model.lower()
    if not any(word in name for word in DISTILLED):
        return None
    return (f"'{model}' looks step-distilled: a LoRA trained on it directly can break the distillation; train on "
            f"the base checkpoint, or set train.assistant_adapter to a de-distill LoRA (docs/configuration.md#regularization)")


def build_data(cfg: Any) -> tuple[TrainData, dict[str, Any]]:
    cap_store, cap_manifest = load_captions(cfg)
    lat_stores, lat_manifest = load_latents(cfg)
    if cap_manifest["family"] != cfg.family or lat_manifest["family"] != cfg.family:
        raise ArtifactError(f"caches of run '{cfg.run}' were made for family "
                            f"{cap_manifest['family']!r}/{lat_manifest['family']!r}, not {cfg.family!r}: rerun "
                            f"`{command(cfg, 'encode-captions', '--force')}` and `{command(cfg, 'cache-latents', '--force')}`")
    train_items, held_out = validation.partition(cfg, scan_items(cfg, get_family(cfg.family)))
    pairs = join_items(train_items, cap_manifest, lat_manifest, cfg.run_dir, cfg.dataset_configs(),
                       blank=cfg.train.preservation == "blank_prompt")
    data = TrainData(pairs, cap_store, lat_stores, lat_manifest["variants"])
    data.held_out = TrainData(join_items(held_out, cap_manifest, lat_manifest, cfg.run_dir), cap_store, lat_stores,
                              lat_manifest["variants"]) if held_out else None
    return data, lat_manifest


def compile_model(model: torch.nn.Module, mode: str, is_cuda: bool, log: Any) -> bool:
    """Regional compile (each repeated block) when `compile_wanted`; any failure runs eager."""
    if not compile_wanted(mode, is_cuda):
        return False
    try:
        model.compile_repeated_blocks(fullgraph=False)
        return True
    except Exception as e:  # noqa: BLE001 - any compile failure falls back to eager
        log.emit("warning", message=f"regional compile failed, running eager: {e}")
        return False


def uncompile(model: torch.nn.Module, error: Exception, log: Any) -> bool:
    """Back to eager after a compiled step failed; returns False (now not compiled)."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    log.emit("warning", message=f"compiled step failed, falling back to eager: {str(error)[:300]}")
    return False


def sync(rt: Any) -> None:
    if rt.is_cuda:
        torch.cuda.synchronize()


@dataclass
class RunStats:
    """Losses and samples of this process's steps; samples/s counts only the steps after the first
    `warmup` (compile, allocator growth and CUDA-graph capture happen there)."""

    warmup: int
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    steady_samples: int = 0
    steady_t0: float | None = None

    def add(self, steps_run: int, n: int, loss: float, rt: Any) -> None:
        self.losses.append(loss)
        self.samples += n
        if steps_run == self.warmup:
            sync(rt)
            self.steady_t0, self.steady_samples = time.time(), 0
        elif self.steady_t0 is not None:
            self.steady_samples += n

    def samples_per_second(self) -> float | None:
        if not (self.steady_t0 and self.steady_samples):
            return None
        return self.steady_samples / (time.time() - self.steady_t0)



class Trainer:
    def __init__(self, cfg: Any, log: Any, dist: distributed.Dist | None = None):
        self.cfg, self.tcfg, self.log = cfg, cfg.train, log
        self.dist = dist or distributed.Dist()
        self.family = get_family(cfg.family)
        self.src = model_source(cfg)
        self.data, lat_manifest = build_data(cfg)
        self.norm = lat_manifest["normalization"]
        # Under torchrun every rank walks the same order of global batches (batch_size per rank x
        # ranks) and trains on its slice of each: the same items per step as one process would see.
        self.global_batch = self.tcfg.batch_size * self.dist.world_size
        self.sampler = BucketSampler(self.data.buckets(), self.global_batch, cfg.seed, self.data.shares())
        if note := self.sampler.fill_warning(cfg.data.bucket_merge):
            log.emit("warning", message=note)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.parts = fingerprint_parts(cfg)
        self.lora_dir = lora_dir(cfg)
        self.expert = {"expert": cfg.train.expert} if cfg.train.expert else {}  # on the events of one expert's training
        self.checkpoints = Checkpoints(self.lora_dir, fingerprint(self.parts), self.cfg.runtime.keep_checkpoints, log)
        # set by setup_model
        self.model: Any = None
        self.rt: Any = None
        self.lora_config: Any = None
        self.params: list[torch.nn.Parameter] = []
        self.ema: lora.AdapterEMA | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.denoiser: Any = None
        self.precision, self.graphs_plan, self.attention, self.compiled = "", "", "default SDPA", False
        # the next batch, read ahead while the GPU runs a step, and the generator/sampler state before it
        self.pending: tuple[list[int], tuple[Any, ...]] | None = None
        self.state_before_pending: dict[str, Any] = {}
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk
        self.drawn_steps = 0  # batches drawn: the 0-based step that `draw_next` draws for
        self.batch_sizes: Counter[int] = Counter()  # steps run at each batch size, over resumes too
        self.plan: Any = None  # the memory planner's choice for this stage (stages/core/memory/)
        self.swap: Any = None  # block swap, when the plan swaps blocks
        self.checkpointing, self.checkpointed, self.blocks = False, 0, 0  # on?; repeated blocks checkpointed / all

    # ---- setup
    def setup_model(self) -> None:
        self.cfg, self.plan = memory.plan_stage(self.cfg, self.family, "train", self.log)
        self.tcfg = self.cfg.train
        precision = self.precision = resolve_precision(self.tcfg.base_precision, pick_device(self.cfg.device), "denoiser")
        self.rt = make_runtime(self.cfg.device, "bf16" if precision == "nf4" else precision)
        require_cuda_for_nf4("train.base_precision", precision, self.rt)
        reset_peak(self.rt)
        self.src.check(self.family.denoiser_components, self.family)
        self.log.emit("loading", component=self.family.denoiser_class, precision=precision)
        t = time.time()
        self.model = self.family.load_denoiser(self.src, precision, memory.load_device(self.plan, self.rt), self.tcfg)
        self.log.emit("loaded", component=self.family.denoiser_class, seconds=round(time.time() - t, 3))
        if self.tcfg.assistant_adapter:  # merged into the frozen base before the trained adapter is attached
            merged = lora.merge_assistant(self.model, self.tcfg.assistant_adapter, self.family.lora_prefix, precision)
            self.log.emit("info", message=f"train.assistant_adapter merged into the base for training only "
                                          f"({merged} modules); export-lora and sample run without it")
        elif note := distilled_note(self.cfg.model):
            self.log.emit("info", message=note)
        self.lora_config = lora.train_lora_config(self.tcfg, self.family.default_lora_targets)
        self.params = lora.attach_lora(self.model, self.lora_config)
        self.ema = lora.AdapterEMA(self.params, self.tcfg.ema_decay, self.cfg.runtime.ema_device) if self.tcfg.ema_decay else None
        self.enable_checkpointing()
        self.swap = memory.apply_train_plan(self.model, self.plan, self.rt)  # block swap
        self.model.train()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]  # self.params, named
        self.optimizer = optimizers.make_optimizer(named, self.tcfg, self.rt.device)
        self.scheduler = optimizers.make_scheduler(self.optimizer, self.tcfg)
        for note in optimizers.notes(self.tcfg):
            self.log.emit("info", message=note)
        if self.cfg.runtime.caption_tokens_multiple > 1 and not self.family.captions_cut_to_longest:
            self.log.emit("info", message=f"runtime.caption_tokens_multiple = {self.cfg.runtime.caption_tokens_multiple} "
                                          f"changes nothing for {self.family.name}: its batches are not cut to their "
                                          f"longest caption")
        self.compiled = compile_model(self.model, self.cfg.runtime.compile_transformer, self.rt.is_cuda, self.log)
        distributed.broadcast_params(self.params, self.dist)
        if self.dist.is_distributed:
            torch.manual_seed(self.cfg.seed + self.dist.rank)  # LoRA dropout: other masks on each rank
        # what the loss calls: the model, or per-shape CUDA graphs of it (same kernels, no host overhead)
        swapped = len(self.swap.blocks) if self.swap is not None else 0
        self.denoiser, self.graphs_plan = fastpath.wrap_denoiser(self.model, self.params, self.rt, self.cfg, self.log,
                                                                 swapped=swapped, budget_gb=self.plan.budget.gb)

    def enable_checkpointing(self) -> None:
        """Gradient checkpointing of the plan's number k of repeated blocks: the FIRST k in forward order
        (`repeated_blocks`: registration order, which the DiT families run in; SDXL's UNet registers its
        mid block after the up blocks). Backward runs the blocks last to first, so it frees the kept
        activations of the un-checkpointed (last) blocks before the first recompute rebuilds a block's
        activations: the two never add up. Checkpointing the last k instead would recompute while every
        kept activation is still held, the full sum the planner budgets (stages/core/memory/). Swap
        plans checkpoint every block (which ones they swap: blockswap.swapped_positions). Modules the model checkpoints
        outside its repeated blocks (SDXL's resnets) stay checkpointed whenever checkpointing is on."""
        blocks = blockswap.repeated_blocks(self.model)
        self.checkpointed = memory.checkpointed_blocks(self.plan, len(blocks))
        self.blocks = len(blocks)
        self.checkpointing = bool(self.checkpointed or (self.plan.settings.get("gradient_checkpointing") and not blocks))
        if self.checkpointing:
            self.model.enable_gradient_checkpointing(
                fastpath.checkpoint_function(self.tcfg.dropout, direct=blocks[self.checkpointed:],
                                             keep_attention=self.cfg.runtime.keep_attention))

    # ---- one step
    def draw(self, batch_indices: list[int], first: int | None = None) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read a batch and draw all its randomness from the step generator (CPU, reproducible); `first`
        is the run's index of the batch's first timestep draw (train.timestep_buckets' stratum position).

        Under torchrun every rank draws the randomness of the whole global batch, as one process
        would, and keeps its own slice; it reads only its slice's items. A rank whose slice is empty
        (a bucket's short last batch) takes the first item, which `step` weights by 0."""
        g, n = self.generator, len(batch_indices)
        part = distributed.batch_slice(n, self.dist)
        if part.start == part.stop:
            part = slice(0, 1)
        variants = self.data.draw_variants(batch_indices, g)[part]
        captions = self.data.draw_captions(batch_indices, g)  # draws nothing without dropout or caption variants
        batch = self.data.load(batch_indices[part], variants, captions and captions[part])
        shape = (n, *batch.mean.shape[1:])
        eps = torch.randn(shape, generator=g)[part]
        noise = torch.randn(shape, generator=g)[part]
        t = self.family.sample_timesteps(n, tuple(batch.mean.shape[2:]), g, self.tcfg, first)[part]
        if batch.controls:  # drawn after the rest: text-to-image families draw exactly what they did
            batch.control_eps = tuple(torch.randn((n, *m.shape[1:]), generator=g)[part] for m, _ in batch.controls)
        if self.tcfg.preservation == "blank_prompt":  # read, not drawn: the random stream is unchanged
            batch.blank_cond = self.data.blank_cond(batch_indices[part])
        return batch, eps, noise, t

    def compute_loss(self, batch: Any, eps: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss; with train.preservation = "dataset" its regularization items train toward the
        base model's prediction on their own caption, weighted by train.preservation_weight."""
        if batch.regularization is None:
            return self._per_sample_loss(self.denoiser, batch, eps, noise, t).mean()
        rows = batch.regularization.to(self.rt.device)
        with flow.prediction_target(self.base_prediction(batch, eps, noise, t), rows):
            loss = self._per_sample_loss(self.denoiser, batch, eps, noise, t)
        return (loss * torch.where(rows, self.tcfg.preservation_weight, 1.0)).mean()

    def preservation_loss(self, batch: Any, eps: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """train.preservation = "blank_prompt": train.preservation_weight x the mean loss of the adapter's
        prediction on the empty caption (the batch's noisy latents) against the base model's prediction on it."""
        blank = dataclasses.replace(batch, cond=batch.blank_cond)
        with flow.prediction_target(self.base_prediction(blank, eps, noise, t)):
            loss = self._per_sample_loss(self.denoiser, blank, eps, noise, t)
        return loss.mean() * self.tcfg.preservation_weight

    def base_prediction(self, batch: Any, eps: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The frozen base's prediction for the batch (adapter disabled, no grad), in the space of the family's
        target, as its loss computes it. Under a fork of torch's RNG: a family drawing in its loss (SDXL's
        noise offset) draws the same numbers again in the adapter's forward that follows."""
        devices = [self.rt.device] if self.rt.is_cuda else []
        with torch.no_grad(), lora.adapter_disabled(self.model), flow.captured_prediction() as seen, \
                torch.random.fork_rng(devices=devices):
            self._per_sample_loss(self.model, batch, eps, noise, t)
        if len(seen) != 1:
            raise RuntimeError(f"{self.family.name}'s loss computed {len(seen)} predictions; preservation needs one")
        return seen[0]

    def _per_sample_loss(self, denoiser: Any, batch: Any, eps: torch.Tensor, noise: torch.Tensor,
                         t: torch.Tensor) -> torch.Tensor:
        dev = self.rt.device
        x0 = self.family.normalize_latents(sample_posterior(batch.mean.to(dev), batch.logvar.to(dev), eps.to(dev)), self.norm)
        cond = {k: v.to(dev) for k, v in batch.cond.items()}
        meta = dataclasses.replace(batch.meta, text_multiple=self.cfg.runtime.caption_tokens_multiple)
        if batch.mask is not None:
            meta = dataclasses.replace(meta, loss_mask=batch.mask.to(dev))
        if batch.controls:
            meta = dataclasses.replace(meta, controls=self.control_latents(batch))
        return self.family.loss(denoiser, x0, noise.to(dev), t.to(dev), cond, meta, self.tcfg)

    def control_latents(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """Each control's normalized latents: a fresh posterior sample with the step's draws, or the
        posterior mean (the pipeline's `argmax` encoding) for a batch loaded outside `draw`."""
        dev, out = self.rt.device, []
        for k, (mean, logvar) in enumerate(batch.controls):
            z = mean.to(dev) if batch.control_eps is None else \
                sample_posterior(mean.to(dev), logvar.to(dev), batch.control_eps[k].to(dev))
            out.append(self.family.normalize_latents(z, self.norm))
        return tuple(out)

    def draw_next(self) -> tuple[list[int], tuple[Any, ...]]:
        """The next batch and its randomness; remembers the sampler/generator state from before it,
        which is what a checkpoint saves while this batch is pending (resume draws it again)."""
        self.state_before_pending = {"generator": self.generator.get_state(), "sampler": self.sampler.state_dict()}
        _, indices = self.sampler.next()
        # the stratum position of train.timestep_buckets: from the step number, so a resume continues it
        first, self.drawn_steps = self.drawn_steps * self.global_batch, self.drawn_steps + 1
        draws = self.draw(indices, first)
        upcoming = self.sampler.peek()
        if upcoming is not None:  # its rows are read while this batch trains
            part = distributed.batch_slice(len(upcoming[1]), self.dist)
            self.data.prefetch(upcoming[1][part] or upcoming[1][:1])
        return indices, draws

    def step(self) -> tuple[float, float, int]:
        indices, draws = self.pending or self.draw_next()
        self.pending = None
        lr = optimizers.applied_lr(self.optimizer, self.scheduler, self.tcfg)
        loss = self._backward(draws, distributed.loss_weight(len(indices), self.dist))
        distributed.average_gradients(self.params, self.dist)
        if self.tcfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.max_grad_norm)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Read the next batch while the GPU still runs this one (float(loss) below waits for it).
        # Its random draws come in the same order as without read-ahead, so the run is unchanged.
        self.pending = self.draw_next()
        self.batch_sizes[len(indices)] += 1
        return float(distributed.mean_over_ranks(loss.detach(), self.dist)), lr, len(indices)

    def _backward(self, draws: tuple[Any, ...], weight: float) -> torch.Tensor:
        """The weighted loss, backpropagated; a compiled model that fails here is run eager instead."""
        try:
            return self._backward_once(draws, weight)
        except Exception as e:  # noqa: BLE001
            if not self.compiled or isinstance(e, torch.OutOfMemoryError):  # eager needs no less memory
                raise
            self.compiled = uncompile(self.model, e, self.log)
            self.optimizer.zero_grad(set_to_none=True)
            return self._backward_once(draws, weight)

    def _backward_once(self, draws: tuple[Any, ...], weight: float) -> torch.Tensor:
        loss = self._weighted_loss(draws, weight)
        loss.backward()
        if self.tcfg.preservation == "blank_prompt":
            # its own backward after the batch's freed that one's activations: the peak stays one graded forward's
            extra = self.preservation_loss(*draws)
            extra = extra if weight == 1.0 else extra * weight
            extra.backward()
            loss = loss.detach() + extra.detach()
        return loss

    @torch.no_grad()
    def validation_loss(self) -> tuple[float, int]:
        """Mean loss over the held-out items, each with variant 0 and noise, eps and timestep drawn from
        its own generator (`validation.item_seed`): comparable across steps and runs, and drawing
        nothing from the step generator or torch's RNG (eval mode: no LoRA dropout; a forked RNG for
        what a family's loss draws), so training continues exactly as without it. Batches of
        train.batch_size from one bucket, as training."""
        held, losses = self.data.held_out, []
        self.model.eval()
        try:
            with optimizers.eval_weights(self.optimizer, self.params, self.tcfg):  # schedule-free: at x
                for members in held.buckets().values():
                    for i in range(0, len(members), self.tcfg.batch_size):
                        idx = members[i:i + self.tcfg.batch_size]
                        batch = held.load(idx, [0] * len(idx))
                        pairs = [held.pairs[j] for j in idx]
                        eps, noise, t = self._fixed_draws(pairs, batch.mean.shape[1:])
                        # a family drawing from torch's RNG inside its loss (SDXL's noise offset) draws
                        # from a seeded fork of it: fixed per batch, and training's RNG is restored after
                        with torch.random.fork_rng(devices=[self.rt.device] if self.rt.is_cuda else []):
                            torch.manual_seed(validation.item_seed(pairs[0].image_id, pairs[0].caption_id))
                            losses += self._per_sample_loss(self.model, batch, eps, noise, t).tolist()
        finally:
            self.model.train()
        return sum(losses) / len(losses), len(losses)

    def _fixed_draws(self, pairs: list[Any], shape: torch.Size) -> tuple[torch.Tensor, ...]:
        draws = []
        for p in pairs:
            g = torch.Generator().manual_seed(validation.item_seed(p.image_id, p.caption_id))
            draws.append((torch.randn((1, *shape), generator=g), torch.randn((1, *shape), generator=g),
                          self.family.sample_timesteps(1, tuple(shape[1:]), g, self.tcfg)))
        return tuple(torch.cat(d) for d in zip(*draws))

    def _weighted_loss(self, draws: tuple[Any, ...], weight: float) -> torch.Tensor:
        loss = self.compute_loss(*draws)
        return loss if weight == 1.0 else loss * weight

    # ---- checkpoints (stages/train/checkpoints.py writes and reads them)
    def training_state(self, step: int) -> dict[str, Any]:
        state = {"step": step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                 "sampler": self.sampler.state_dict(), "batch_sizes": {str(k): v for k, v in self.batch_sizes.items()}}
        if self.ema is not None:
            state["ema"] = self.ema.state()
        if optimizers.is_schedule_free(self.tcfg):  # the training point y; the adapter written beside it is x
            state["train_weights"] = [p.detach().clone() for p in self.params]
        if self.pending is not None:  # the next batch was read ahead: save the state before it
            state.update(self.state_before_pending)
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self.dist.is_distributed:  # collective: every rank's dropout RNG, so each resumes its own
            state["world_size"] = self.dist.world_size
            state["torch_rng_ranks"] = distributed.all_gather(torch.get_rng_state(), self.dist)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        optimizers.load_state(self.optimizer, state["optimizer"])
        if "train_weights" in state:  # schedule-free: continue from y, not from the adapter's x
            with torch.no_grad():
                for p, y in zip(self.params, state["train_weights"]):
                    p.copy_(y)
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        ranks = state.get("torch_rng_ranks")
        torch.set_rng_state(ranks[self.dist.rank] if ranks and len(ranks) == self.dist.world_size else state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.sampler.load_state_dict(state["sampler"])
        if self.ema is not None:
            self.ema.load(state["ema"])  # the fingerprint covers ema_decay: a checkpoint of this config has it
        self.batch_sizes = Counter({int(k): v for k, v in state.get("batch_sizes", {}).items()})
        self.pending, self.saved_step = None, int(state["step"])
        self.drawn_steps = self.saved_step

    def save_checkpoint(self, step: int) -> None:
        state = self.training_state(step)  # on every rank (it gathers their RNG states)
        if self.dist.is_main:  # replicas are identical: rank 0 alone writes
            self.checkpoints.save(step, state, self._write_adapter, {"fingerprint_parts": self.parts, **self.info()})
        self.saved_step = step

    def _write_adapter(self, folder: Any) -> None:
        with optimizers.eval_weights(self.optimizer, self.params, self.tcfg):  # schedule-free: x, not y
            lora.save_adapter(self.model, self.lora_config, folder)
        if self.ema is not None:
            lora.save_ema(self.model, self.ema, folder)

    def resume(self) -> int:
        """Load the newest complete checkpoint made with this config; return its step (0 if none)."""
        loaded = self.checkpoints.load_newest(self._check_world_size, lambda p: lora.load_adapter_weights(self.model, p))
        if loaded is None:
            return 0
        path, state = loaded
        self.restore(state)
        self.log.emit("info", message=f"resumed from {path.name} at step {state['step']}")
        return int(state["step"])

    def _check_world_size(self, path: Any, manifest: dict[str, Any]) -> None:
        """The sampler position counts global batches: resuming with another number of processes
        would walk a different batch order from a position that means something else."""
        saved = manifest.get("world_size", 1)
        if saved != self.dist.world_size:
            raise ArtifactError(
                f"{path} was written by {saved} process(es) (global batch {saved * self.tcfg.batch_size}), this "
                f"train runs {self.dist.world_size}: resume with --nproc-per-node/--gpus {saved}, or start over "
                f"with `{command(self.cfg, 'train', '--restart')}`")

    def info(self) -> dict[str, Any]:
        """What export-lora needs (family, pipeline, LoRA config) and how the run was launched."""
        assistant = {"assistant_adapter": self.parts["assistant"]} if self.parts.get("assistant") else {}
        return {"family": self.cfg.family, "model": self.cfg.model, "pipeline_class": self.family.pipeline_class,
                "lora_prefix": self.family.lora_prefix, "component": self.family.trained_component(self.tcfg),
                "lora_config": lora.config_dict(self.lora_config),
                "world_size": self.dist.world_size, "global_batch_size": self.global_batch, **assistant}

    def save_final(self, step: int, complete: bool, summary: dict[str, Any]) -> dict[str, Any]:
        if not self.dist.is_main:
            return {"stage": "train", "rank": self.dist.rank, "step": step, "complete": complete}
        extra = {} if complete else {"incomplete_reason": f"stopped at step {step} of {self.tcfg.steps}: run "
                                                          f"`{command(self.cfg, 'train', '--resume')}` to finish"}
        with atomic_dir(self.lora_dir / "final") as tmp:
            self._write_adapter(tmp)
            faults.hit("mid-save")
            return write_manifest(tmp, "train", kind="final", step=step, complete=complete,
                                  fingerprint=fingerprint(self.parts), fingerprint_parts=self.parts,
                                  **self.info(), **summary, **extra)

    def release(self) -> None:
        """Drop the model, its adapter, optimizer, CUDA graphs and compiled code, and CUDA's cached blocks, so
        the next expert of a train.expert = "both" run loads into a GPU this one no longer holds."""
        if self.compiled:
            torch._dynamo.reset()  # its guards and graphs keep references to this model's modules
        self.model = self.denoiser = self.optimizer = self.scheduler = self.ema = self.swap = self.pending = None
        self.params = []
        if self.rt is not None and self.rt.is_cuda:
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    # ---- the loop
    def fit(self, resume: bool, stop: Any, t0: float) -> dict[str, Any]:
        torch.manual_seed(self.cfg.seed)
        sweep_leftovers(self.lora_dir)  # temp folders of a killed save: never read, space only
        with torch_flags(self.cfg.runtime.enable_tf32, self.cfg.runtime.cudnn_benchmark,
                         disable_cudnn_attention=not self.cfg.runtime.cudnn_attention) as notes:
            self.setup_model()
            self.attention = notes[0] if notes and self.rt.is_cuda else "default SDPA"
            capability = torch.cuda.get_device_capability(self.rt.device) if self.rt.is_cuda else None
            notice = attention_notice(self.cfg.runtime.cudnn_attention, capability)
            if notice is not None:
                self.log.emit("info", message=notice)
            start = self.resume() if resume else 0
            steps = distributed.all_gather(start, self.dist)
            if len(set(steps)) > 1:
                raise ArtifactError(f"ranks resumed from different steps {steps}: do all hosts see the same "
                                    f"{self.lora_dir}? (multi-host runs need a shared artifacts folder)")
            if start == 0 and self.dist.is_main:
                self.checkpoints.set_aside()  # a fresh start never mixes with (or overwrites) older checkpoints
            return self._loop(start, stop, t0)

    def _loop(self, start: int, stop: Any, t0: float) -> dict[str, Any]:
        tcfg, stats, step = self.tcfg, RunStats(self.cfg.runtime.warmup_steps_excluded), start
        profiler = StepProfiler(start + self.cfg.runtime.warmup_steps_excluded, self.cfg.runtime.profile_steps, self.lora_dir / "profile.json",
                                self.rt.is_cuda, enabled=self.dist.is_main)
        with distributed.progress(self.dist, "train", tcfg.steps - start, "steps") as bar:
            while step < tcfg.steps:
                if self._stop_requested(stop):
                    profiler.close()  # stopped inside the profiled steps: no partial table
                    return self._stopped(step, stop.save and step > start, stats, t0)  # no step: nothing new
                profiler.before(step)
                loss, lr, n = self.step()
                step += 1
                if (table := profiler.after(step)) is not None:
                    self.log.emit("profile", path=str(profiler.path), ms_per_step=table["ms_per_step"], device=table["device"],
                                  top=[f"{r['pct']}% {r['name'][:60]}" for r in table["top"][:5]])
                if not math.isfinite(loss):
                    raise self._diverged(loss, step)
                stats.add(step - start, n, loss, self.rt)
                if step % self.cfg.runtime.log_every == 0 or step == tcfg.steps:
                    self.log.emit("step", step=step, loss=loss, lr=lr, batch_size=n,
                                  samples_per_second=stats.samples_per_second(),
                                  peak_vram_gb=peak_vram_gb(self.rt, with_total=False)["allocated"],
                                  world_size=self.dist.world_size, **self.expert)
                bar.advance(1, loss=loss, lr=lr)
                self._maybe_validate(step)
                faults.hit("train")
                if self.cfg.runtime.checkpoint_every and step % self.cfg.runtime.checkpoint_every == 0 and step < tcfg.steps:
                    self.save_checkpoint(step)
        profiler.close()  # the run ended inside the profiled steps
        summary = self._summary(stats, t0)
        note = memory.retries_note(summary["runtime"]["cuda_alloc_retries"], step - start, self.plan.budget)
        if note:
            self.log.emit("warning", message=note)
        if self.saved_step != step:
            self.save_checkpoint(step)
        manifest = self.save_final(step, True, summary)
        self.log.emit("done", seconds=round(time.time() - t0, 3), step=step, **self.expert,
                      **{k: summary[k] for k in ("loss_first", "loss_last", "batch_sizes")})
        return manifest

    def _maybe_validate(self, step: int) -> None:
        every = self.cfg.validation.every_n_steps
        if self.data.held_out is None or not every or not (step % every == 0 or step == self.tcfg.steps):
            return
        if self.dist.is_main:  # the replicas are identical: rank 0 alone evaluates
            loss, n = self.validation_loss()
            self.log.emit("validation", step=step, loss=loss, items=n, **self.expert)

    def _diverged(self, loss: float, step: int) -> TrainingDiverged:
        """The error for a non-finite loss: which step, and what to change before training again (the
        checkpoints written before it are kept)."""
        tcfg = self.tcfg
        fixes = [f"lower train.learning_rate (now {tcfg.learning_rate:g})"]
        if tcfg.max_grad_norm <= 0:
            fixes.append("set train.max_grad_norm (e.g. 1.0: gradient clipping is off)")
        if self.cfg.runtime.cudnn_attention:
            fixes.append("set runtime.cudnn_attention = false (cuDNN's attention backward has failed on this stack: "
                         "docs/troubleshooting.md)")
        return TrainingDiverged(f"train: the loss became {loss} at step {step}: the LoRA diverged or a step went "
                                f"wrong; {', or '.join(fixes)}, and train again (checkpoints written before step "
                                f"{step} are kept)")

    def _stop_requested(self, stop: Any) -> bool:
        """A stop seen by any rank (a signal, or rank 0's stop file) stops every rank before the same
        step; one that cancels (--no-save) cancels everywhere. One tiny all-reduce per step."""
        requested = stop.poll()
        requested, cancel = distributed.any_rank([requested, requested and not stop.save], self.dist)
        stop.save = not cancel
        return requested

    def _summary(self, stats: RunStats, t0: float) -> dict[str, Any]:
        sync(self.rt)
        # the logged steps of the whole history (resumes too), as `report` reads them
        losses = loss_ends(step_losses(read_events(self.cfg.run_dir), self.tcfg.expert))
        return {**losses, "samples": stats.samples, "samples_per_second": stats.samples_per_second(),
                "precision": self.precision,
                # {batch size: steps} of the whole run (resumes included): buckets smaller than
                # train.batch_size make smaller batches
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items(), reverse=True)},
                "compiled": self.compiled, "seconds": round(time.time() - t0, 3), "peak_vram_gb": peak_vram_gb(self.rt),
                "device": str(self.rt.device), "runtime": self._runtime_summary(),
                # collective: each rank's own peak (rank 0's above), for per-GPU memory under torchrun
                "peak_vram_gb_per_rank": distributed.all_gather(peak_vram_gb(self.rt), self.dist)}

    def _runtime_summary(self) -> dict[str, Any]:
        graphs = self.denoiser.summary() if isinstance(self.denoiser, fastpath.GraphedDenoiser) else {}
        return {"attention": self.attention, "cuda_graphs": {"plan": self.graphs_plan, **graphs},
                "enable_tf32": self.cfg.runtime.enable_tf32, "cudnn_benchmark": self.cfg.runtime.cudnn_benchmark,
                "gradient_checkpointing": self.checkpointing,
                # of the model's repeated blocks, the first `checkpointed_blocks` (the memory plan's choice)
                "checkpointed_blocks": self.checkpointed, "blocks": self.blocks, "optimizer": type(self.optimizer).__name__,
                # runtime.keep_attention: the checkpointed blocks keep their attention outputs (no attention recomputed)
                "keep_attention": bool(self.checkpointed and self.cfg.runtime.keep_attention),
                # an fp8 base that keeps only its first blocks in fp8 (the rest nf4) to fit the budget
                "fp8_blocks": self.plan.settings.get("fp8_blocks"),
                "fused_adamw": bool(self.optimizer.defaults.get("fused")),
                # block swap's blocks, host GB, copies made and prefetched copies ready in time; and the
                # allocator's retries (each one a cache flush at the budget's cap: a slow step)
                "block_swap": self.swap.summary() if self.swap is not None else None,
                "cuda_alloc_retries": alloc_retries(self.rt),
                "allocator": memory.allocator_summary(self.rt.device)}

    def _stopped(self, step: int, save: bool, stats: RunStats, t0: float) -> dict[str, Any]:
        """After a stop request, between steps: a resumable checkpoint and the adapter (lora/final,
        complete=false), or with --no-save nothing new at all (earlier checkpoints stay as they are)."""
        if not save:
            self.log.emit("stopped", step=step, saved=False, **self.expert)
            return {"stage": "train", "stopped": True, "saved": False, "step": step}
        if self.saved_step != step:
            self.save_checkpoint(step)
        # the losses so far; no sample counts or speed for a run cut short (as before the split)
        manifest = self.save_final(step, False, self._summary(RunStats(stats.warmup, stats.losses), t0))
        self.log.emit("stopped", step=step, saved=True, checkpoint=f"checkpoint-{step}", **self.expert)
        return {**manifest, "stopped": True, "saved": True}
