"""`python -m overworld.run_controller`: the same flags and code as `overworld serve run-controller`
(overworld/services/run_controller.py)."""

from overworld.services import main

raise SystemExit(main("run-controller"))
