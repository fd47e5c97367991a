"""`python -m overworld.rollout_worker`: the same flags and code as `overworld serve rollout-worker`
(overworld/serve/rollout_worker.py), on loopback and without a metrics port unless told otherwise."""

from overworld.serve import main

raise SystemExit(main("rollout-worker"))
