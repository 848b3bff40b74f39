"""Codec benchmark: compression ratio and single-core speed of the delta codecs on RL-like bf16 updates.

Run ``python benchmarks/codec.py`` (full: 64M-parameter synthetic snapshots plus a 4M-parameter GPT) or
``python benchmarks/codec.py --quick`` (small sizes, < 60 s on 2 cores). ``--write-results`` also replaces
the "Codec benchmark" section of ``benchmarks/RESULTS.md`` with the table.

Every tensor of a snapshot is one chunk. Encode time covers the whole path from the two dense bf16 arrays
(``element_diff`` included, or the fused pass of ``encode_arrays``); decode time covers rebuilding the new chunk
from the parent into a preallocated buffer. Speeds are bf16 bytes of the chunk per second on one core, best of
``--repeat`` runs (the machine may be shared). Every payload is decoded and compared bit for bit.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402
from numba import njit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fsdp_hotload.arc.codecs import ArcV2, element_diff  # noqa: E402
from fsdp_hotload.arc.dense import run_tables  # noqa: E402
from fsdp_hotload.arc.errors import FormatError  # noqa: E402
from fsdp_hotload.arc.sparse import SparseCodec  # noqa: E402
from rl_data import rl_snapshots, tiny_gpt_snapshots  # noqa: E402

BOUND_DEFINITION = (
    "order-0 bound = Σ over chunks of n·H_b(k/n) + k·H0(X) bits, where n = elements, k = changed elements, "
    "H_b the binary entropy of the change mask and H0(X) the empirical entropy of the 16-bit XOR symbols "
    "old^new at the changed positions (an order-0 model of the arc_v2 XOR buffer's information). "
    "context bound = Σ over chunks and parent classes c (the 8 exponent bits of the parent) of "
    "n_c·H_b(k_c/n_c) + k_c·H0(zigzag(new-old) | c): the same information given the parent's exponent, "
    "which the receiver knows."
)


# ------------------------------------------------------------------------------------------ PULSE-style baseline
@njit(nogil=True, cache=True)
def _varint_gaps(idx: np.ndarray, out: np.ndarray) -> int:
    pos = 0
    prev = -1
    for i in range(idx.size):
        g = idx[i] - prev - 1
        prev = idx[i]
        while g >= 128:
            out[pos] = (g & 127) | 128
            pos += 1
            g >>= 7
        out[pos] = g
        pos += 1
    return pos


@njit(nogil=True, cache=True)
def _apply_varint_gaps(buf: np.ndarray, k: int, values: np.ndarray, out: np.ndarray) -> int:
    """Scatter k values at the gap-coded positions; returns the bytes read, or -1 if malformed."""
    pos = 0
    prev = -1
    for j in range(k):
        g = 0
        sh = 0
        while True:
            if pos >= buf.size or sh > 56:
                return -1
            b = buf[pos]
            pos += 1
            g |= (b & 127) << sh
            sh += 7
            if b < 128:
                break
        prev += g + 1
        if prev >= out.size:
            return -1
        out[prev] = values[j]
    return pos


class Pulse:
    """PULSE-style sparse baseline: varint gaps, then the raw new values, one zstd level-1 frame."""

    name = "pulse"

    def encode_arrays(self, parent: np.ndarray, new: np.ndarray, itemsize: int) -> bytes:
        d = element_diff(parent, new, itemsize)
        buf = np.empty(10 * d.changed + 10, np.uint8)
        m = _varint_gaps(d.idx, buf)
        body = d.changed.to_bytes(8, "little") + buf[:m].tobytes() + d.new.tobytes()
        return zstandard.ZstdCompressor(level=1).compress(body)

    def decode(self, payload: bytes, parent: np.ndarray, itemsize: int, out: np.ndarray) -> None:
        # bounded by the worst case: k = n changes of 10-byte varints plus values
        n = parent.size // itemsize
        body = zstandard.ZstdDecompressor().decompress(payload, max_output_size=8 + n * (10 + itemsize))
        k = int.from_bytes(body[:8], "little")
        raw = np.frombuffer(body, np.uint8, offset=8)
        values = raw[raw.size - k * itemsize:].view(parent.dtype if itemsize == 1 else f"<u{itemsize}")
        np.copyto(out, parent)
        used = _apply_varint_gaps(raw[:raw.size - k * itemsize], k, values, out.view(values.dtype))
        if used != raw.size - k * itemsize:
            raise FormatError("pulse payload is malformed")


class _Diff:
    """Wrap a Codec so that encoding starts from the dense arrays (element_diff counted in the time)."""

    def __init__(self, codec: object) -> None:
        self.codec = codec

    def encode_arrays(self, parent: np.ndarray, new: np.ndarray, itemsize: int) -> bytes:
        return self.codec.encode(element_diff(parent, new, itemsize))  # type: ignore[attr-defined]

    def decode(self, payload: bytes, parent: np.ndarray, itemsize: int, out: np.ndarray) -> None:
        self.codec.decode(payload, parent, itemsize, out)  # type: ignore[attr-defined]


class _OnePass:
    """arc_v2 the way the trainer's host path encodes it (``ArcV2.encode_delta``): XOR, count, Adler-32 change
    and entropy coding in one pass, no element diff; with the sequence encoder, one compiled call per chunk."""

    def __init__(self, codec: ArcV2) -> None:
        self.codec = codec

    def encode_arrays(self, parent: np.ndarray, new: np.ndarray, itemsize: int) -> bytes:
        n = parent.size
        return self.codec.encode_delta(parent, new, itemsize, run_tables([(0, n // itemsize)], itemsize), n)[0]

    def decode(self, payload: bytes, parent: np.ndarray, itemsize: int, out: np.ndarray) -> None:
        self.codec.decode(payload, parent, itemsize, out)


# arc_v2 = the default encoder (zero-run sequences through libzstd where available); ·stream = python-zstandard's
# level-1 stream compressor on the same XOR; one-pass = the trainer's host path with the default encoder.
CODECS: dict[str, object] = {
    "arc_v2": _Diff(ArcV2()),
    **({"arc_v2·stream": _Diff(ArcV2(encoder="stream"))} if ArcV2().encoder == "sequences" else {}),
    "arc_v2·one-pass": _OnePass(ArcV2()),
    "PULSE": Pulse(),
    "sparse·diff": _Diff(SparseCodec()),
    "sparse·dense": SparseCodec(),
}


# -------------------------------------------------------------------------------------------------- bounds
def _entropy(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    return float((c * np.log2(c.sum() / c)).sum()) if c.size else 0.0


def _hb(k: np.ndarray, n: np.ndarray) -> float:
    k = np.asarray(k, np.float64)
    n = np.asarray(n, np.float64)
    ok = (k > 0) & (k < n)
    p = k[ok] / n[ok]
    return float((n[ok] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def bounds_bits(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(order-0 bound, context bound) in bits for one bf16 chunk given as uint16 arrays."""
    idx = np.flatnonzero(a != b)
    if idx.size == 0:
        return 0.0, 0.0
    order0 = _hb(np.array([idx.size]), np.array([a.size])) + _entropy(np.bincount(a[idx] ^ b[idx]))
    cls = (a >> 7) & 0xFF
    ccls = cls[idx]
    ctx = _hb(np.bincount(ccls, minlength=256), np.bincount(cls, minlength=256))
    d = (b[idx].astype(np.int64) - a[idx].astype(np.int64)) % 65536
    z = np.where(d >= 32768, 2 * (65536 - d) - 1, 2 * d)
    for c in np.unique(ccls):
        ctx += _entropy(np.unique(z[ccls == c], return_counts=True)[1])
    return order0, ctx


