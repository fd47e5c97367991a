"""The weights stream, both ends: the protocol (protocol.py) and the serving side (server.py) that the
registry and every worker's relay run."""
