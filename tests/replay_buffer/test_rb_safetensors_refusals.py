"""Every malformed safetensors payload of tests/core/safetensors_cases.py, sent as a fragment's tensors
over gRPC, is refused as INVALID_ARGUMENT `fragment rejected (decode)` (the zero-copy views refuse it,
and so does the loader they leave it to), counted, and the front goes on serving."""

from __future__ import annotations

import grpc
import pytest
from rb_support import insert, insert_until_error, stats

from tests.core.safetensors_cases import CASES


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_malformed_tensors_are_refused_as_decode_errors(make_buffer) -> None:
    buf = make_buffer()
    wrong = []
    for sequence, (case, make) in enumerate(CASES.items()):
        frag = buf.fragment(seq=sequence)
        frag.tensors = make(frag.tensors)
        acks, err = insert_until_error(buf.client, [frag])
        if acks or err is None:
            wrong.append(f"{case}: accepted")
        elif err.code() != grpc.StatusCode.INVALID_ARGUMENT or "fragment rejected (decode)" not in err.details():
            wrong.append(f"{case}: {err.code()} {err.details()}")
    assert not wrong, "\n".join(wrong)
    assert stats(buf.client).rejected_fragments["decode"] == len(CASES)
    assert [a.stored for a in insert(buf.client, [buf.fragment(seq=len(CASES))])] == [True]
