"""A module with the documented signature of Fireworks' reference encoder, for testing the vendor route.

It records its calls and writes an arc_v2 delta with our encoder, so the test can check both that the route
passes the right files in the right order and that the output is what the function wrote.
"""
from __future__ import annotations

CALLS: list[tuple[str, str, str, str]] = []
MODE = ["delta"]  # "copy": write the new file itself instead of a delta (a broken encoder)


def delta_compress_files_to_file(src: str, dst: str, diff_file: str, compression_format: str = "arc_v2") -> None:
    from fsdp_hotload.arc import encode_delta_file, load_file

    CALLS.append((src, dst, diff_file, compression_format))
    if MODE[0] == "copy":
        with open(dst, "rb") as b, open(diff_file, "wb") as f:
            f.write(b.read())
        return
    with open(src, "rb") as a, open(dst, "rb") as b:
        blob = encode_delta_file(load_file(a.read()), load_file(b.read()), parent_identity="vendor",
                                 codec=compression_format)
    with open(diff_file, "wb") as f:
        f.write(blob)
