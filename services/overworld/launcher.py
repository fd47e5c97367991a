"""`overworld.launcher`: the names other code imports (overworld.online, the CLI, tests). `overworld run`
itself lives in overworld.launch, one module per concern (see its __init__)."""

from overworld.launch.credentials import RunSecurity
from overworld.launch.processes import descendants, kill_if_same
from overworld.launch.processes import proc_stat as _stat
from overworld.launch.run import run
from overworld.launch.supervisor import Supervisor as Launcher

__all__ = ["Launcher", "RunSecurity", "_stat", "descendants", "kill_if_same", "run"]
