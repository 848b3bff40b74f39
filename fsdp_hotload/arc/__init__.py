"""The arc byte format: pure numpy / numba / zstandard, no torch.distributed and no fsspec.

Layer 1 of the design: containers, codecs, checksums and the reference decoder. Everything here works on bytes
in memory or on local files, so it can be fuzzed, golden-tested and reused by any receiver.

Example::

    from fsdp_hotload.arc import encode_delta_file, apply_delta_file
    blob = encode_delta_file(parent, new, parent_identity="step-000010-ab12cd34", codec="arc_v2")
    rebuilt = apply_delta_file(parent, blob, expected_parent="step-000010-ab12cd34")
"""
from __future__ import annotations

from .boxes import Box, check_tiling
from .codecs import ArcV2, Codec, ElementDiff, codec_names, element_diff, get_codec, register_codec
from .container import (CHECKSUM_FORMAT, TensorDelta, apply_delta_file, apply_tensor, build_delta_file,
                        delta_header, encode_delta_file, encode_tensor, is_delta_file, read_delta_info)
from .dtypes import RawTensor, code_from_name, itemsize, torch_name
from .errors import ArcError, ChecksumError, FormatError, MismatchError, VendorOutputError
from .stio import load_file, parse_header, save_file, write_file

from . import sparse as _sparse  # noqa: F401  (registers arc_sparse_v1)

import sys as _sys
from pathlib import Path as _Path

from . import jit_cache as _jit_cache

# Before any kernel is called: cached compiled code built from other sources than these is dropped (see jit_cache).
# Every submodule imported by now, not a list to keep up: sparse_decode, split out of sparse_kernels, was missing
# from one, and its kernels kept running sparse_kernels' old helpers after an edit of that file alone.
_jit_cache.refresh([m for n, m in list(_sys.modules.items()) if n.startswith(f"{__name__}.")], _Path(__file__).parent)

__all__ = [
    "ArcError", "ArcV2", "Box", "CHECKSUM_FORMAT", "ChecksumError", "Codec", "ElementDiff", "FormatError",
    "MismatchError", "RawTensor", "TensorDelta", "VendorOutputError", "apply_delta_file", "apply_tensor",
    "build_delta_file", "check_tiling", "code_from_name", "codec_names", "delta_header", "element_diff",
    "encode_delta_file", "encode_tensor", "get_codec", "is_delta_file", "itemsize", "load_file", "parse_header",
    "read_delta_info", "register_codec", "save_file", "torch_name", "write_file",
]
