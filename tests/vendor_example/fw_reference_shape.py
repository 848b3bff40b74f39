"""A module with the documented signature of Fireworks' reference encoder, for testing the vendor route.

It records its calls and writes an arc_v2 delta with our encoder, so the test can check both that the route
passes the right files in the right order and that the output is what the function wrote. Its other modes stand for
a module writing a layout of its own (as Fireworks' does, which our decoder cannot read) and for broken ones.
"""
from __future__ import annotations

import os

CALLS: list[tuple[str, str, str, str]] = []
# "copy": write the new file itself instead of a delta (a broken encoder); "foreign": each tensor's XOR against the
# parent, zstd-compressed, as a U8 tensor of a plain safetensors file with metadata of its own (a layout that is not
# ours); "garbage": bytes that are no safetensors file; "unchanged": a delta of no change, which rebuilds the parent
# instead of the new file; "raise": a module that fails part way. A CLI run in a child process takes it from the
# environment.
MODE = [os.environ.get("FW_REFERENCE_SHAPE_MODE", "delta")]


def delta_compress_files_to_file(src: str, dst: str, diff_file: str, compression_format: str = "arc_v2") -> None:
    from fsdp_hotload.arc import encode_delta_file, load_file

    CALLS.append((src, dst, diff_file, compression_format))
    if MODE[0] == "raise":  # the module's own failure, after writing part of its output
        with open(diff_file, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("vendor encoder crashed")
    if MODE[0] == "copy":
        with open(dst, "rb") as b, open(diff_file, "wb") as f:
            f.write(b.read())
        return
    if MODE[0] == "garbage":
        with open(diff_file, "wb") as f:
            f.write(b"not a safetensors file")
        return
    if MODE[0] == "foreign":
        import numpy as np
        import zstandard
        from safetensors.numpy import save_file

        with open(src, "rb") as a, open(dst, "rb") as b:
            old, new = load_file(a.read()), load_file(b.read())
        out = {n: np.frombuffer(zstandard.compress(bytes(np.bitwise_xor(
            np.frombuffer(bytes(old[n].data), np.uint8), np.frombuffer(bytes(t.data), np.uint8)))), np.uint8)
            for n, t in new.items()}
        save_file(out, diff_file, metadata={"format": "vendor-delta", "compression_format": compression_format})
        return
    with open(src, "rb") as a, open(dst, "rb") as b:
        old = load_file(a.read())
        blob = encode_delta_file(old, old if MODE[0] == "unchanged" else load_file(b.read()), parent_identity="vendor",
                                 codec=compression_format)
    with open(diff_file, "wb") as f:
        f.write(blob)
