"""Blob stores: where fragment payloads, weights and checkpoints live (a local directory or S3), and the
one a URL names."""