# --------------------------------------------------------------------------------------------------- running
def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _best_time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_step(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], repeat: int) -> dict[str, object]:
    """Ratios and speeds of every codec on one snapshot pair (each tensor one chunk)."""
    pairs = [(_u8(prev[n]), _u8(cur[n])) for n in prev]
    total = sum(a.size for a, _ in pairs)
    changed = sum(int((a.view(np.uint16) != b.view(np.uint16)).sum()) for a, b in pairs)
    row: dict[str, object] = {"changed": changed / (total // 2)}
    for name, codec in CODECS.items():
        payloads = [codec.encode_arrays(a, b, 2) for a, b in pairs]  # type: ignore[attr-defined]
        outs = [np.empty_like(a) for a, _ in pairs]
        for p, (a, b), o in zip(payloads, pairs, outs):
            codec.decode(p, a, 2, o)  # type: ignore[attr-defined]
            if not np.array_equal(o, b):
                raise AssertionError(f"{name} did not round-trip")
        enc = _best_time(lambda: [codec.encode_arrays(a, b, 2) for a, b in pairs], repeat)  # type: ignore
        dec = _best_time(lambda: [codec.decode(p, a, 2, o) for p, (a, _), o in zip(payloads, pairs, outs)],
                         repeat)  # type: ignore[attr-defined]
        row[name] = (total / sum(len(p) for p in payloads), total / enc / 1e9, total / dec / 1e9)
    o0 = ctx = 0.0
    for a, b in pairs:
        x, y = bounds_bits(a.view(np.uint16), b.view(np.uint16))
        o0, ctx = o0 + x, ctx + y
    row["bound"] = total * 8 / max(o0, 1.0)
    row["ctx bound"] = total * 8 / max(ctx, 1.0)
    return row


def datasets(args: argparse.Namespace) -> Iterator[tuple[str, float, Iterator[dict[str, torch.Tensor]]]]:
    for lr in (1e-6, 3e-6):
        yield "synthetic", lr, rl_snapshots(total_params=args.params, steps=args.steps, lr=lr, seed=args.seed)
    for lr in (1e-6, 3e-6):
        kw = dict(vocab=1024, d=128, layers=2) if args.quick else dict(vocab=4096, d=256, layers=4)
        yield "tiny GPT", lr, tiny_gpt_snapshots(steps=args.steps, lr=lr, seed=args.seed, **kw)


from benchmarks.bench_args import arg_int  # noqa: E402  (the repository root is on sys.path)
from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def table(rows: list[tuple[str, float, int, dict[str, object]]]) -> str:
    head = ["data", "lr", "step", "changed"] + list(CODECS) + ["order-0 bound", "context bound",
                                                              "dense / PULSE", "dense / bound", "diff / bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for data, lr, step, r in rows:
        cells = [data, f"{lr:.0e}", str(step), f"{100 * r['changed']:.2f}%"]  # type: ignore[operator]
        for name in CODECS:
            ratio, enc, dec = r[name]  # type: ignore[misc]
            cells.append(f"{ratio:.1f}× ({enc:.2f} / {dec:.2f})")
        dense, diff = r["sparse·dense"][0], r["sparse·diff"][0]  # type: ignore[index]
        cells += [f"{r['bound']:.1f}×", f"{r['ctx bound']:.1f}×", f"{dense / r['PULSE'][0]:.2f}",  # type: ignore
                  f"{dense / r['bound']:.2f}", f"{diff / r['bound']:.2f}"]  # type: ignore[operator]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(path: Path, section: str) -> None:
    """Replace (or append) the codec section of RESULTS.md, leaving other sections untouched."""
    heading = "## Codec benchmark (benchmarks/codec.py)"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip() + "\n\n", text)
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    path.write_text(text.rstrip() + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (< 60 s)")
    ap.add_argument("--params", type=arg_int(1), default=None, help="synthetic parameters (default 64M, quick 4M)")
    ap.add_argument("--steps", type=arg_int(1), default=None, help="optimizer steps per run (default 3, quick 2)")
    ap.add_argument("--repeat", type=arg_int(1), default=None,
                    help="timing repeats, best kept (default 3, quick 2)")
    ap.add_argument("--seed", type=arg_int(0), default=0)
    ap.add_argument("--write-results", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if args.params is None:
        args.params = (4 << 20) if args.quick else (64 << 20)
    if args.steps is None:
        args.steps = 2 if args.quick else 3
    if args.repeat is None:
        args.repeat = 2 if args.quick else 3
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    started = time.time()
    rows = []
    for name, lr, snaps in datasets(args):
        prev = next(snaps)
        data = f"{name} {sum(t.numel() for t in prev.values()) / 1e6:.1f}M"
        for step, cur in enumerate(snaps, 1):
            r = measure_step(prev, cur, args.repeat)
            rows.append((data, lr, step, r))
            print(f"{data} lr={lr:.0e} step {step}: changed {100 * r['changed']:.2f}%  " +  # type: ignore
                  "  ".join(f"{n} {r[n][0]:.1f}x" for n in CODECS) +  # type: ignore[index]
                  f"  bound {r['bound']:.1f}x  ctx {r['ctx bound']:.1f}x", flush=True)
            prev = cur
    cmd = " ".join(["python benchmarks/codec.py", *(sys.argv[1:] if argv is None else argv)])
    md = table(rows)
    print()
    print(md)
    print()
    print("Cells: ratio (encode GB/s / decode GB/s), one core, bf16 bytes of the chunk.")
    print(BOUND_DEFINITION)
    print(targets_heading(rows))
    print("\n".join(targets(rows)))
    print(f"\n{machine()}\nelapsed {time.time() - started:.0f} s")
    if args.write_results:
        write_results(ROOT / "benchmarks" / "RESULTS.md", results_section(rows, md, cmd, time.time() - started))


def _near(rows: list[tuple[str, float, int, dict[str, object]]]) -> tuple[list[dict[str, object]], bool]:
    """The rows the targets are checked on: those with 1-5% changed elements (the "~2%" regime), or every row
    where none is in that range (then True: the heading must say so)."""
    near = [r for _, _, _, r in rows if 0.01 <= r["changed"] <= 0.05]  # type: ignore[operator]
    return (near, False) if near else ([r for _, _, _, r in rows], True)


def targets_heading(rows: list[tuple[str, float, int, dict[str, object]]]) -> str:
    """Says which rows the target lines read: their min and median are not those of the whole table above them."""
    every = _near(rows)[1]
    return "Targets (every row: none has 1-5% changed):" if every else "Targets (rows with 1-5% changed):"


def targets(rows: list[tuple[str, float, int, dict[str, object]]]) -> list[str]:
    """The targets, checked on the rows :func:`targets_heading` names."""
    near = _near(rows)[0]
    out = []
    for mode in ("sparse·dense", "sparse·diff"):
        vs_pulse = min(r[mode][0] / r["PULSE"][0] for r in near)  # type: ignore[index]
        vs_bound = min(r[mode][0] / r["bound"] for r in near)  # type: ignore[index, operator]
        enc = sorted(r[mode][1] for r in near)  # type: ignore[index]
        dec = sorted(r[mode][2] for r in near)  # type: ignore[index]
        out += [
            f"{mode}: ratio ≥ 1.15× PULSE — worst {vs_pulse:.2f}× — {'met' if vs_pulse >= 1.15 else 'NOT met'}",
            f"{mode}: ratio ≥ 90% of the order-0 bound — worst {100 * vs_bound:.0f}% — "
            f"{'met' if vs_bound >= 0.9 else 'NOT met'}; stretch (beat the bound): "
            f"{'met' if vs_bound > 1.0 else 'not met'}",
            f"{mode}: encode ≥ 1 GB/s per core (whole path from the dense arrays) — min {enc[0]:.2f}, median "
            f"{statistics.median(enc):.2f} GB/s — {'met' if statistics.median(enc) >= 1.0 else 'NOT met'} (median); "
            f"decode min {dec[0]:.2f}, median {statistics.median(dec):.2f} GB/s",
        ]
    enc = sorted(r["arc_v2"][1] for r in near)  # type: ignore[index]
    dec = sorted(r["arc_v2"][2] for r in near)  # type: ignore[index]
    out += [
        f"arc_v2: encode ≥ 0.5 GB/s per core (whole path from the dense arrays) — min {enc[0]:.2f}, median "
        f"{statistics.median(enc):.2f} GB/s — {'met' if enc[0] >= 0.5 else 'NOT met'} (the minimum must reach "
        "0.5 GB/s)",
        f"arc_v2: apply ≥ 1 GB/s per core — min {dec[0]:.2f}, median {statistics.median(dec):.2f} GB/s — "
        f"{'met' if dec[0] >= 1.0 else 'NOT met'} (the minimum must reach 1 GB/s)",
    ]
    return out


def results_section(rows: list[tuple[str, float, int, dict[str, object]]], md: str, cmd: str, elapsed: float) -> str:
    return "\n".join([
        "## Codec benchmark (benchmarks/codec.py)",
        "",
        f"- Machine: {machine()}",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Command: `{cmd}` (about {elapsed:.0f} s)",
        f"- Codecs: `arc_v2` (the dense XOR as one zstd frame; encoder `{ArcV2().encoder}`), `arc_v2·stream` (the "
        "same XOR through python-zstandard's level-1 stream compressor, when the sequence encoder is the "
        "default), `arc_v2·one-pass` (the trainer's host path, `ArcV2.encode_delta`: one compiled call per chunk "
        "with the sequence encoder), "
        "PULSE-style baseline (varint gaps + raw new bf16 values, "
        "zstd level 1), `arc_sparse_v1` in sparse mode (`encode(element_diff(...))`) and in class mode "
        "(`encode_arrays(parent, new)`, gaps counted per parent exponent).",
        "",
        md,
        "",
        "Cells: ratio (encode GB/s / decode GB/s), one core, bf16 bytes of the chunk in; best of the repeats on a "
        "shared 2-core machine, so speeds are noisy. Every payload was decoded and compared bit for bit.",
        "",
        f"{BOUND_DEFINITION}",
        "",
        targets_heading(rows),
        "",
        *[f"- {t}" for t in targets(rows)],
        "",
        "Notes: class mode (`encode_arrays`) codes each gap among the elements of the same parent exponent, which "
        "the receiver can count; it needs the dense parent and new chunk at encode time (a host-side cache, or a "
        "device kernel that returns per-class ranks). Sparse mode (`encode`) works from the ElementDiff of a "
        "device diff. Its encode time above includes `element_diff` (kernels.py). The class-mode pass costs "
        "~1.2 ns per element here (a per-element class histogram: on its own 1.7 GB/s of bf16, so with the other "
        "stages class mode stays under 1 GB/s, slower at higher densities); the rANS stages cost ~25 ns per change.",
        *encoder_note(rows),
    ])


def encoder_note(rows: list[tuple[str, float, int, dict[str, object]]]) -> list[str]:
    """arc_v2's two encoders on the same XOR, when both ran."""
    if not rows or "arc_v2·stream" not in rows[0][3]:
        return []
    ratio = [r["arc_v2"][0] / r["arc_v2·stream"][0] for _, _, _, r in rows]  # type: ignore[index]
    enc = [r["arc_v2"][1] / r["arc_v2·stream"][1] for _, _, _, r in rows]  # type: ignore[index]
    return ["", f"arc_v2 encoders (same XOR, same decoder): the sequence encoder's payloads are "
                f"{min(ratio):.2f}-{max(ratio):.2f}x smaller than the stream encoder's, and it encodes "
                f"{min(enc):.2f}-{max(enc):.2f}x as fast (diff path; `arc_v2·one-pass` is the trainer's host path)."]


if __name__ == "__main__":
    main()
