"""Errors raised by the format layer.

Every error that comes from reading untrusted bytes names the file, the tensor and the reason, so an operator
can tell from one log line which object in the bucket is bad and why.
"""
from __future__ import annotations


class ArcError(Exception):
    """Base class for format errors (bad input, failed verification)."""

    def __init__(self, reason: str, *, file: str | None = None, tensor: str | None = None) -> None:
        self.reason = reason
        self.file = file
        self.tensor = tensor
        where = []
        if file is not None:
            where.append(f"file {file!r}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)

    def at(self, *, file: str | None = None, tensor: str | None = None) -> "ArcError":
        """Return a copy of this error with the location filled in where it was unknown."""
        err = type(self)(self.reason, file=self.file or file, tensor=self.tensor or tensor)
        return err


class FormatError(ArcError):
    """The bytes are not a valid container, chunk table or payload (truncated, corrupt, inconsistent)."""


class MismatchError(ArcError):
    """The delta does not fit its parent: wrong parent identity, tensor set, dtype or shape."""


class ChecksumError(ArcError):
    """A reconstructed tensor's Adler-32 differs from the one recorded by the encoder."""


class VendorOutputError(ArcError):
    """What a ``--vendor-module`` wrote fails its check: not a safetensors file, a copy of NEW, or a delta that does
    not rebuild NEW bit for bit. A verification failure of that module's output, not bad input to ``diff``."""
