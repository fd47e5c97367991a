"""PPO, top to bottom: one iteration is

    batch = sample()                    this rank's chains from the replay buffer (host memory)
    estimate_advantages(batch)          the learner's values -> the gae service -> advantages, targets
    update(batch)                       epochs x minibatches: windows forward, the loss, backward, a step
    rho *= coef_rho_decay               the KL coefficient towards the reference policy decays

Everything around it (connections, publishing, checkpoints, status, Ray Train, the loop that counts
the fleet's steps) is trainer/runtime.py; MineStudio's names for these steps, and its subclassing API,
are overworld/online/trainer.py. docs/trainer.md walks through this file and lists what it does
differently from MineStudio's PPO, each with its test.

DDP: gradients are all-reduced once per optimizer step (every other backward runs under `no_sync`);
parameters that get no gradient never hang or crash a step (see `wrap_ddp`).

Memory: an iteration's batch stays in host memory; only `inference_batch_size_per_gpu` chains x
`context_length` steps (values) or one minibatch (update) are on the device at a time.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from overworld.core.config import RunConfig
from overworld.gae.client import GaeClient
from overworld.policies.base import Policy, PolicyOutput, log_prob
from overworld.replay_buffer.reader import ChunkReader
from overworld.trainer.data import Batch, chains_from_chunks, to_device
from overworld.trainer.hooks import Hooks, around
from overworld.trainer.loss import LossConfig, LossMeans, LossTerms, ppo_loss
from overworld.trainer.runtime import TrainerRuntime
from overworld.trainer.stopping import StopDeadline, StoppedWaiting, any_rank

log = logging.getLogger("overworld.trainer.learner")


class PPOLearner(TrainerRuntime):
    # What the learner uses of its runtime (trainer/runtime.py sets each up), so that this file reads alone.
    config: RunConfig  # train_config holds every knob below
    device: torch.device  # this rank's
    world_size: int  # learner ranks: DDP when more than one
    rank: int  # this learner's (0 logs)
    model: torch.nn.Module  # the policy, wrapped by DDP when world_size > 1
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler  # stepped by the loop after each iteration
    hooks: Hooks  # run at the points declared with @around (trainer/hooks.py)
    reader: ChunkReader  # this rank's share of each iteration's chunks, from the replay buffer
    gae_client: GaeClient
    iteration: int  # 1 during the first
    model_version: int  # the newest version published: the policy lag of a batch
    stop_deadline: StopDeadline  # when a stop must be checkpointed by, once the driver says (trainer/stopping.py)
    # ... and its methods: all_reduce_sum(x): over the ranks, a no-op on one; build_policy(): the run's
    # policy, fresh; distributed: more than one rank, their process group up; timed(part): seconds of a part, trainer/<part>_seconds; unwrapped_model: without DDP.
    # What the learner keeps up to date (saved in every checkpoint: trainer/training_state.py):
    rho: float  # the KL coefficient, decayed every iteration
    updates: int  # optimizer steps
    samples_trained: int  # env steps trained on (chains x length, every epoch once)
    lag_steps: Counter[int]  # env steps trained on, by policy lag (versions behind); since this learner began
    sample_wait_seconds: float  # seconds spent getting batches from the replay buffer; since this learner began
    reference: Policy | None  # the frozen KL reference, when kl_divergence_coef_rho > 0
    scaler: torch.amp.GradScaler | None  # fp16 only
    amp_dtype: torch.dtype | None  # autocast type with use_amp

    # -- setup -----------------------------------------------------------------------------------
    def setup_model_and_optimizer(self, policy_generator: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The run's policy and AdamW over what it trains; a frozen copy as the KL reference when
        `kl_divergence_coef_rho > 0`."""
        t = self.config.train_config
        policy = self.build_policy()
        if t.zero_initial_vf:
            for module in policy.value_head_modules():
                for p in module.parameters():
                    torch.nn.init.zeros_(p)
        if t.fix_decoder:
            keep = {id(p) for m in policy.encoder_modules() + policy.value_head_modules() for p in m.parameters()}
            for p in policy.parameters():
                p.requires_grad_(id(p) in keep)
        self.reference = None
        if t.kl_divergence_coef_rho > 0:
            self.reference = copy.deepcopy(policy).to(self.device).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        policy.to(self.device)
        model = wrap_ddp(policy) if self.world_size > 1 else policy
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, eps=t.adam_eps)
        self.amp_dtype, self.scaler = amp_settings(t.use_amp, self.device, t.amp_dtype)
        return model, optimizer

    @property
    def loss_config(self) -> LossConfig:
        t = self.config.train_config
        return LossConfig(t.ppo_clip, t.clip_vloss, t.ppo_policy_coef, t.ppo_vf_coef, t.entropy_bonus_coef,
                          t.log_ratio_range)

    def in_vf_warmup(self) -> bool:
        """The first `vf_warmup` iterations (not optimizer steps) train the value function and the KL
        term only, and publish no weights."""
        return max(self.iteration - 1, 0) < self.config.train_config.vf_warmup

    # -- one iteration -----------------------------------------------------------------------------
    def train_iteration(self, batch: Batch | None = None) -> dict[str, float] | None:
        """Sample, estimate advantages, update, decay the KL coefficient. Given a `batch` (tests,
        tools) whose advantages are set: only the update."""
        if batch is not None:
            return self.update(batch)
        with self.timed("fetch"):
            batch = self.estimate_advantages(self.sample())
        metrics = self.update(batch)
        self.rho *= self.config.train_config.coef_rho_decay
        return metrics

    def sample(self) -> Batch:
        """This rank's share of the iteration's fragments, as chains (B, L) in host memory."""
        with self.timed("sample"):
            started = time.monotonic()
            chunks = self.reader.next()
            self.sample_wait_seconds += time.monotonic() - started  # waiting for the fleet's data, mostly
            if any_rank(len(chunks) < self.reader.n, self.distributed, self.device):
                raise StoppedWaiting(f"{len(chunks)} of {self.reader.n} chunks")
            return chains_from_chunks(chunks)

    # -- values and advantages -------------------------------------------------------------------------
    @around("post_collect", result="batch")
    def estimate_advantages(self, batch: Batch) -> Batch:
        """Fills in the batch's advantages and value targets (the gae service; V-trace if configured)
        and the learner's value predictions before the update (`old_vpred`)."""
        t = self.config.train_config
        with self.timed("values"):
            vpred, next_vpred, target_logp = self.compute_values(batch)
        normalizer = self.unwrapped_model.value_normalizer
        # Denormalised with the statistics the predictions were made with, before this batch moves them.
        value, next_value = normalizer.denormalize(vpred.to(self.device)), normalizer.denormalize(next_vpred.to(self.device))
        request = {
            "reward": batch.reward.numpy(), "value": value.float().cpu().numpy(),
            "terminated": batch.terminated.numpy(), "truncated": batch.truncated.numpy(),
            "bootstrap_value": batch.bootstrap_value.numpy(), "next_value": next_value.float().cpu().numpy()}
        if t.vtrace:
            request["behaviour_logp"] = batch.behaviour_logp.numpy()
            request["target_logp"] = target_logp.numpy()
        with self.timed("gae"):
            adv, target = self.gae_client.estimate(request, t.discount, t.gae_lambda, vtrace=t.vtrace,
                                                   rho_clip=t.vtrace_rho_clip, c_clip=t.vtrace_c_clip)
        batch.advantage = torch.as_tensor(adv)
        batch.value_target = torch.as_tensor(target)
        batch.old_vpred = vpred
        return batch

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The learner's value predictions (B, L) in the value head's space, its prediction for the
        observation after the last step (B,), and its log-probs of the behaviour actions (B, L); on
        the host, float32.

        Bounded memory: `inference_batch_size_per_gpu` chains at a time go through the model in
        windows of `context_length` steps, each group from its recorded state with the recurrent
        state carried from window to window (so the values are those of one pass over the chain)."""
        t = self.config.train_config
        model = self.unwrapped_model
        B, L = batch.size, batch.length
        group = max(1, t.inference_batch_size_per_gpu or t.batch_size_per_gpu)
        window = min(t.context_length, L)
        vpred, logp, next_vpred = torch.empty(B, L), torch.empty(B, L), torch.empty(B)
        last_done = batch.terminated[:, -1:] | batch.truncated[:, -1:]
        for b0 in range(0, B, group):
            rows = slice(b0, min(b0 + group, B))
            state = to_device(batch.state, self.device, rows)
            for start in range(0, L, window):
                end = min(start + window, L)
                obs = {k: v[rows, start:end] for k, v in batch.obs.items()}
                first = batch.first[rows, start:end]
                if end == L:  # the step after the chain rides along with the last window
                    obs = {k: torch.cat([v, batch.next_obs[k][rows]], 1) for k, v in obs.items()}
                    first = torch.cat([first, last_done[rows]], 1)
                with self.autocast():
                    out, state = model(to_device(obs, self.device), state, first.to(self.device))
                n = end - start
                vpred[rows, start:end] = out.vpred[:, :n].float().cpu()
                logits = {k: v[:, :n].float() for k, v in out.logits.items()}
                logp[rows, start:end] = log_prob(logits, to_device(batch.action, self.device, rows, start, end)).cpu()
                if end == L:
                    next_vpred[rows] = out.vpred[:, -1].float().cpu()
        return vpred, next_vpred, logp

    # -- the update ------------------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """The PPO update over one iteration's batch (host memory; its advantages and value targets
        set): `epochs_per_iteration` epochs of minibatches, each moved to the device when its turn
        comes; an optimizer step every `gradient_accumulation` minibatches."""
        t = self.config.train_config
        assert batch.advantage is not None and batch.value_target is not None and batch.old_vpred is not None
        if t.normalize_advantage_full_batch:
            batch.advantage = self._normalize(batch.advantage.to(self.device), global_batch=True).cpu()
        normalizer = self.unwrapped_model.value_normalizer
        # The old predictions were made with the statistics this batch is about to move: denormalised
        # with those, normalised again with the new ones, so clip_vloss compares like with like.
        old_value = normalizer.denormalize(batch.old_vpred.to(self.device)).cpu()
        self._update_value_normalizer(batch.value_target)
        losses = LossMeans()
        if self.iteration == 1 and self.rank == 0:  # a large policy's first update can take minutes
            log.info("first batch in: updating (%d epochs of %d minibatches)", t.epochs_per_iteration,
                     t.batches_per_iteration)
        # A deadline already too close for a step: no step at all (the optimizer step's all-reduce agrees
        # on it after each step from then on).
        self.cut_short = any_rank(self.stop_deadline.late(self.step_seconds), self.distributed, self.device)
        skipped = 0
        for epoch in range(t.epochs_per_iteration):
            if self.cut_short:
                break
            skipped += self._epoch(epoch, batch, old_value, losses)
        self.samples_trained += batch.size * batch.length
        lags, counts = torch.unique((self.model_version - batch.model_version).clamp(min=0), return_counts=True)
        self.lag_steps.update(dict(zip(lags.tolist(), counts.tolist(), strict=True)))
        return {
            **losses.metrics(),
            "trainer/learning_rate": self.optimizer.param_groups[0]["lr"], "trainer/rho": self.rho,
            "trainer/explained_var": explained_variance(old_value, batch.value_target),
            "trainer/abs_advantage": float(batch.advantage.abs().mean()),
            "trainer/abs_td_target": float(batch.value_target.abs().mean()),
            "trainer/buffer_reward": float(batch.reward.sum(1).mean()),
            "trainer/skipped_steps": float(skipped),
            "trainer/update_cut_short": float(self.cut_short),
            "trainer/policy_lag": float((self.model_version - batch.model_version.float()).mean()),
            # over every step trained on since this learner began (the summary's and the bench's figures)
            "trainer/policy_lag_p50": percentile(self.lag_steps, 0.5),
            "trainer/policy_lag_p95": percentile(self.lag_steps, 0.95),
            "trainer/sample_wait_seconds_total": self.sample_wait_seconds,
        }

    @around("post_epoch", arguments=("epoch",))
    def _epoch(self, epoch: int, batch: Batch, old_value: torch.Tensor, losses: LossMeans) -> int:
        """One pass over the batch in minibatches, each loss term added to `losses`; returns how many
        optimizer steps were skipped (a non-finite gradient). An optimizer step after which a stop's
        deadline is too close for one more step and the checkpoint ends the update (`cut_short`)."""
        t = self.config.train_config
        normalizer = self.unwrapped_model.value_normalizer
        skipped = 0
        for b, idx in self._minibatches(batch):
            if b % t.gradient_accumulation == 0:
                step_started = time.monotonic()
            mb = batch.select(idx).to(self.device)
            assert mb.advantage is not None and mb.value_target is not None
            if not t.normalize_advantage_full_batch:
                mb.advantage = self._normalize(mb.advantage, global_batch=False)
            target_vpred = normalizer.normalize(mb.value_target)
            old_vpred = normalizer.normalize(old_value[idx].to(self.device))
            step = (b + 1) % t.gradient_accumulation == 0
            for _ in range(t.optim_steps_per_batch if step else 1):
                for terms in self._backward_windows(mb, target_vpred, old_vpred, sync=step):
                    losses.add(terms)
                if step:
                    self.step_seconds = time.monotonic() - step_started
                    skipped += self._optimizer_step()
                    if self.cut_short:
                        return skipped
        return skipped

    def _normalize(self, adv: torch.Tensor, global_batch: bool) -> torch.Tensor:
        count = torch.tensor(float(adv.numel()), device=adv.device)
        stats = torch.stack([adv.sum(), (adv**2).sum(), count])
        if global_batch:
            stats = self.all_reduce_sum(stats)
        mean = stats[0] / stats[2]
        std = (stats[1] / stats[2] - mean**2).clamp(min=0).sqrt()
        return (adv - mean) / (std + 1e-8)

    def _update_value_normalizer(self, target: torch.Tensor) -> None:
        stats = torch.stack([target.sum(), (target**2).sum(), torch.tensor(float(target.numel()))])
        stats = self.all_reduce_sum(stats.to(self.device))
        self.unwrapped_model.value_normalizer.update(stats[0] / stats[2], stats[1] / stats[2])

    def _minibatches(self, batch: Batch) -> Iterator[tuple[int, torch.Tensor]]:
        t = self.config.train_config
        order = torch.randperm(batch.size)
        for b in range(t.batches_per_iteration):
            idx = order[b * t.batch_size_per_gpu:(b + 1) * t.batch_size_per_gpu]
            if len(idx):
                yield b, idx

    def _backward_windows(self, mb: Batch, target_vpred: torch.Tensor, old_vpred: torch.Tensor,
                          sync: bool) -> Iterator[LossTerms]:
        """Forward and backward over consecutive context windows, carrying the (detached) recurrent
        state. The reference policy runs on the same windows from the chain's recorded state and then
        carries its own. Only the last window of a `sync` pass all-reduces gradients (DDP)."""
        t = self.config.train_config
        L = mb.length
        window = min(t.context_length, L)
        warmup = self.in_vf_warmup()
        kl_coef = 1.0 if warmup else self.rho  # the KL term weighs 1 during the value warm-up
        state, ref_state = mb.state, mb.state
        for start in range(0, L, window):
            sl = slice(start, start + window)
            w = mb.select(slice(None), sl)
            last = start + window >= L
            with self._sync_context(sync and last), self.autocast():
                out, state = self.model(w.obs, state, w.first)
                ref_logits = None
                if self.reference is not None and kl_coef > 0:
                    with torch.no_grad():
                        ref_out, ref_state = self.reference(w.obs, ref_state, w.first)
                    ref_logits = {k: v.float() for k, v in ref_out.logits.items()}
                state = {k: v.detach() for k, v in state.items()}
                out.vpred = out.vpred.float()
                out.logits = {k: v.float() for k, v in out.logits.items()}
                terms = self._loss(out, w, target_vpred[:, sl], old_vpred[:, sl], ref_logits, kl_coef, value_only=warmup)
                loss = terms.total_loss * (w.length / L) / t.gradient_accumulation
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            yield terms

    @around("post_loss", result="terms")
    def _loss(self, out: PolicyOutput, w: Batch, target_vpred: torch.Tensor, old_vpred: torch.Tensor,
              ref_logits: dict[str, torch.Tensor] | None, kl_coef: float, value_only: bool) -> LossTerms:
        """One window's loss terms (trainer/loss.py), before their backward."""
        assert w.advantage is not None
        return ppo_loss(out, w.action, w.behaviour_logp, w.advantage, target_vpred, old_vpred, ref_logits, kl_coef,
                        self.loss_config, value_only=value_only)

    @around("post_optim_step", before="pre_optim_step", result="skipped")
    def _optimizer_step(self) -> bool:
        """Clip, step, zero. A non-finite gradient on any rank skips the step on every rank (returns True).
        The same all-reduce tells every rank whether a stop's deadline leaves room for another step
        (`cut_short`)."""
        t = self.config.train_config
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        # One norm over every gradient (non-finite iff one of them is): a few ops, not one check per tensor.
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        late = torch.tensor(float(self.stop_deadline.late(self.step_seconds)), device=norm.device)
        finite, ranks_late = self.all_reduce_sum(torch.stack([torch.isfinite(norm).float(), late])).tolist()
        self.cut_short = ranks_late > 0
        if finite < self.world_size:
            log.warning("non-finite gradient on some rank: skipping this optimizer step on every rank")
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()
            return True
        if t.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, t.max_grad_value)
            norm = torch.nn.utils.get_total_norm(grads) if grads else norm  # the values changed
        if t.max_grad_norm and t.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, t.max_grad_norm, norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return False

    # -- devices and precision ---------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """`use_amp`: autocast to `amp_dtype` around the learner's forward passes (the update's and the
        value recomputation's); a no-op without it."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        if sync or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()


