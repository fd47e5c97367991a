"""PPOTrainer: MineStudio's PPO, corrected (see docs/trainer.md for every key)."""

from __future__ import annotations

import copy
import logging
import math
import time

import torch

from overworld.policies.base import Policy
from overworld.trainer.base import BaseTrainer, all_reduce_sum, build_policy_for_training, is_distributed
from overworld.trainer.data import Batch
from overworld.trainer.loss import LossConfig, ppo_loss

log = logging.getLogger("overworld.trainer.ppo")


class PPOTrainer(BaseTrainer):
    def setup_model_and_optimizer(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        import ray.train.torch

        t = self.config.train_config
        policy = build_policy_for_training(self.config)
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
        model = ray.train.torch.prepare_model(policy) if self.world_size > 1 else policy.to(self.device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, eps=t.adam_eps)
        self.rho = t.kl_divergence_coef_rho
        self.loss_config = LossConfig(t.ppo_clip, t.clip_vloss, t.ppo_policy_coef, t.ppo_vf_coef,
                                      t.entropy_bonus_coef, t.log_ratio_range)
        return model, optimizer

    def train(self) -> None:
        t = self.config.train_config
        chunks_per_rank = t.batch_size_per_gpu * t.batches_per_iteration
        self.model_version = 1
        self.broadcast_model_to_rollout_workers(self.model_version)
        self.report("running", {})
        for self.iteration in range(1, t.num_iterations + 1):
            started = time.monotonic()
            if t.anneal_lr_linearly:
                for group in self.optimizer.param_groups:
                    group["lr"] = t.learning_rate * (1 - (self.iteration - 1) / t.num_iterations)
            batch = self.fetch_fragments_and_estimate_advantages(chunks_per_rank)
            fetched = time.monotonic()
            metrics = self.train_iteration(batch)
            self.rho *= t.coef_rho_decay
            if self.updates >= t.vf_warmup:
                self.model_version += 1
                self.broadcast_model_to_rollout_workers(self.model_version)
            metrics.update({"trainer/fetch_seconds": fetched - started, "trainer/iteration_seconds":
                            time.monotonic() - started})
            if self.iteration % t.log_interval == 0:
                self.report("running", metrics)
        self.report("finished", {})

    def _normalize_advantage(self, batch: Batch) -> None:
        adv = batch.advantage
        assert adv is not None
        t = self.config.train_config
        if t.normalize_advantage_full_batch:
            # Over the global batch: MineStudio normalised per rank.
            stats = all_reduce_sum(torch.stack([adv.sum(), (adv**2).sum(), torch.tensor(float(adv.numel()))]))
            mean = stats[0] / stats[2]
            std = (stats[1] / stats[2] - mean**2).clamp(min=0).sqrt()
            batch.advantage = (adv - mean) / (std + 1e-8)

    def _update_value_normalizer(self, batch: Batch) -> None:
        target = batch.value_target
        assert target is not None
        stats = all_reduce_sum(torch.stack([target.sum(), (target**2).sum(), torch.tensor(float(target.numel()))]))
        self.unwrapped_model.value_normalizer.update(stats[0] / stats[2], stats[1] / stats[2])

    def train_iteration(self, batch: Batch) -> dict[str, float]:
        t = self.config.train_config
        self._normalize_advantage(batch)
        self._update_value_normalizer(batch)
        normalizer = self.unwrapped_model.value_normalizer
        target_vpred = normalizer.normalize(batch.value_target)  # type: ignore[arg-type]
        # The stored old predictions were made before the statistics moved; bring them along.
        old_vpred = normalizer.normalize(normalizer.denormalize(batch.old_vpred))  # type: ignore[arg-type]
        L = batch.length
        window = min(t.context_length, L)
        sums: dict[str, float] = {}
        count = 0
        skipped = 0
        for _epoch in range(t.epochs_per_iteration):
            order = torch.randperm(batch.size, device=self.device)
            for b in range(t.batches_per_iteration):
                idx = order[b * t.batch_size_per_gpu:(b + 1) * t.batch_size_per_gpu]
                if len(idx) == 0:
                    continue
                mb = batch.select(idx)
                state = mb.state
                ref_state = mb.state
                for start in range(0, L, window):
                    sl = slice(start, start + window)
                    w = mb.select(slice(None), sl)
                    out, state = self.model(w.obs, state, w.first)
                    state = {k: v.detach() for k, v in state.items()}
                    ref_logits = None
                    if self.reference is not None and self.rho > 0:
                        with torch.no_grad():
                            ref_out, ref_state = self.reference(w.obs, ref_state, w.first)
                        ref_logits = ref_out.logits
                    terms = ppo_loss(out, w.action, w.behaviour_logp, w.advantage, target_vpred[idx][:, sl],  # type: ignore[arg-type]
                                     old_vpred[idx][:, sl], ref_logits, self.rho, self.loss_config,
                                     value_only=self.updates < t.vf_warmup)
                    scale = (w.length / L) / t.gradient_accumulation
                    (terms.total * scale).backward()
                    for name in ("total", "policy", "value", "entropy", "kl", "approx_kl", "clip_fraction"):
                        sums[name] = sums.get(name, 0.0) + float(getattr(terms, name).detach())
                    count += 1
                if (b + 1) % t.gradient_accumulation == 0:
                    skipped += self._optimizer_step()
        self.samples_trained += batch.size * L
        explained = self._explained_variance(batch)
        metrics = {f"trainer/{k}": v / max(count, 1) for k, v in sums.items()}
        metrics = {
            "trainer/policy_loss": metrics["trainer/policy"], "trainer/value_loss": metrics["trainer/value"],
            "trainer/entropy_bonus": metrics["trainer/entropy"], "trainer/kl_divergence_loss": metrics["trainer/kl"],
            "trainer/total_loss": metrics["trainer/total"], "trainer/approx_kl": metrics["trainer/approx_kl"],
            "trainer/clip_fraction": metrics["trainer/clip_fraction"],
            "trainer/learning_rate": self.optimizer.param_groups[0]["lr"], "trainer/rho": self.rho,
            "trainer/explained_var": explained,
            "trainer/abs_advantage": float(batch.advantage.abs().mean()),  # type: ignore[union-attr]
            "trainer/abs_td_target": float(batch.value_target.abs().mean()),  # type: ignore[union-attr]
            "trainer/buffer_reward": float(batch.reward.sum(1).mean()),
            "trainer/skipped_steps": float(skipped),
            "trainer/policy_lag": float((self.model_version - batch.model_version.float()).mean()),
        }
        return metrics

    def _optimizer_step(self) -> int:
        """Clip, step, zero. A NaN or infinite gradient on any rank skips the step on every rank."""
        t = self.config.train_config
        params = [p for p in self.model.parameters() if p.requires_grad]
        finite = torch.tensor(float(all(p.grad is None or torch.isfinite(p.grad).all() for p in params)))
        finite = all_reduce_sum(finite) if is_distributed() else finite
        if finite.item() < self.world_size:
            log.warning("non-finite gradient on some rank: skipping this optimizer step everywhere")
            self.optimizer.zero_grad(set_to_none=True)
            return 1
        if t.max_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, t.max_grad_value)
        if t.max_grad_norm and t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return 0

    @torch.no_grad()
    def _explained_variance(self, batch: Batch) -> float:
        target = batch.value_target
        assert target is not None and batch.old_vpred is not None
        pred = self.unwrapped_model.value_normalizer.denormalize(batch.old_vpred)
        var = target.var()
        return float(1 - (target - pred).var() / var) if var > 0 else math.nan
