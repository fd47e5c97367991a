"""`python -m overworld.replay_buffer`: the same flags and code as `overworld serve replay-buffer`
(overworld/services/replay_buffer.py), on loopback and without a metrics port unless told otherwise."""

from overworld.services import main

raise SystemExit(main("replay-buffer"))
