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
import importlib.util
import os
from types import ModuleType
from typing import Callable

from .errors import VendorOutputError

ENTRY_POINT = "delta_compress_files_to_file"
VendorEncoder = Callable[[str, str, str], None]


def vendor_encoder(module: str, compression_format: str = "arc_v2") -> VendorEncoder:
    """A file encoder backed by ``module.delta_compress_files_to_file``; ``module`` is a name Python imports or the
    path of a ``.py`` file. ValueError (a usage error) when the module or its entry point is missing, or its code
    fails at import; the entry point's own failure is a VendorOutputError naming the module."""
    try:
        mod = _load(module)
    except ValueError:
        raise
    except Exception as exc:  # ImportError, or the module's own code failing at import
        raise ValueError(f"vendor module {module!r} cannot be imported ({type(exc).__name__}: {exc}); put "
                         "Fireworks' reference delta module on PYTHONPATH (or give its .py file's path), or drop "
                         "the vendor option") from None
    fn = getattr(mod, ENTRY_POINT, None)
    if not callable(fn):
        raise ValueError(f"vendor module {module!r} has no callable {ENTRY_POINT}(src, dst, diff_file, "
                       "compression_format=...)")

    def encode(src: str, dst: str, diff_file: str) -> None:
        try:
            fn(src, dst, diff_file, compression_format=compression_format)
        except Exception as exc:  # the module's own failure: one line naming it, not a traceback
            raise VendorOutputError(f"vendor module {module!r} failed: {type(exc).__name__}: {exc}") from None

    return encode


def _load(module: str) -> ModuleType:
    """Import ``module`` by name, or from a file path (``./fw_delta.py``): the README's "a --vendor-module file"
    read as a path gave a TypeError traceback about relative imports."""
    if not (module.endswith(".py") or os.sep in module):
        return importlib.import_module(module)
    if not os.path.isfile(module):
        raise ValueError(f"vendor module file {module!r} does not exist")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module))[0], module)
    if spec is None or spec.loader is None:
        raise ValueError(f"vendor module file {module!r} cannot be loaded as a Python module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
