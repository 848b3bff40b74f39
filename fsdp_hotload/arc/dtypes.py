"""Dtypes and the raw tensor type of the format layer.

The format works on raw little-endian bytes, not on numbers: numpy has no bfloat16 or float8, and losslessness
is defined on bytes anyway. A :class:`RawTensor` is a dtype code (the safetensors spelling), a shape and a flat
``uint8`` array. Conversions from numpy arrays and CPU torch tensors are zero-copy where the source is
contiguous.

Example::

    t = RawTensor.from_any(torch.randn(4, 8).bfloat16())
    assert t.dtype == "BF16" and t.shape == (4, 8) and t.nbytes == 64
"""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .errors import FormatError

# safetensors dtype code -> (itemsize, torch dtype name, numpy dtype name or None)
DTYPES: dict[str, tuple[int, str, str | None]] = {
    "BOOL": (1, "bool", "bool"),
    "U8": (1, "uint8", "uint8"),
    "I8": (1, "int8", "int8"),
    "F8_E4M3": (1, "float8_e4m3fn", None),
    "F8_E5M2": (1, "float8_e5m2", None),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz", None),  # AMD's fp8 (no negative zero, one NaN)
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz", None),
    "F8_E8M0": (1, "float8_e8m0fnu", None),  # an exponent only: the block scales of MXFP8/MXFP4 checkpoints
    "I16": (2, "int16", "int16"),
    "U16": (2, "uint16", "uint16"),
    "F16": (2, "float16", "float16"),
    "BF16": (2, "bfloat16", None),
    "I32": (4, "int32", "int32"),
    "U32": (4, "uint32", "uint32"),
    "F32": (4, "float32", "float32"),
    "I64": (8, "int64", "int64"),
    "U64": (8, "uint64", "uint64"),
    "F64": (8, "float64", "float64"),
}
# The floating codes: the dtypes a snapshot may cast floating tensors to (integer and bool tensors keep theirs).
# Not F8_E8M0: a power of two per element is a scale format, and a cast to it would keep only each exponent.
FLOAT_CODES: frozenset[str] = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F16", "BF16", "F32",
                                         "F64"})
# Codes (and torch names) of elements smaller than a byte: a safetensors shape counts them, not bytes, and torch
# packs two float4 values per element (float4_e2m1fn_x2), so shapes would disagree between the two.
_SUB_BYTE = {"F4": "float4_e2m1fn_x2", "F6_E2M3": "float6_e2m3", "F6_E3M2": "float6_e3m2"}
_SUB_BYTE_HINT = ("elements smaller than a byte are not supported; publish the packed bytes as U8 (uint8), as MXFP4 "
                  "checkpoints (gpt-oss) store their blocks")
