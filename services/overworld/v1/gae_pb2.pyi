from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EstimateRequest(_message.Message):
    __slots__ = ("discount", "gae_lambda", "tensors", "vtrace", "vtrace_rho_clip", "vtrace_c_clip")
    DISCOUNT_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VTRACE_FIELD_NUMBER: _ClassVar[int]
    VTRACE_RHO_CLIP_FIELD_NUMBER: _ClassVar[int]
    VTRACE_C_CLIP_FIELD_NUMBER: _ClassVar[int]
    discount: float
    gae_lambda: float
    tensors: bytes
    vtrace: bool
    vtrace_rho_clip: float
    vtrace_c_clip: float
    def __init__(self, discount: _Optional[float] = ..., gae_lambda: _Optional[float] = ..., tensors: _Optional[bytes] = ..., vtrace: _Optional[bool] = ..., vtrace_rho_clip: _Optional[float] = ..., vtrace_c_clip: _Optional[float] = ...) -> None: ...

class EstimateResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: bytes
    def __init__(self, tensors: _Optional[bytes] = ...) -> None: ...
