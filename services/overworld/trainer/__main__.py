"""`python -m overworld.trainer`: the same flags and code as `overworld serve trainer`
(overworld/serve/trainer.py), on loopback and without a metrics port unless told otherwise."""

from overworld.serve import main

raise SystemExit(main("trainer"))
