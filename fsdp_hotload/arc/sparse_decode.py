"""Decoding kernels of ``arc_sparse_v1``: parse the table model, then replay the rANS stream into the output.

Every length and index read from the payload is checked here (the payload is untrusted); a violation returns an
error code that sparse.py turns into a FormatError naming the reason.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .sparse_kernels import (
    _DEFAULT_MAPPED,
    _DEFAULT_ALL,
    _GAP,
    _VAL,
    _DEFAULT,
    _HELPER,
    _JIT,
    _MAX_TABLES,
    _NONE,
    _NSYM,
    _PROB_SCALE,
    _RANS_L,
    _WEIGHTS,
    _class_of,
    _dec_value,
    _gap_ctx,
    _normalize,
    _unzigzag_add,
)


@njit(**_HELPER)
def _get_varint(buf: np.ndarray, pos: int) -> tuple[int, int]:
    """Varint of at most 3 bytes (all model numbers are < 2^21); pos = -1 on truncation or overlong input."""
    v = 0
    for sh in (0, 7, 14):
        if pos >= buf.size:
            return 0, -1
        byte = int(buf[pos])
        pos += 1
        v |= (byte & 127) << sh
        if byte < 128:
            return v, pos
    return 0, -1


@njit(**_JIT)
def _parse_model(model: np.ndarray, maps: np.ndarray, freqs: np.ndarray, cums: np.ndarray, luts: np.ndarray) -> int:
    """Parse and validate the model section into decoding tables; returns 0 or an error code."""
    pos = 0
    for k in range(2):
        if pos >= model.size:
            return 12
        ntab = int(model[pos])
        pos += 1
        default = ntab >= _DEFAULT_MAPPED
        if ntab == _DEFAULT_ALL:
            for c in range(256):
                maps[k, c] = 0
        elif ntab == 0 or (ntab > _MAX_TABLES and not default):
            return 9
        else:
            ntab = 1 if default else ntab
            first, pos = _get_varint(model, pos)
            count, pos = _get_varint(model, pos) if pos >= 0 else (0, -1)
            if pos < 0 or pos + (count + 1) // 2 > model.size:
                return 12
            if count < 1 or first + count > 256:
                return 10
            for j in range(count + (count & 1)):
                t = (model[pos + j // 2] >> (4 * (j & 1))) & 15
                if t != 15 and (t >= ntab or j == count):
                    return 9
                if j < count:
                    maps[k, first + j] = _NONE if t == 15 else t
            pos += (count + 1) // 2
        for t in range(ntab if not default else 1):
            if default:
                for s in range(_NSYM):
                    freqs[k, t, s] = _DEFAULT[s]
            else:
                nsym, pos = _get_varint(model, pos)
                if pos < 0 or pos + (6 * nsym + 7) // 8 > model.size:
                    return 12
                if nsym < 1 or nsym > _NSYM:
                    return 11
                codes = np.zeros(_NSYM, np.int64)  # then the table's weights
                for s in range(nsym):
                    bit = 6 * s
                    word = int(model[pos + bit // 8])
                    if bit % 8 > 2:
                        word |= int(model[pos + bit // 8 + 1]) << 8
                    codes[s] = (word >> (bit % 8)) & 63
                if (6 * nsym) % 8 and model[pos + (6 * nsym) // 8] >> ((6 * nsym) % 8):
                    return 11  # nonzero padding bits
                pos += (6 * nsym + 7) // 8
                if codes[nsym - 1] == 0:
                    return 11
                for s in range(_NSYM):
                    codes[s] = _WEIGHTS[codes[s]]
                _normalize(codes, freqs[k, t])
            acc = 0
            for s in range(_NSYM):
                f = freqs[k, t, s]
                cums[k, t, s] = acc
                if acc + f > _PROB_SCALE:
                    return 11
                for slot in range(acc, acc + f):
                    luts[k, t, slot] = s
                acc += f
            if acc != _PROB_SCALE:
                return 11
    return 0 if pos == model.size else 13


@njit(**_HELPER)
def _stream_start(data: np.ndarray) -> np.uint64:
    return (np.uint64(data[0]) | (np.uint64(data[1]) << np.uint64(8)) | (np.uint64(data[2]) << np.uint64(16))
            | (np.uint64(data[3]) << np.uint64(24)))


@njit(**_JIT)
def _decode_sparse(parent: np.ndarray, out: np.ndarray, k: int, bits: int, shift: int, data: np.ndarray, end: int,
                   maps: np.ndarray, freqs: np.ndarray, cums: np.ndarray, luts: np.ndarray) -> int:
    """Sparse mode: k (gap, value) pairs; the value's table is chosen by the parent's class at the position."""
    n = parent.size
    for i in range(n):
        out[i] = parent[i]
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    x = _stream_start(data)
    if x < np.uint64(_RANS_L):
        return 5
    pos = 4
    prev = -1
    pctx = 0
    for _ in range(k):
        t = maps[_GAP, pctx]
        if t == _NONE:
            return 4
        g, x, pos = _dec_value(x, data, pos, freqs[_GAP, t], cums[_GAP, t], luts[_GAP, t])
        if pos > end:
            return 1
        if g >= np.uint64(n - prev - 1):
            return 2
        prev += 1 + int(g)
        pctx = _gap_ctx(g)
        o = np.uint64(parent[prev])
        t = maps[_VAL, _class_of(o, shift)]
        if t == _NONE:
            return 4
        v, x, pos = _dec_value(x, data, pos, freqs[_VAL, t], cums[_VAL, t], luts[_VAL, t])
        if pos > end:
            return 1
        if v >= mask:
            return 3
        nv = _unzigzag_add(o, v, mask)
        out[prev] = nv
    return 0 if pos == end and x == np.uint64(_RANS_L) else 5


@njit(**_JIT)
def _decode_class(parent: np.ndarray, out: np.ndarray, k: int, bits: int, shift: int, data: np.ndarray, end: int,
                  maps: np.ndarray, freqs: np.ndarray, cums: np.ndarray, luts: np.ndarray) -> int:
    """Class mode: walk the parent, counting down each class's gap; where it reaches zero, decode the value and
    the class's next gap."""
    n = parent.size
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    x = _stream_start(data)
    if x < np.uint64(_RANS_L):
        return 5
    pos = 4
    rem = np.empty(256, np.int64)  # class elements to skip before the class's next change; -1: never
    for c in range(256):
        rem[c] = -1
        t = maps[_GAP, c]
        if t != _NONE:
            g, x, pos = _dec_value(x, data, pos, freqs[_GAP, t], cums[_GAP, t], luts[_GAP, t])
            if pos > end:
                return 1
            if g > np.uint64(n):
                return 8
            rem[c] = int(g)
    found = 0
    sh = np.uint64(shift)
    for i in range(n):
        a = parent[i]
        out[i] = a
        c = int((np.uint64(a) >> sh) & np.uint64(0xFF))
        r = rem[c]
        if r > 0:
            rem[c] = r - 1
        elif r == 0:
            found += 1
            if found > k:
                return 6
            o = np.uint64(a)
            t = maps[_VAL, c]
            if t == _NONE:
                return 4
            v, x, pos = _dec_value(x, data, pos, freqs[_VAL, t], cums[_VAL, t], luts[_VAL, t])
            if pos > end:
                return 1
            if v >= mask:
                return 3
            nv = _unzigzag_add(o, v, mask)
            out[i] = nv
            t = maps[_GAP, c]
            g, x, pos = _dec_value(x, data, pos, freqs[_GAP, t], cums[_GAP, t], luts[_GAP, t])
            if pos > end:
                return 1
            if g > np.uint64(n):
                return 8
            rem[c] = int(g)
    if found != k:
        return 7
    for c in range(256):
        if rem[c] > 0:
            return 8
    return 0 if pos == end and x == np.uint64(_RANS_L) else 5


# -------------------------------------------------------------------------------------------------- the codec
