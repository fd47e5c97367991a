"""`python -m overworld.model_registry`: the same flags and code as `overworld serve model-registry`
(overworld/serve/model_registry.py), on loopback and without a metrics port unless told otherwise."""

from overworld.serve import main

raise SystemExit(main("model-registry"))
