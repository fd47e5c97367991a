"""The run configuration: MineStudio's `online_dict`, plus Overworld's own keys.

Keys and meanings follow MineStudio 1.1.6 (see docs/config.md). Loading is strict: an unknown key
or a value of the wrong type is a ConfigError that names the dotted key. Keys MineStudio accepts and
never reads (IGNORED_KEYS) load with one warning naming them.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from overworld.core.config_files import GENERATORS, ConfigError, read_user_config

log = logging.getLogger("overworld.config")


IGNORED_KEYS = {
    "train_config.enable_ref_update": "PPOTrainer stores it and never reads it (the reference policy is "
                                      "always the initial one)",
}
_warned: set[str] = set()


@dataclass
class DatabaseConfig:
    path: str = "replay_buffer"  # MineStudio's cache folder; here the default local blob directory
    # MineStudio's diskcache FanoutCache shards one SQLite file to spread its lock; the index here is in
    # memory or Redis and every blob is its own file/object, so there is no single lock to shard.
    num_shards: int = 8
    index: str = "memory"  # memory | redis://HOST:PORT/DB
    blobs: str = ""  # a local directory or s3://BUCKET/PREFIX; empty = <workdir>/<path>


@dataclass
class ReplayBufferConfig:
    max_chunks: int = 4800
    max_reuse: int = 2
    max_staleness: int = 2
    # "oldest": claims take the chunks stepped longest ago first, so none is left behind to go stale;
    # "uniform": MineStudio's uniform choice (docs/replay_buffer.md, "Sampling").
    sample_order: str = "oldest"
    fragments_per_report: int = 40
    fragments_per_chunk: int = 1
    database_config: DatabaseConfig = field(default_factory=DatabaseConfig)
    # Reverb-style rate limiter, in chunks: samples per inserted chunk, with an error band.
    # null disables it (MineStudio's behaviour: workers never wait for the learner).
    samples_per_insert: float | None = None
    samples_per_insert_error: float = 0.0  # the band; validated so that it cannot deadlock
    min_size_to_sample: int = 1
    max_fragment_bytes: int = 64 * 1024 * 1024
    keep_on_resume: bool = True
    # With a rate limiter, workers reserve room before they step a fragment (docs/replay_buffer.md,
    # "Reserving before stepping"); false: they step unthrottled and meet the limiter at the door.
    reservations: bool = True


@dataclass
class WorkerConfig:
    num_envs: int = 16
    batch_size: int = 8
    restart_interval: float | None = 3600.0
    video_fps: int = 20
    video_output_dir: str = "output/videos"
    video_episodes: int = 4  # episodes recorded per video trigger (MineStudio records 4)
    num_env_processes: int = 0  # 0: one process per env, capped at the CPU count
    step_timeout: float = 60.0
    device: str = "auto"  # auto | cpu | cuda
    env_backend: str = "subprocess"  # subprocess | inprocess (cheap envs like CartPole, stepped in the worker)
    # MineStudio's RolloutWorker keys: env resets before the env is rebuilt (MinecraftSim's fast reset
    # teleports instead of regenerating the world; the world drifts), seconds between pipeline reports
    # (null: none), and the window of those reports' moving averages in seconds.
    max_fast_reset: int = 10000
    log_interval: float | None = None
    moving_stat_duration: float = 300.0


@dataclass
class RolloutConfig:
    num_rollout_workers: int = 2
    num_gpus_per_worker: float = 1.0
    num_cpus_per_worker: float = 1.0
    fragment_length: int = 256
    to_send_queue_size: int = 6
    worker_config: WorkerConfig = field(default_factory=WorkerConfig)
    replay_buffer_config: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    episode_statistics_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    num_workers: int = 2
    num_gpus_per_worker: float = 1.0
    num_iterations: int = 4000
    vf_warmup: int = 0
    learning_rate: float = 2e-5
    anneal_lr_linearly: bool = False
    weight_decay: float = 0.04
    adam_eps: float = 1e-8
    batch_size_per_gpu: int = 1
    batches_per_iteration: int = 200
    gradient_accumulation: int = 10
    epochs_per_iteration: int = 1
    context_length: int = 64
    discount: float = 0.999
    gae_lambda: float = 0.95
    ppo_clip: float = 0.2
    clip_vloss: bool = False
    max_grad_norm: float = 5.0
    max_grad_value: float | None = None
    zero_initial_vf: bool = True
    ppo_policy_coef: float = 1.0
    ppo_vf_coef: float = 0.5
    kl_divergence_coef_rho: float = 0.0
    coef_rho_decay: float = 0.9995
    entropy_bonus_coef: float = 0.0
    log_ratio_range: float = 50.0
    normalize_advantage_full_batch: bool = True
    use_normalized_vf: bool = False
    num_readers: int = 1
    num_cpus_per_reader: float = 0.1
    prefetch_batches: int = 2
    save_interval: int = 10
    keep_interval: int = 40
    record_video_interval: int = 0
    fix_decoder: bool = False
    # null (MineStudio's default) or "never": start fresh; "latest": this run's latest checkpoint;
    # "auto": this run's latest checkpoint if there is one, else fresh (what a restarted trainer uses);
    # a checkpoint id of this run; or a MineStudio checkpoint directory (model.ckpt, optimizer.ckpt).
    resume: str | None = None
    resume_optimizer: bool = True
    save_path: str | None = "output"  # null: the default location, "output" under the workdir
    # MineStudio's head after 1.1.6: mixed precision for the learner's forward passes (autocast), with a
    # GradScaler whose state goes in every checkpoint; off by default. `amp_dtype` (Overworld's) picks the
    # autocast type: "auto" bf16 where the device has it (no scaler needed), else fp16; "float16" is
    # MineStudio's own choice (torch.cuda.amp.autocast: fp16 with a GradScaler); "bfloat16".
    use_amp: bool = False
    amp_dtype: str = "auto"
    optim_steps_per_batch: int = 1
    log_interval: int = 1
    sample_timeout: float = 120.0
    vtrace: bool = False
    vtrace_rho_clip: float = 1.0  # V-trace's rho-bar (clips the value-target importance weights)
    vtrace_c_clip: float = 1.0  # V-trace's c-bar (trace cutting; the trace is lambda * min(c-bar, pi/mu))
    data_timeout: float = 900.0  # seconds a trainer rank may receive no chunk at all before it fails
    placement_timeout: float = 600.0  # seconds to wait for the Ray cluster to offer every trainer worker's GPU
    # chains per forward pass when values and log-probs are recomputed; null: batch_size_per_gpu (MineStudio)
    inference_batch_size_per_gpu: int | None = None
    eval_interval: int = 0  # iterations between evaluations on a separate env; 0 = never
    eval_episodes: int = 5
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict)  # overrides env_kwargs for evaluation
    eval_deterministic: bool = True
    hooks: list[str] = field(default_factory=list)  # "module:function" of setup functions: f(trainer)


# wandb.init's keyword arguments: MineStudio hands its whole logger_config to wandb.init.
WANDB_INIT_KEYS = ("entity", "mode", "tags", "group", "notes", "job_type", "dir", "id", "resume", "resume_from",
                   "fork_from", "save_code", "anonymous", "reinit", "force", "allow_val_change",
                   "config_exclude_keys", "config_include_keys", "sync_tensorboard", "monitor_gym", "settings")


@dataclass
class LoggerConfig:
    project: str = "overworld"
    name: str = "run"
    console: bool = True
    tensorboard: bool = False
    # null: on when the config gives a logger_config (MineStudio's behaviour), else off.
    wandb: bool | None = None
    # The rest of MineStudio's logger_config (entity, mode, tags, ...), passed to wandb.init as given.
    wandb_init: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    trainer_name: str = "PPOTrainer"
    # overworld.online.start_rolloutmanager: the rollout side outlives the script and is reused by the
    # next one when the config is unchanged (`overworld run` always stops everything it started).
    detach_rollout_manager: bool = True
    env_generator: str = "overworld.envs.gym_tasks:make_env"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_generator: str = "overworld.policies.nets:make_mlp_policy"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    task_name: str = ""
    seed: int = 0
    run_id: str = ""
    rollout_config: RolloutConfig = field(default_factory=RolloutConfig)
    train_config: TrainConfig = field(default_factory=TrainConfig)
    logger_config: LoggerConfig = field(default_factory=LoggerConfig)


# Mappings whose keys belong to the user's generators, not to this schema.
FREE_FORM = ("env_kwargs", "policy_kwargs")
FREE_FORM_NESTED = ("train_config.eval_env_kwargs.", "rollout_config.episode_statistics_config.",
                    "logger_config.wandb_init.")


def _drop_ignored(data: dict[str, Any]) -> None:
    """Remove the keys MineStudio accepts and never reads, warning once per process about each."""
    found = []
    for dotted, reason in IGNORED_KEYS.items():
        section, _, key = dotted.rpartition(".")
        parent = data.get(section) if section else data
        if isinstance(parent, dict) and key in parent:
            parent.pop(key)
            if dotted not in _warned:
                _warned.add(dotted)
                found.append(f"{dotted} ({reason})")
    if found:
        log.warning("ignoring config keys MineStudio never reads: %s", "; ".join(found))


def _wandb_from_minestudio(data: dict[str, Any]) -> None:
    """MineStudio passes logger_config to wandb.init whole: W&B is on when it is given, and its
    wandb.init keys (entity, mode, tags, ...) go there as they are."""
    logger = data.get("logger_config")
    if not isinstance(logger, dict):
        return
    passthrough = {k: logger.pop(k) for k in list(logger) if k in WANDB_INIT_KEYS}
    if passthrough:
        logger["wandb_init"] = {**passthrough, **(logger.get("wandb_init") or {})}
    if logger.get("wandb") is None:
        logger["wandb"] = True


def _dotted_key(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    return str(key) if key else "?"


def load_config(source: str | Path | Mapping[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Load and validate a run config from YAML, a Python file with `online_dict`, a dict or an
    OmegaConf DictConfig.

    `overrides` are `dotted.key=value` strings (the CLI's --set).
    """
    schema = OmegaConf.structured(RunConfig)
    data = copy.deepcopy(read_user_config(source))
    _drop_ignored(data)
    _wandb_from_minestudio(data)
    try:
        merged = OmegaConf.merge(schema, data)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: expected dotted.key=value")
            key, value = item.split("=", 1)
            free_form = key.split(".")[0] in FREE_FORM or key.startswith(FREE_FORM_NESTED)
            if not free_form and OmegaConf.select(merged, key, default="__missing__") == "__missing__":
                raise ConfigError(f"--set {key}: unknown config key")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={value}"]))
    except OmegaConfBaseException as err:
        msg = str(err).splitlines()[0]
        raise ConfigError(f"config key {_dotted_key(err)}: {msg}") from None
    config = cast(RunConfig, OmegaConf.to_object(merged))  # merged onto RunConfig's schema: a RunConfig
    if config.logger_config.wandb is None:
        config.logger_config.wandb = False
    validate(config)
    return config