_TORCH_TO_CODE = {v[1]: k for k, v in DTYPES.items()}
_NUMPY_TO_CODE = {v[2]: k for k, v in DTYPES.items() if v[2] is not None}
UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code; raises FormatError for unknown codes."""
    try:
        return DTYPES[code][0]
    except KeyError:
        if isinstance(code, str) and code in _SUB_BYTE:
            raise FormatError(f"unsupported dtype {code!r}: {_SUB_BYTE_HINT}") from None
        raise FormatError(f"unsupported dtype {code!r} (supported: {', '.join(DTYPES)})") from None


def torch_name(code: str) -> str:
    """torch spelling of a dtype code (``BF16`` -> ``bfloat16``), as used in ``model.weight.spec.json``."""
    itemsize(code)
    return DTYPES[code][1]


def code_from_name(name: str) -> str:
    """Dtype code from a torch name, a ``torch.dtype`` repr or a code itself."""
    name = str(name).removeprefix("torch.")
    if name in DTYPES:
        return name
    if name in _TORCH_TO_CODE:
        return _TORCH_TO_CODE[name]
    if name in _SUB_BYTE or name in _SUB_BYTE.values():
        raise FormatError(f"unsupported dtype {name!r}: {_SUB_BYTE_HINT}")
    raise FormatError(f"unsupported dtype {name!r}")


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


MAX_RANK = 64  # numpy's limit (NPY_MAXDIMS): the tiling check and the decoder build arrays of the tensor's rank
MAX_NBYTES = 2**63 - 1  # numpy's index range: no tensor we can hold is larger


def check_shape(shape: Any, code: str) -> tuple[int, ...]:
    """A shape read from an untrusted header, checked: a list of at most 64 non-negative ints, for at most
    ``MAX_NBYTES`` bytes of dtype ``code`` (itself checked). Raises FormatError without a location (callers add it).

    Why: JSON admits any rank and any integer. Multiplying out tens of thousands of 19-digit dimensions takes
    minutes (each product is longer than the last), a product of a few hundred of them is too long for Python to
    format into an error message (a ValueError, not a format error), and more than 64 dimensions make numpy fail
    inside the tiling check. Here the product stops as soon as it passes the bound, so the check is linear.
    """
    size = itemsize(code)
    if not isinstance(shape, list):
        raise FormatError(f"bad shape {shape!r}")
    if len(shape) > MAX_RANK:
        raise FormatError(f"shape of {len(shape)} dimensions (at most {MAX_RANK} are supported)")
    if not all(type(s) is int and s >= 0 for s in shape):
        raise FormatError(f"bad shape {shape!r}")
    limit = MAX_NBYTES // size
    big = next((i for i, s in enumerate(shape) if s > limit), None)  # also beside a 0: numpy cannot shape it
    if big is not None:
        raise FormatError(f"dimension {big} of a {len(shape)}-dimension shape holds more than {MAX_NBYTES} bytes "
                          f"of {code}")
    if 0 not in shape:
        n = 1
        for s in shape:
            n *= s
            if n > limit:
                raise FormatError(f"shape of {len(shape)} dimensions holds more than {MAX_NBYTES} bytes of {code}")
    return tuple(shape)


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: dtype code, shape, and a flat C-order little-endian ``uint8`` array."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        size = itemsize(self.dtype)
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise FormatError("RawTensor data must be a flat uint8 array")
        if any(int(s) < 0 for s in self.shape):
            raise FormatError(f"negative dimension in shape {self.shape}")
        if self.data.size != numel(self.shape) * size:
            raise FormatError(
                f"{self.data.size} bytes do not hold shape {list(self.shape)} of {self.dtype} "
                f"({numel(self.shape) * size} bytes expected)"
            )

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    def adler32(self) -> int:
        return zlib.adler32(self.data) & 0xFFFFFFFF

    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def digest(self) -> str:
        """SHA-256 over the dtype code, the shape and the bytes. Why not the bytes alone: the same bytes under
        another dtype or shape (a bf16 tensor labelled F16, a transposed shape) load as other weights, so a check
        of served weights against the trainer's must see the labels too."""
        h = hashlib.sha256(f"{self.dtype}{list(self.shape)}:".encode())
        h.update(self.data)
        return h.hexdigest()

    def uint_view(self) -> np.ndarray:
        """The elements as unsigned integers of the same width (for element-wise bit comparisons)."""
        return self.data.view(UINT_BY_SIZE[self.itemsize])

    def to_torch(self) -> Any:
        """A CPU torch tensor sharing (a copy of) these bytes, with the original dtype and shape."""
        import torch

        dtype = getattr(torch, torch_name(self.dtype), None)
        if dtype is None:  # float8_e8m0fnu came with torch 2.7; bytes are still bytes (.data)
            raise FormatError(f"torch {torch.__version__} has no {torch_name(self.dtype)}; use .data")
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=dtype)
        return torch.from_numpy(self.data.copy()).view(dtype).reshape(self.shape)

    def to_numpy(self) -> np.ndarray:
        """A numpy array of the original dtype (not available for bf16/fp8, which numpy lacks)."""
        np_name = DTYPES[self.dtype][2]
        if np_name is None:
            raise FormatError(f"numpy has no {self.dtype}; use .data or .to_torch()")
        return self.data.view(np_name).reshape(self.shape)

    @staticmethod
    def from_any(value: Any) -> "RawTensor":
        """Wrap a numpy array, a CPU torch tensor or a RawTensor (zero-copy when contiguous)."""
        if isinstance(value, RawTensor):
            return value
        if isinstance(value, np.ndarray):
            code = _NUMPY_TO_CODE.get(value.dtype.name)
            if code is None:
                raise FormatError(f"unsupported numpy dtype {value.dtype}")
            arr = np.ascontiguousarray(value)  # at least 1-d: the shape is the input's (a 0-d scalar stays [])
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            return RawTensor(code, tuple(int(s) for s in value.shape), arr.reshape(-1).view(np.uint8))
        mod = type(value).__module__
        if mod.startswith("torch"):
            import torch

            if not isinstance(value, torch.Tensor):
                raise FormatError(f"cannot convert {type(value).__name__} to a tensor")
            if value.device.type != "cpu":
                raise FormatError("RawTensor.from_any needs a CPU tensor; copy it to the host first")
            code = code_from_name(str(value.dtype))
            t = value.detach().contiguous()
            flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            return RawTensor(code, tuple(int(s) for s in t.shape), flat.numpy())
        raise FormatError(f"cannot convert {type(value).__name__} to a tensor")
