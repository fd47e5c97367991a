"""`python -m overworld.trainer`: the same flags and code as `overworld serve trainer`
(overworld/services/trainer.py), on loopback and without a metrics port unless told otherwise."""

from overworld.services import main

raise SystemExit(main("trainer"))
