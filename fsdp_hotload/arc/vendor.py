"""The vendor route: encode whole files with Fireworks' reference delta module, when the user has it.

Fireworks documents a reference encoder exposing
``delta_compress_files_to_file(src, dst, diff_file, compression_format="arc_v2")``. Its byte layout is not
public, so routing file encoding through it is the way to guarantee that Fireworks' loader reads our deltas
bit-compatibly. It works on whole files (parent file, new file), so it fits the folder-level encoder and the CLI,
not the sharded trainer path, which never assembles a full tensor for a delta.

Example::

    encode = vendor_encoder("fw_delta")              # the module the user installed or put on PYTHONPATH
    encode("parent/model-00001.safetensors", "new/model-00001.safetensors", "out/model-00001.safetensors")
"""
from __future__ import annotations

import importlib
from typing import Callable

ENTRY_POINT = "delta_compress_files_to_file"
VendorEncoder = Callable[[str, str, str], None]


def vendor_encoder(module: str, compression_format: str = "arc_v2") -> VendorEncoder:
    """A file encoder backed by ``module.delta_compress_files_to_file``; ValueError (a usage error) when the
    module or its entry point is missing."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"vendor module {module!r} cannot be imported ({exc}); put Fireworks' reference delta "
                       f"module on PYTHONPATH or drop the vendor option") from None
    fn = getattr(mod, ENTRY_POINT, None)
    if not callable(fn):
        raise ValueError(f"vendor module {module!r} has no callable {ENTRY_POINT}(src, dst, diff_file, "
                       "compression_format=...)")

    def encode(src: str, dst: str, diff_file: str) -> None:
        fn(src, dst, diff_file, compression_format=compression_format)

    return encode
