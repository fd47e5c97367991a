"""`python -m overworld.gae`: the same flags and code as `overworld serve gae`
(overworld/serve/gae.py), on loopback and without a metrics port unless told otherwise."""

from overworld.serve import main

raise SystemExit(main("gae"))
