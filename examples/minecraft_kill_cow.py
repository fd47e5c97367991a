"""MineStudio's online quick start (kill cows with VPT), as a MineStudio user writes it.

    overworld run examples/minecraft_kill_cow.py

`online_dict`, `env_generator` and `policy_generator` keep MineStudio's names, keys and meanings;
Overworld runs them unchanged (the env through overworld.envs.minestudio, the policy through
overworld.policies.minestudio). It needs `minestudio` and Minecraft's engine in the image
(`pip install minestudio`; `python -m minestudio.simulator.entry -y` downloads the engine once), and
VPT weights: set OVERWORLD_VPT_MODEL / OVERWORLD_VPT_WEIGHTS to MineStudio's
`foundation-model-2x.model` / `.weights`, or leave them unset to fetch MineStudio's
rl-from-early-game checkpoint from the Hugging Face hub.
"""

import os

online_dict = {
    "trainer_name": "PPOTrainer",
    "detach_rollout_manager": True,
    "rollout_config": {
        "num_rollout_workers": 2,
        "num_gpus_per_worker": 1.0,
        "num_cpus_per_worker": 1,
        "fragment_length": 256,
        "to_send_queue_size": 8,
        "worker_config": {
            "num_envs": 16,
            "batch_size": 8,
            "restart_interval": 3600,  # 1h
            "video_fps": 20,
            "video_output_dir": "output/videos",
        },
        "replay_buffer_config": {
            "max_chunks": 4800,
            "max_reuse": 2,
            "max_staleness": 2,
            "fragments_per_report": 40,
            "fragments_per_chunk": 1,
            "database_config": {
                "path": "output/replay_buffer_cache",
                "num_shards": 8,
            },
        },
        "episode_statistics_config": {},
    },
    "train_config": {
        "num_workers": 2,
        "num_gpus_per_worker": 1.0,
        "num_iterations": 4000,
        "vf_warmup": 0,
        "learning_rate": 0.00002,
        "anneal_lr_linearly": False,
        "weight_decay": 0.04,
        "adam_eps": 1e-8,
        "batch_size_per_gpu": 1,
        "batches_per_iteration": 200,
        "gradient_accumulation": 10,
        "epochs_per_iteration": 1,
        "context_length": 64,
        "discount": 0.999,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "clip_vloss": False,
        "max_grad_norm": 5,
        "zero_initial_vf": True,
        "ppo_policy_coef": 1.0,
        "ppo_vf_coef": 0.5,
        "kl_divergence_coef_rho": 0.2,
        "entropy_bonus_coef": 0.0,
        "coef_rho_decay": 0.9995,
        "log_ratio_range": 50,
        "normalize_advantage_full_batch": True,
        "use_normalized_vf": True,
        "num_readers": 4,
        "num_cpus_per_reader": 0.1,
        "prefetch_batches": 2,
        "save_interval": 10,
        "keep_interval": 40,
        "record_video_interval": 2,
        "resume": None,
        "resume_optimizer": True,
        "save_path": "output",
    },
    "logger_config": {
        "project": "minestudio_online",
        "name": "kill_cow",
    },
}


def env_generator():
    from minestudio.simulator import MinecraftSim
    from minestudio.simulator.callbacks import (
        CommandsCallback,
        FastResetCallback,
        JudgeResetCallback,
        MaskActionsCallback,
        RewardsCallback,
        SummonMobsCallback,
    )

    sim = MinecraftSim(
        obs_size=(128, 128),
        preferred_spawn_biome="plains",
        callbacks=[
            SummonMobsCallback([{"name": "cow", "number": 10, "range_x": [-5, 5], "range_z": [-5, 5]}]),
            MaskActionsCallback(inventory=0),
            RewardsCallback([{
                "event": "kill_entity",
                "objects": ["cow"],
                "reward": 1.0,
                "identity": "kill_cow",
                "max_reward_times": 30,
            }]),
            CommandsCallback(commands=[
                "/give @p minecraft:iron_sword 1",
                "/give @p minecraft:diamond 64",
                "/effect @p 5 9999 255 true",
            ]),
            FastResetCallback(
                biomes=["plains"],
                random_tp_range=1000,
            ),
            JudgeResetCallback(600),
        ],
    )
    return sim


def policy_generator():
    from minestudio.models import VPTPolicy, load_vpt_policy

    model_path = os.environ.get("OVERWORLD_VPT_MODEL")
    if model_path:
        return load_vpt_policy(model_path=model_path, weights_path=os.environ.get("OVERWORLD_VPT_WEIGHTS"))
    return VPTPolicy.from_pretrained("CraftJarvis/MineStudio_VPT.rl_from_early_game_2x")
