"""MineStudio's online API on Overworld's services: change the import lines, keep the script.

    from overworld.online import start_rolloutmanager, start_trainer     # was minestudio.online...
    from overworld.online import BaseTrainer, PPOTrainer                 # was minestudio.online.trainer

See docs/config.md ("MineStudio users") for what each key does here.
"""

from overworld.online.generators import GeneratorError, generator_ref
from overworld.online.start import start_rolloutmanager, start_trainer, stop_rolloutmanager
from overworld.online.trainer import BaseTrainer, PPOTrainer

__all__ = ["BaseTrainer", "GeneratorError", "PPOTrainer", "generator_ref", "start_rolloutmanager", "start_trainer",
           "stop_rolloutmanager"]