def wrap_ddp(policy: torch.nn.Module) -> torch.nn.Module:
    """DDP (Ray Train's prepare_model) that survives every policy.

    `find_unused_parameters=True`: a parameter the forward never touches (the recurrent MLP's
    value_encoder, a user's unused head) is marked ready instead of leaving the reduction unfinished
    (the next step would fail with "Expected to have finished reduction"). Parameters the forward
    uses but the loss does not (the policy head in a value-only warm-up with rho = 0) are made to
    take part by the loss itself (loss.py: zero-weighted logits). `fix_decoder`'s frozen parameters
    do not require gradients and DDP leaves them out. The value normaliser's buffers are identical on
    every rank by construction (all-reduced updates), so they are not broadcast on every forward.
    """
    import ray.train.torch

    wrapped: torch.nn.Module = ray.train.torch.prepare_model(policy, parallel_strategy_kwargs={
        "find_unused_parameters": True, "broadcast_buffers": False})
    return wrapped


def amp_settings(use_amp: bool, device: torch.device,
                 amp_dtype: str = "auto") -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """`use_amp`: the autocast type and the loss scaler. bf16 needs no loss scaling; fp16 (`amp_dtype:
    float16`, or "auto" on a GPU without bf16) gets a GradScaler for the device (on a CPU the "cpu" one,
    which the tests use)."""
    if not use_amp:
        return None, None
    fp16 = amp_dtype == "float16" or (amp_dtype == "auto" and device.type == "cuda" and not torch.cuda.is_bf16_supported())
    if fp16:
        return torch.float16, torch.amp.GradScaler(device.type)
    return torch.bfloat16, None


def percentile(counts: Counter[int], q: float) -> float:
    """The q-quantile of values given as {value: how many}: the smallest value with at least q of them at
    or below it."""
    total, seen = sum(counts.values()), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q * total:
            return float(value)
    return math.nan


@torch.no_grad()
def explained_variance(prediction: torch.Tensor, target: torch.Tensor) -> float:
    var = target.var()
    return float(1 - (target - prediction).var() / var) if var > 0 else math.nan
