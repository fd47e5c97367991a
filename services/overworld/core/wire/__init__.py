"""Bytes on the wire and at rest: protobuf primitives, the safetensors format, tensors, weights, the
fragment codec. Never pickle."""
