"""PPOTrainer: MineStudio's PPO, corrected. Read top to bottom: setup, the iteration loop, one
update over context windows, the optimizer step.

Fixes over MineStudio: ratios against the behaviour log-probs recorded at rollout; advantages
normalised over the global batch; the recurrent state is reset at episode starts inside a window
(the policy sees `first`); the reference policy sees the same windows and carried state; a
non-finite gradient on any rank skips the step on every rank; any batch_size_per_gpu.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from overworld.core.imports import import_object
from overworld.policies.base import Policy
from overworld.trainer.base import BaseTrainer, all_reduce_sum, is_distributed
from overworld.trainer.builtin_hooks import register_builtin_hooks
from overworld.trainer.checkpoint import checkpoint_id
from overworld.trainer.data import Batch
from overworld.trainer.loss import LossConfig, LossTerms, ppo_loss

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
        model: torch.nn.Module = policy
        if self.world_size > 1:
            import ray.train.torch

            model = ray.train.torch.prepare_model(policy)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, eps=t.adam_eps)
        self.amp_dtype = (torch.float16 if self.device.type == "cuda" else torch.bfloat16) if t.use_amp else None
        self.scaler = torch.amp.GradScaler("cuda") if t.use_amp and self.device.type == "cuda" else None
        self.loss_config = LossConfig(t.ppo_clip, t.clip_vloss, t.ppo_policy_coef, t.ppo_vf_coef,
                                      t.entropy_bonus_coef, t.log_ratio_range)
        return model, optimizer

    def train(self) -> None:
        t = self.config.train_config
        logger = register_builtin_hooks(self)
        for ref in t.hooks:
            import_object(ref)(self)
        self.publish_initial_version()
        self.report("running", {})
        last_env_steps = self._fleet_env_steps(0, timeout=60.0)  # the manager may be restarting too
        try:
            while self.iteration < t.num_iterations:
                self.iteration += 1
                started = time.monotonic()
                self.hooks.run("pre_collect", self)
                updates_before = self.updates
                metrics = dict(self.train_iteration() or {})
                fleet_steps = self._fleet_env_steps(last_env_steps)
                new_steps = fleet_steps - last_env_steps
                last_env_steps = fleet_steps
                self.env_steps += new_steps
                metrics.update({
                    "trainer/iteration_seconds": time.monotonic() - started,
                    "trainer/utd_ratio": (self.updates - updates_before) / new_steps if new_steps else math.nan,
                    "trainer/env_steps_all_workers": float(self.env_steps),
                })
                self.hooks.run("post_iteration", self, metrics=metrics)
                if self.report("running", metrics):
                    log.info("stop requested: checkpointing iteration %d and finishing", self.iteration)
                    break
        finally:
            logger.close()
        if self.rank == 0 and t.save_interval > 0 and self.latest_checkpoint != checkpoint_id(self.iteration):
            self.save_checkpoint()
        self.report("finished", {})

    def _fleet_env_steps(self, known: int, timeout: float = 5.0) -> int:
        """The fleet's env steps (cumulative, kept by the rollout-manager across its restarts); `known`
        while the manager is away, so that the steps are counted once, when it answers again."""
        try:
            return max(known, int(self.manager.fleet_status(timeout=timeout).env_steps))
        except Exception:  # statistics only: never stall training on the manager
            return known

    # -- one iteration -------------------------------------------------------------------------
    def _normalize(self, adv: torch.Tensor, global_batch: bool) -> torch.Tensor:
        count = torch.tensor(float(adv.numel()), device=adv.device)
        stats = torch.stack([adv.sum(), (adv**2).sum(), count])
        if global_batch:
            stats = all_reduce_sum(stats)
        mean = stats[0] / stats[2]
        std = (stats[1] / stats[2] - mean**2).clamp(min=0).sqrt()
        return (adv - mean) / (std + 1e-8)

    def _update_value_normalizer(self, batch: Batch) -> None:
        target = batch.value_target
        assert target is not None
        stats = all_reduce_sum(torch.stack([target.sum(), (target**2).sum(),
                                            torch.tensor(float(target.numel()), device=target.device)]))
        self.unwrapped_model.value_normalizer.update(stats[0] / stats[2], stats[1] / stats[2])

    def _minibatches(self, batch: Batch) -> Iterator[tuple[int, torch.Tensor]]:
        t = self.config.train_config
        order = torch.randperm(batch.size, device=self.device)
        for b in range(t.batches_per_iteration):
            idx = order[b * t.batch_size_per_gpu:(b + 1) * t.batch_size_per_gpu]
            if len(idx):
                yield b, idx

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

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
        """Epochs of minibatches over `batch` (its advantages and value targets set)."""
        t = self.config.train_config
        assert batch.advantage is not None and batch.value_target is not None and batch.old_vpred is not None
        if t.normalize_advantage_full_batch:
            batch.advantage = self._normalize(batch.advantage, global_batch=True)
        self._update_value_normalizer(batch)
        normalizer = self.unwrapped_model.value_normalizer
        target_vpred = normalizer.normalize(batch.value_target)
        # The stored predictions were made before the statistics moved; bring them along.
        old_vpred = normalizer.normalize(normalizer.denormalize(batch.old_vpred))
        sums = dict.fromkeys(TERMS, 0.0)
        windows = 0
        skipped = 0
        for epoch in range(t.epochs_per_iteration):
            for b, idx in self._minibatches(batch):
                mb = batch.select(idx)
                if not t.normalize_advantage_full_batch:
                    mb.advantage = self._normalize(mb.advantage, global_batch=False)  # type: ignore[arg-type]
                accumulate_done = (b + 1) % t.gradient_accumulation == 0
                for _ in range(t.optim_steps_per_batch if accumulate_done else 1):
                    for terms in self._backward_windows(mb, target_vpred[idx], old_vpred[idx]):
                        for name in TERMS:
                            sums[name] += float(getattr(terms, name).detach())
                        windows += 1
                    if accumulate_done:
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
            "trainer/explained_var": self._explained_variance(batch),
            "trainer/abs_advantage": float(batch.advantage.abs().mean()),
            "trainer/abs_td_target": float(batch.value_target.abs().mean()),
            "trainer/buffer_reward": float(batch.reward.sum(1).mean()),
            "trainer/skipped_steps": float(skipped),
            "trainer/policy_lag": float((self.model_version - batch.model_version.float()).mean()),
        }

    def _backward_windows(self, mb: Batch, target_vpred: torch.Tensor, old_vpred: torch.Tensor) -> Iterator[LossTerms]:
        """Forward and backward over consecutive context windows, carrying the (detached) recurrent
        state; the reference policy runs on the same windows with its own carried state."""
        t = self.config.train_config
        L = mb.length
        window = min(t.context_length, L)
        state, ref_state = mb.state, mb.state
        for start in range(0, L, window):
            sl = slice(start, start + window)
            w = mb.select(slice(None), sl)
            with self._autocast():
                out, state = self.model(w.obs, state, w.first)
                ref_logits = None
                if self.reference is not None and self.rho > 0:
                    with torch.no_grad():
                        ref_out, ref_state = self.reference(w.obs, ref_state, w.first)
                    ref_logits = ref_out.logits
            state = {k: v.detach() for k, v in state.items()}
            out.vpred = out.vpred.float()
            out.logits = {k: v.float() for k, v in out.logits.items()}
            terms = ppo_loss(out, w.action, w.behaviour_logp, w.advantage, target_vpred[:, sl],  # type: ignore[arg-type]
                             old_vpred[:, sl], ref_logits, self.rho, self.loss_config,
                             value_only=self.updates < t.vf_warmup)
            self.hooks.run("post_loss", self, terms=terms)
            loss = terms.total * (w.length / L) / t.gradient_accumulation
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            yield terms

    def _optimizer_step(self) -> int:
        """Clip, step, zero. A non-finite gradient on any rank skips the step on every rank."""
        t = self.config.train_config
        self.hooks.run("pre_optim_step", self)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        finite = torch.tensor(float(all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)),
                              device=self.device)
        if is_distributed():
            finite = all_reduce_sum(finite)
        if finite.item() < self.world_size:
            log.warning("non-finite gradient on some rank: skipping this optimizer step on every rank")
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()
            self.hooks.run("post_optim_step", self, skipped=True)
            return 1
        if t.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, t.max_grad_value)
        if t.max_grad_norm and t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        self.hooks.run("post_optim_step", self, skipped=False)
        return 0

    @torch.no_grad()
    def _explained_variance(self, batch: Batch) -> float:
        target = batch.value_target
        assert target is not None and batch.old_vpred is not None
        pred = self.unwrapped_model.value_normalizer.denormalize(batch.old_vpred)
        var = target.var()
        return float(1 - (target - pred).var() / var) if var > 0 else math.nan
