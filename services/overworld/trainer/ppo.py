"""PPOTrainer: MineStudio's PPO, corrected. Read top to bottom: setup, the iteration loop, one
update over context windows, the optimizer step.

Fixes over MineStudio: ratios against the behaviour log-probs recorded at rollout; advantages
normalised over the global batch; the recurrent state is reset at episode starts inside a window
(the policy sees `first`); the reference policy sees the same windows and carries its own state
from window to window; a non-finite gradient on any rank skips the step on every rank; any
batch_size_per_gpu.

DDP: gradients are all-reduced once per optimizer step (every other backward runs under
`no_sync`), parameters that get no gradient never hang or crash a step (see `wrap_ddp`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from overworld.core.imports import import_object
from overworld.policies.base import Policy
from overworld.trainer.base import BaseTrainer
from overworld.trainer.builtin_hooks import register_builtin_hooks
from overworld.trainer.checkpoint import checkpoint_id
from overworld.trainer.data import Batch
from overworld.trainer.loss import LossConfig, LossTerms, ppo_loss
from overworld.v1 import rollout_manager_pb2

log = logging.getLogger("overworld.trainer.ppo")

TERMS = ("total", "policy", "value", "entropy", "kl", "approx_kl", "clip_fraction")


class PPOTrainer(BaseTrainer):
    def setup_model_and_optimizer(self, policy_generator: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The run's policy (`policy_generator` through the adapters) and AdamW; the reference policy
        for the KL term (`ref_model`)."""
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
        self.reference: Policy | None = None
        if t.kl_divergence_coef_rho > 0:
            self.reference = copy.deepcopy(policy).to(self.device).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        policy.to(self.device)
        model = wrap_ddp(policy) if self.world_size > 1 else policy
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, eps=t.adam_eps)
        self.amp_dtype, self.scaler = amp_settings(t.use_amp, self.device, t.amp_dtype)
        self.loss_config = LossConfig(t.ppo_clip, t.clip_vloss, t.ppo_policy_coef, t.ppo_vf_coef,
                                      t.entropy_bonus_coef, t.log_ratio_range)
        return model, optimizer

    def in_vf_warmup(self) -> bool:
        """MineStudio counts `vf_warmup` in iterations: the first `vf_warmup` ones train the value
        function (and the KL term) only, and publish no weights. (`iteration` is 1 during the first.)"""
        return max(self.iteration - 1, 0) < self.config.train_config.vf_warmup

    def train(self) -> None:
        t = self.config.train_config
        logger = register_builtin_hooks(self)
        for ref in t.hooks:
            import_object(ref)(self)
        self.publish_initial_version()
        stop = self.report("running", {})  # asked to stop while Ray Train started: no iteration to finish
        if stop:
            log.info("stop requested before the first iteration: finishing")
        # Where the fleet is now, waited for (the manager may be restarting too): a resumed trainer that
        # missed it would count the whole fleet's steps again at its first iteration.
        last_env_steps = 0 if stop else self._fleet_env_steps(self._ask_fleet(timeout=60.0), 0)
        try:
            while not stop and self.iteration < t.num_iterations:
                self.iteration += 1
                started = time.monotonic()
                fleet = self._ask_fleet()  # answered while this iteration runs: no round trip of its own
                self.hooks.run("pre_collect", self)
                updates_before = self.updates
                metrics = dict(self.train_iteration() or {})
                updated = time.monotonic()
                fetched = sum(self.timings.get(part, 0.0) for part in ("sample", "values", "gae"))
                self.timings["update"] = updated - started - fetched  # the PPO epochs (hooks included)
                if self.iteration == 1 and self.rank == 0:
                    log.info("first update done: %d optimizer steps", self.updates)  # bench/bench_e2e.py's timeline
                fleet_steps = self._fleet_env_steps(fleet, last_env_steps)
                new_steps = fleet_steps - last_env_steps
                last_env_steps = fleet_steps
                self.env_steps += new_steps
                metrics.update({
                    "trainer/utd_ratio": (self.updates - updates_before) / new_steps if new_steps else math.nan,
                    "trainer/env_steps_all_workers": float(self.env_steps),
                })
                self.hooks.run("post_iteration", self, metrics=metrics)
                self.timings["post_iteration"] = time.monotonic() - updated
                metrics.update({f"trainer/{k}_seconds": v for k, v in self.timings.items()})
                metrics["trainer/iteration_seconds"] = time.monotonic() - started
                if self.report("running", metrics):
                    log.info("stop requested: checkpointing iteration %d and finishing", self.iteration)
                    break
        finally:
            logger.close()
        if t.save_interval > 0 and self.latest_checkpoint != checkpoint_id(self.iteration):
            self.save_checkpoint()
        self.report("finished", {})

    def _ask_fleet(self, timeout: float = 5.0) -> grpc.Future | None:
        """The fleet's status, asked now and answered while the caller works (waits for a manager
        that is restarting, up to `timeout`)."""
        try:
            return self.manager.stub.GetFleetStatus.future(rollout_manager_pb2.GetFleetStatusRequest(),
                                                           timeout=timeout, wait_for_ready=True)
        except Exception:  # statistics only: never stall training on the manager
            return None

    @staticmethod
    def _fleet_env_steps(asked: grpc.Future | None, known: int) -> int:
        """The fleet's env steps (cumulative, kept by the rollout-manager across its restarts); `known`
        while the manager is away, so that the steps are counted once, when it answers again."""
        try:
            return max(known, int(asked.result().env_steps)) if asked is not None else known
        except Exception:  # statistics only: never stall training on the manager
            return known

    # -- one iteration -------------------------------------------------------------------------
    def _normalize(self, adv: torch.Tensor, global_batch: bool) -> torch.Tensor:
        count = torch.tensor(float(adv.numel()), device=adv.device)
        stats = torch.stack([adv.sum(), (adv**2).sum(), count])
        if global_batch:
            stats = self.all_reduce_sum(stats)
        mean = stats[0] / stats[2]
        std = (stats[1] / stats[2] - mean**2).clamp(min=0).sqrt()
        return (adv - mean) / (std + 1e-8)

    def _update_value_normalizer(self, batch: Batch) -> None:
        target = batch.value_target
        assert target is not None
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

    def train_iteration(self, batch: Batch | None = None) -> dict[str, float] | None:
        """MineStudio's iteration: fetch this iteration's fragments with advantages, `ppo_update`, decay
        the KL coefficient. Returns the iteration's metrics (MineStudio returned None; an override that
        does is fine). Given a `batch` (tests, tools), only the update from that batch."""
        if batch is not None:
            return self.update(batch)
        started = time.monotonic()
        r = self.fetch_fragments_and_estimate_advantages(num_fragments=self.fragments_per_iteration)
        self.hooks.run("post_collect", self, batch=r["records"])
        fetched = time.monotonic()
        metrics = self.ppo_update(records=r["records"], td_targets=r["td_targets"], advantages=r["advantages"],
                                  old_logps=r["old_logps"], old_vpreds=r["old_vpreds"], rewards=r["rewards"])
        self.kl_divergence_coef_rho *= self.config.train_config.coef_rho_decay
        return {**(metrics or {}), "trainer/fetch_seconds": fetched - started}

    def ppo_update(self, records: Batch, td_targets: torch.Tensor, advantages: torch.Tensor, old_logps: torch.Tensor,
                   old_vpreds: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
        """MineStudio's PPO update over this rank's chains (`records`), with the tensors
        fetch_fragments_and_estimate_advantages returned (a subclass may change them first)."""
        records.value_target, records.advantage, records.behaviour_logp, records.old_vpred = (
            td_targets, advantages, old_logps, old_vpreds)
        metrics = self.update(records)
        metrics["trainer/buffer_reward"] = float(rewards.float().mean())
        return metrics

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
        self._update_value_normalizer(batch)
        sums = dict.fromkeys(TERMS, 0.0)
        windows = 0
        skipped = 0
        for epoch in range(t.epochs_per_iteration):
            for b, idx in self._minibatches(batch):
                mb = batch.select(idx).to(self.device)
                if not t.normalize_advantage_full_batch:
                    mb.advantage = self._normalize(mb.advantage, global_batch=False)  # type: ignore[arg-type]
                target_vpred = normalizer.normalize(mb.value_target)
                old_vpred = normalizer.normalize(old_value[idx].to(self.device))
                step = (b + 1) % t.gradient_accumulation == 0
                for _ in range(t.optim_steps_per_batch if step else 1):
                    for terms in self._backward_windows(mb, target_vpred, old_vpred, sync=step):  # type: ignore[arg-type]
                        for name in TERMS:
                            sums[name] += float(getattr(terms, name).detach())
                        windows += 1
                    if step:
                        skipped += self._optimizer_step()
            self.hooks.run("post_epoch", self, epoch=epoch)
        self.samples_trained += batch.size * batch.length
        mean = {k: v / max(windows, 1) for k, v in sums.items()}
        return {
            "trainer/policy_loss": mean["policy"], "trainer/value_loss": mean["value"],
            "trainer/entropy_bonus": mean["entropy"], "trainer/kl_divergence_loss": mean["kl"],
            "trainer/total_loss": mean["total"], "trainer/approx_kl": mean["approx_kl"],
            "trainer/clip_fraction": mean["clip_fraction"],
            "trainer/learning_rate": self.optimizer.param_groups[0]["lr"], "trainer/rho": self.rho,
            "trainer/explained_var": explained_variance(old_value, batch.value_target),
            "trainer/abs_advantage": float(batch.advantage.abs().mean()),
            "trainer/abs_td_target": float(batch.value_target.abs().mean()),
            "trainer/buffer_reward": float(batch.reward.sum(1).mean()),
            "trainer/skipped_steps": float(skipped),
            "trainer/policy_lag": float((self.model_version - batch.model_version.float()).mean()),
        }

    def _backward_windows(self, mb: Batch, target_vpred: torch.Tensor, old_vpred: torch.Tensor,
                          sync: bool) -> Iterator[LossTerms]:
        """Forward and backward over consecutive context windows, carrying the (detached) recurrent
        state. The reference policy runs on the same windows from the chain's recorded state and then
        carries its own. Only the last window of a `sync` pass all-reduces gradients (DDP)."""
        t = self.config.train_config
        L = mb.length
        window = min(t.context_length, L)
        warmup = self.in_vf_warmup()
        kl_coef = 1.0 if warmup else self.rho  # MineStudio weights the KL term by 1 during the warm-up
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
                terms = ppo_loss(out, w.action, w.behaviour_logp, w.advantage, target_vpred[:, sl],  # type: ignore[arg-type]
                                 old_vpred[:, sl], ref_logits, kl_coef, self.loss_config, value_only=warmup)
                self.hooks.run("post_loss", self, terms=terms)
                loss = terms.total * (w.length / L) / t.gradient_accumulation
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            yield terms

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        if sync or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _optimizer_step(self) -> int:
        """Clip, step, zero. A non-finite gradient on any rank skips the step on every rank."""
        t = self.config.train_config
        self.hooks.run("pre_optim_step", self)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        # One norm over every gradient (non-finite iff one of them is): a few ops, not one check per tensor.
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        finite = torch.isfinite(norm).float()
        finite = self.all_reduce_sum(finite)
        if finite.item() < self.world_size:
            log.warning("non-finite gradient on some rank: skipping this optimizer step on every rank")
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()
            self.hooks.run("post_optim_step", self, skipped=True)
            return 1
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
        self.hooks.run("post_optim_step", self, skipped=False)
        return 0


def wrap_ddp(policy: Policy) -> torch.nn.Module:
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

    return ray.train.torch.prepare_model(policy, parallel_strategy_kwargs={  # type: ignore[return-value]
        "find_unused_parameters": True, "broadcast_buffers": False})


def amp_settings(use_amp: bool, device: torch.device,
                 amp_dtype: str = "auto") -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """`use_amp` (MineStudio's): the autocast type and the loss scaler. bf16 needs no loss scaling; fp16
    (`amp_dtype: float16`, MineStudio's own choice, or "auto" on a GPU without bf16) gets a GradScaler
    for the device (MineStudio: GradScaler("cuda"); on a CPU the "cpu" one, which the tests use)."""
    if not use_amp:
        return None, None
    fp16 = amp_dtype == "float16" or (amp_dtype == "auto" and device.type == "cuda" and not torch.cuda.is_bf16_supported())
    if fp16:
        return torch.float16, torch.amp.GradScaler(device.type)
    return torch.bfloat16, None


@torch.no_grad()
def explained_variance(prediction: torch.Tensor, target: torch.Tensor) -> float:
    var = target.var()
    return float(1 - (target - prediction).var() / var) if var > 0 else math.nan
