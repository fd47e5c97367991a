"""`python -m overworld.run_controller`: the same flags and code as `overworld serve run-controller`
(overworld/serve/run_controller.py)."""

from overworld.serve import main

raise SystemExit(main("run-controller"))