AMP_DTYPES = ("auto", "bfloat16", "float16")


def learner_ranks(train: TrainConfig) -> int:
    """How many learners train: `num_workers` Ray Train workers, or one in Ray Train's local mode (0)."""
    return max(1, train.num_workers)


def chunks_per_iteration(train: TrainConfig) -> int:
    """Chunks one iteration samples, all ranks (learner ranks x batch_size_per_gpu x batches_per_iteration)."""
    return learner_ranks(train) * train.batch_size_per_gpu * train.batches_per_iteration


def validate(config: RunConfig) -> None:
    """Checks across keys that a type system cannot express."""
    rollout, train = config.rollout_config, config.train_config
    rb = rollout.replay_buffer_config
    positive = {
        "rollout_config.fragment_length": rollout.fragment_length,
        "rollout_config.worker_config.num_envs": rollout.worker_config.num_envs,
        "rollout_config.to_send_queue_size": rollout.to_send_queue_size,
        "rollout_config.replay_buffer_config.max_chunks": rb.max_chunks,
        "rollout_config.replay_buffer_config.max_reuse": rb.max_reuse,
        "rollout_config.replay_buffer_config.fragments_per_chunk": rb.fragments_per_chunk,
        "train_config.batch_size_per_gpu": train.batch_size_per_gpu,
        "train_config.batches_per_iteration": train.batches_per_iteration,
        "train_config.gradient_accumulation": train.gradient_accumulation,
        "train_config.epochs_per_iteration": train.epochs_per_iteration,
        "train_config.context_length": train.context_length,
        "train_config.num_iterations": train.num_iterations,
        "train_config.vtrace_rho_clip": train.vtrace_rho_clip,
        "train_config.vtrace_c_clip": train.vtrace_c_clip,
        "train_config.data_timeout": train.data_timeout,
        "train_config.inference_batch_size_per_gpu": train.inference_batch_size_per_gpu or 1,
        "train_config.placement_timeout": train.placement_timeout,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key {key}: must be > 0, got {value}")
    if rollout.worker_config.env_backend not in ("subprocess", "inprocess"):
        raise ConfigError("config key rollout_config.worker_config.env_backend: must be 'subprocess' or "
                          f"'inprocess', got {rollout.worker_config.env_backend!r}")
    if rb.sample_order not in ("oldest", "uniform"):
        raise ConfigError("config key rollout_config.replay_buffer_config.sample_order: 'oldest' or 'uniform', got "
                          f"{rb.sample_order!r}")
    if train.amp_dtype not in AMP_DTYPES:
        raise ConfigError(f"config key train_config.amp_dtype: one of {', '.join(AMP_DTYPES)}, got {train.amp_dtype!r}")
    if train.num_workers < 0:
        raise ConfigError(f"config key train_config.num_workers: must be >= 0 (0: Ray Train's local mode, the "
                          f"learner in the trainer's own process), got {train.num_workers}")
    if rollout.num_rollout_workers < 0:
        raise ConfigError("config key rollout_config.num_rollout_workers: must be >= 0")
    if not 0.0 < train.discount <= 1.0:
        raise ConfigError(f"config key train_config.discount: must be in (0, 1], got {train.discount}")
    if not 0.0 <= train.gae_lambda <= 1.0:
        raise ConfigError(f"config key train_config.gae_lambda: must be in [0, 1], got {train.gae_lambda}")
    if rollout.episode_statistics_config:
        raise ConfigError(
            "config key rollout_config.episode_statistics_config: MineStudio passes it as keyword arguments to "
            "EpisodeStatistics, which takes none but the discount (train_config.discount); only {} is valid, got "
            f"{sorted(rollout.episode_statistics_config)}")
    if rollout.worker_config.max_fast_reset < 1:
        raise ConfigError("config key rollout_config.worker_config.max_fast_reset: must be >= 1")
    if ":" not in config.env_generator or ":" not in config.policy_generator:
        raise ConfigError("config keys env_generator / policy_generator: expected 'module:function'")
    chunk_steps = rollout.fragment_length * rb.fragments_per_chunk
    if chunk_steps % min(train.context_length, chunk_steps):
        raise ConfigError(
            f"config key train_config.context_length: {train.context_length} must divide the chunk length "
            f"fragment_length x fragments_per_chunk = {chunk_steps}"
        )
    per_iteration = chunks_per_iteration(train)
    if per_iteration > rb.max_chunks:
        raise ConfigError(
            f"config key rollout_config.replay_buffer_config.max_chunks: {rb.max_chunks} is smaller than one "
            f"iteration's batch (num_workers x batch_size_per_gpu x batches_per_iteration = {per_iteration})"
        )
    if train.batches_per_iteration % train.gradient_accumulation:
        raise ConfigError(
            "config key train_config.gradient_accumulation: must divide train_config.batches_per_iteration "
            f"({train.gradient_accumulation} does not divide {train.batches_per_iteration})"
        )
    if rb.samples_per_insert is not None:
        try:
            check_rate_limit(rb.samples_per_insert, rb.samples_per_insert_error, rb.max_reuse)
        except ValueError as err:
            raise ConfigError(f"config key rollout_config.replay_buffer_config.samples_per_insert: {err}") from None
        warn_if_stale_by_design(rb, rb.samples_per_insert, train, per_iteration)


def warn_if_stale_by_design(rb: ReplayBufferConfig, spi: float, train: TrainConfig, per_iteration: int) -> None:
    """The lag the room holds, in learner versions: the batches in flight (`samples_per_insert x
    min_size_to_sample + samples_per_insert_error` chunks, over an iteration's) and those fetched ahead.
    A `max_staleness` below it throws away, as stale, steps the fleet was told to step."""
    room = spi * rb.min_size_to_sample + rb.samples_per_insert_error
    lag = math.ceil(room / per_iteration) + train.prefetch_batches
    key = "rollout_config.replay_buffer_config.max_staleness"
    if rb.max_staleness < lag and key not in _warned:
        _warned.add(key)
        log.warning("config key %s: %d is below the lag this room holds (%.0f chunks in flight, %d an iteration, "
                    "%d batches fetched ahead: up to %d versions); chunks older than %d are dropped as stale. "
                    "Raise it, or hold less in flight (docs/replay_buffer.md, 'Sizing the room')",
                    key, rb.max_staleness, room, per_iteration, train.prefetch_batches, lag, rb.max_staleness)


def check_generators(config: RunConfig) -> None:
    """Import the generators here, before any service starts: an import error in the user's file is one
    ConfigError line (the CLI's `error:`), not a traceback in a worker's log."""
    from overworld.core.imports import import_object

    for key in GENERATORS:
        ref = getattr(config, key)
        try:
            import_object(ref)
        except Exception as err:  # the user's code: any error becomes one line naming the file
            message = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(f"config key {key}: {ref}: {type(err).__name__}: {message}") from None


def check_rate_limit(samples_per_insert: float, error: float, max_reuse: int) -> None:
    """Reject samples-per-insert settings under which inserters and samplers can block each other forever.

    The band must admit at least one whole insert and one whole sample from any state, and the ratio
    cannot ask for more samples per chunk than `max_reuse` allows.
    """
    if samples_per_insert <= 0:
        raise ValueError(f"must be > 0, got {samples_per_insert}")
    if error < max(1.0, samples_per_insert):
        raise ValueError(
            f"samples_per_insert_error ({error}) must be >= max(1, samples_per_insert) = "
            f"{max(1.0, samples_per_insert)}, or inserts and samples can block each other forever"
        )
    if samples_per_insert > max_reuse:
        raise ValueError(
            f"{samples_per_insert} samples per chunk cannot be met when a chunk is sampled at most "
            f"max_reuse = {max_reuse} times"
        )


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def from_yaml(text: str) -> RunConfig:
    # what to_yaml wrote: a mapping (anything else fails in load_config, as it always did)
    return load_config(cast(dict[str, Any], OmegaConf.to_container(OmegaConf.create(text), resolve=True)))


def config_hash(config: RunConfig) -> str:
    return hashlib.sha256(to_yaml(config).encode()).hexdigest()[:16]


def as_dict(config: RunConfig | DictConfig) -> dict[str, Any]:
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(config), resolve=True))  # a dict: a config is a mapping
