"""`python -m overworld.replay_buffer`: the same flags and code as `overworld serve replay-buffer`
(overworld/serve/replay_buffer.py), on loopback and without a metrics port unless told otherwise."""

from overworld.serve import main

raise SystemExit(main("replay-buffer"))
