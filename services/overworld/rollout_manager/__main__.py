"""`python -m overworld.rollout_manager`: the same flags and code as `overworld serve rollout-manager`
(overworld/serve/rollout_manager.py), on loopback and without a metrics port unless told otherwise."""

from overworld.serve import main

raise SystemExit(main("rollout-manager"))
