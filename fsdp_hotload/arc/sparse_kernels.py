"""numba kernels and tables of the ``arc_sparse_v1`` codec (see sparse.py for the format).

Kept apart from the codec class so each module stays readable; every kernel that does real work is compiled with
``nogil=True`` because it runs on publisher threads next to the training loop.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

_MAGIC = b"ASPC"
_VERSION = 2  # payloads of version 1 (no CRC-32) are still read
MODE_EMPTY, MODE_SPARSE, MODE_CLASS = 0, 1, 2
_PROB_BITS = 12
_PROB_SCALE = 1 << _PROB_BITS
_RANS_L = 1 << 23  # the rANS state lives in [L, 256 L)
_NSYM = 256  # tokens of any 64-bit value
_MAX_TABLES = 15  # table ids fit a nibble; 15 marks a context without a table
_NONE = 255  # map entry: no table (class mode: the class never changes)
_DEFAULT_MAPPED, _DEFAULT_ALL = 254, 255  # table-count byte: built-in table with / without a context map
_GAP, _VAL = 0, 1
_SMALL_K = 256  # below this many changes encode_arrays also tries sparse mode and keeps the smaller payload
_JIT = dict(nogil=True, cache=True)  # kernels run on publisher threads: never hold the GIL
_HELPER = dict(cache=True)

_ERRORS = {
    1: "rANS stream truncated",
    2: "a decoded position runs past the end of the chunk",
    3: "a decoded value does not fit the element width",
    4: "a context that needs a coding table has none",
    5: "rANS stream has trailing bytes or a bad final state",
    6: "more changes decoded than the header declares",
    7: "fewer changes decoded than the header declares",
    8: "a class gap runs past the end of its class",
    9: "model section: table count or table id out of range",
    10: "model section: a context map is empty or runs past context 255",
    11: "model section: bad table (frequencies must sum to 4096)",
    12: "model section truncated",
    13: "model section has trailing bytes",
}


def _default_table() -> np.ndarray:
    """Built-in frequencies for chunks too small to pay for a table: +-1 ulp values, then small/medium tokens."""
    f = np.ones(_NSYM, np.int64)
    f[0:2] += 600
    f[2:112] += 24
    assert f.sum() == _PROB_SCALE
    return f


_DEFAULT = _default_table()
_DEFAULT_BITS = np.log2(_PROB_SCALE / _DEFAULT)  # for size estimates only


def _weight_table() -> np.ndarray:
    """Table weights for 6-bit codes: code q > 0 stands for 16 * 2^((q-1)/4), in exact integer arithmetic so that
    encoder and decoder derive identical frequencies on any machine (code 0: symbol absent)."""
    w = np.zeros(64, np.int64)
    for q in range(1, 64):
        w[q] = math.isqrt(math.isqrt(65536 << (q - 1)))
    return w


_WEIGHTS = _weight_table()


# ----------------------------------------------------------------------------------------------- numba helpers
@njit(**_HELPER)
def _top_bit(v: np.uint64) -> int:
    """Index of the highest set bit of v > 0."""
    n = 0
    for s in (32, 16, 8, 4, 2, 1):
        if v >> np.uint64(s):
            v >>= np.uint64(s)
            n += s
    return n


@njit(**_HELPER)
def _token(v: np.uint64) -> int:
    """Hybrid-integer token: v itself below 16, else 16 + 4 * (top bit - 4) + the two bits under it."""
    if v < np.uint64(16):
        return np.int64(v)
    n = _top_bit(v)
    return 16 + ((n - 4) << 2) + int((v >> np.uint64(n - 2)) & np.uint64(3))


@njit(**_HELPER)
def _token_bits(tok: int) -> int:
    """Raw low bits that follow a token."""
    return 0 if tok < 16 else ((tok - 16) >> 2) + 2


@njit(**_HELPER)
def _zigzag(old: np.uint64, new: np.uint64, bits: int) -> np.uint64:
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    d = (new - old) & mask
    return ((d << np.uint64(1)) & mask) ^ (mask * ((d >> np.uint64(bits - 1)) & np.uint64(1)))


@njit(**_HELPER)
def _unzigzag_add(o: np.uint64, v: np.uint64, mask: np.uint64) -> np.uint64:
    """Parent value plus the zigzag delta coded as v = z - 1 (the caller checks v < mask: z in [1, mask])."""
    z = v + np.uint64(1)
    return (o + ((z >> np.uint64(1)) ^ (mask * (z & np.uint64(1))))) & mask


@njit(**_HELPER)
def _class_of(v: np.uint64, shift: int) -> int:
    return int((v >> np.uint64(shift)) & np.uint64(0xFF))


@njit(**_HELPER)
def _gap_ctx(g: np.uint64) -> int:
    """Sparse-mode gap context: bit length of the previous gap (capped)."""
    return min(_top_bit(g) + 1, 40) if g > np.uint64(0) else 0


@njit(**_HELPER)
def _renorm_out(x: np.uint64, buf: np.ndarray, pos: int, xmax: np.uint64) -> tuple[np.uint64, int]:
    while x >= xmax:
        pos -= 1
        buf[pos] = np.uint8(x & np.uint64(0xFF))
        x >>= np.uint64(8)
    return x, pos


@njit(**_HELPER)
def _renorm_in(x: np.uint64, data: np.ndarray, pos: int) -> tuple[np.uint64, int]:
    """Refill the state. Unchecked: the caller pads data and checks ``pos <= end`` after every value; with the
    state >= 2^23 before a step, one value reads at most 14 bytes."""
    while x < np.uint64(_RANS_L):
        x = (x << np.uint64(8)) | np.uint64(data[pos])
        pos += 1
    return x, pos


@njit(**_HELPER)
def _dec_value(x: np.uint64, data: np.ndarray, pos: int, freq: np.ndarray, cum: np.ndarray,
               lut: np.ndarray) -> tuple[np.uint64, np.uint64, int]:
    """Decode one table-coded number (token, then its raw bits in 16-bit chunks). Returns (v, x, pos)."""
    slot = x & np.uint64(_PROB_SCALE - 1)
    tok = int(lut[slot])
    x, pos = _renorm_in(np.uint64(freq[tok]) * (x >> np.uint64(_PROB_BITS)) + slot - np.uint64(cum[tok]), data, pos)
    if tok < 16:
        return np.uint64(tok), x, pos
    nb = ((tok - 16) >> 2) + 2
    v = np.uint64(4 | (tok & 3)) << np.uint64(nb)
    s = 0
    while s < nb:
        b = min(16, nb - s)
        v |= (x & np.uint64((1 << b) - 1)) << np.uint64(s)
        x, pos = _renorm_in(x >> np.uint64(b), data, pos)
        s += b
    return v, x, pos


# ------------------------------------------------------------------------------------------------ the model
@njit(**_JIT)
def _normalize(h: np.ndarray, out: np.ndarray) -> None:
    """Quantise counts to frequencies summing to 2^12, keeping every used symbol at >= 1."""
    n = 0
    for s in range(h.size):
        n += h[s]
    total = 0
    best = 0
    for s in range(h.size):
        out[s] = 0
        if h[s] > 0:
            out[s] = max((h[s] * _PROB_SCALE + n // 2) // n, 1)
            total += out[s]
            if h[s] > h[best]:
                best = s
    out[best] += _PROB_SCALE - total
    need = 1 - out[best]
    if need > 0:
        out[best] = 1
        for s in range(h.size):
            while need > 0 and out[s] > 1:
                out[s] -= 1
                need -= 1


_XLOGX = np.array([0.0] + [c * math.log2(c) for c in range(1, 4096)])  # c·log2(c), for size estimates only


@njit(**_HELPER)
def _xlx(c: int) -> float:
    return _XLOGX[c] if c < 4096 else c * math.log2(c)


@njit(**_JIT)
def _group_cost(h: np.ndarray, h2: np.ndarray) -> float:
    """Estimated bits to code the histogram h + h2 with its own table: entropy plus the serialised table."""
    n = 0
    acc = 0.0
    last = -1
    for s in range(h.size):
        c = h[s] + h2[s]
        if c > 0:
            n += c
            acc += _xlx(c)
            last = s
    return _xlx(n) - acc + 8.0 + 6.0 * (last + 1) if n else 0.0  # the table: symbol count, 6 bits a symbol


@njit(**_JIT)
def _merge_contexts(hist: np.ndarray, ctxs: np.ndarray, ctx_map: np.ndarray) -> tuple[int, float]:
    """Group contexts (rows of hist, context ids in ctxs) into tables: sort by mean token, merge neighbours
    while that saves bits (and always down to 15 tables). Writes ctx_map; returns (tables, estimated bits)."""
    na, nt = hist.shape
    keys = np.empty(na)
    order = np.empty(na, np.int64)
    for r in range(na):  # mean token per context, insertion-sorted (na <= 256)
        tot = 0
        acc = 0
        for s in range(nt):
            tot += hist[r, s]
            acc += hist[r, s] * s
        keys[r] = acc / tot
        j = r
        while j > 0 and keys[order[j - 1]] > keys[r]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = r
    gh = np.empty((na, nt), np.int64)  # group histograms in key order; groups live in a linked list
    cost = np.empty(na)
    gain = np.empty(na)  # bits saved by merging g with nxt[g]
    owner = np.empty(na, np.int64)
    nxt = np.empty(na, np.int64)
    prv = np.empty(na, np.int64)
    zero = np.zeros(nt, np.int64)
    for g in range(na):
        for s in range(nt):
            gh[g, s] = hist[order[g], s]
        cost[g] = _group_cost(gh[g], zero)
        owner[g] = g
        nxt[g] = g + 1
        prv[g] = g - 1
        gain[g] = -np.inf
    for g in range(na - 1):
        gain[g] = cost[g] + cost[g + 1] - _group_cost(gh[g], gh[g + 1])
    alive = na
    while alive > 1:
        best = 0
        g = 0
        while g < na:
            if gain[g] > gain[best]:
                best = g
            g = nxt[g]
        if gain[best] <= 0.0 and alive <= _MAX_TABLES:
            break
        o = nxt[best]
        for s in range(nt):
            gh[best, s] += gh[o, s]
        cost[best] += cost[o] - gain[best]
        nxt[best] = nxt[o]
        if nxt[o] < na:
            prv[nxt[o]] = best
        for i in range(na):
            if owner[i] == o:
                owner[i] = best
        alive -= 1
        for side in range(2):  # the two candidate merges that changed
            h = prv[best] if side == 0 else best
            if h >= 0:
                gain[h] = -np.inf
                if nxt[h] < na:
                    gain[h] = cost[h] + cost[nxt[h]] - _group_cost(gh[h], gh[nxt[h]])
    table_of = np.empty(na, np.int64)
    total = 0.0
    t = 0
    g = 0
    while g < na:
        table_of[g] = t
        total += cost[g]
        t += 1
        g = nxt[g]
    for i in range(na):
        ctx_map[ctxs[order[i]]] = table_of[owner[i]]
    return alive, total


@njit(**_HELPER)
def _put_varint(buf: np.ndarray, pos: int, v: int) -> int:
    while v >= 128:
        buf[pos] = (v & 127) | 128
        pos += 1
        v >>= 7
    buf[pos] = v
    return pos + 1


@njit(**_JIT)
def _build_model(kind: np.ndarray, ctx: np.ndarray, val: np.ndarray, tok: np.ndarray, exact_gap_map: bool,
                 maps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Tokenise the ops, merge contexts into tables (or take the built-in table when cheaper), quantise and
    serialise. ``exact_gap_map``: the gap map must list exactly the contexts used (class mode).

    Returns (model bytes, encoder frequencies and cumulative frequencies per kind/table/token, raw bit count);
    the last bounds the rANS stream size.
    """
    rows = np.empty((2, 256), np.int64)  # context -> histogram row (-1: unused)
    for c in range(256):
        rows[0, c] = rows[1, c] = -1
    ctxs = np.empty((2, 256), np.int64)  # row -> context, ascending
    nctx = np.zeros(2, np.int64)
    raw_bits = 0
    ntok = 1
    for i in range(val.size):
        t = _token(val[i])
        tok[i] = t
        ntok = max(ntok, t + 1)
        rows[kind[i], ctx[i]] = 0
        raw_bits += _token_bits(t)
    for k in range(2):
        for c in range(256):
            if rows[k, c] >= 0:
                rows[k, c] = nctx[k]
                ctxs[k, nctx[k]] = c
                nctx[k] += 1
    hist = np.zeros((2, max(nctx[0], nctx[1]), ntok), np.int64)
    for i in range(val.size):
        hist[kind[i], rows[kind[i], ctx[i]], tok[i]] += 1
    ntabs = np.zeros(2, np.int64)
    defaults = np.zeros(2, np.bool_)
    for k in range(2):
        for c in range(256):
            maps[k, c] = _NONE
        ntabs[k], est = _merge_contexts(hist[k, :nctx[k]], ctxs[k, :nctx[k]], maps[k])
        default_bits = 0.0
        for r in range(nctx[k]):
            for s in range(ntok):
                default_bits += hist[k, r, s] * _DEFAULT_BITS[s]
        if default_bits <= est:
            defaults[k] = True
            ntabs[k] = 1
            for r in range(nctx[k]):
                maps[k, ctxs[k, r]] = 0
    ntmax = max(ntabs[0], ntabs[1])
    freqs = np.zeros((2, ntmax, ntok), np.int64)
    cums = np.zeros((2, ntmax, ntok), np.int64)
    codes = np.zeros((2, ntmax, ntok), np.int64)
    model = np.empty(2 * (8 + 128) + 2 * ntmax * (3 + (6 * ntok + 7) // 8), np.uint8)
    pos = 0
    for k in range(2):
        if defaults[k]:
            for s in range(ntok):
                freqs[k, 0, s] = _DEFAULT[s]
        else:
            th = np.zeros((ntabs[k], ntok), np.int64)
            for r in range(nctx[k]):
                for s in range(ntok):
                    th[maps[k, ctxs[k, r]], s] += hist[k, r, s]
            w = np.zeros(ntok, np.int64)
            for t in range(ntabs[k]):  # 6-bit log-scale codes of the counts; both sides normalise their weights
                top = 1
                for s in range(ntok):
                    top = max(top, th[t, s])
                for s in range(ntok):
                    if th[t, s] > 0:
                        codes[k, t, s] = min(max(63 + round(4.0 * math.log2(th[t, s] / top)), 1), 63)
                    w[s] = _WEIGHTS[codes[k, t, s]]
                _normalize(w, freqs[k, t])
        if defaults[k] and not (exact_gap_map and k == _GAP):
            model[pos] = _DEFAULT_ALL
            pos += 1
        else:  # context map: first context, count, then one nibble per context (15: none)
            first = ctxs[k, 0]
            count = ctxs[k, nctx[k] - 1] - first + 1
            model[pos] = _DEFAULT_MAPPED if defaults[k] else ntabs[k]
            pos = _put_varint(model, pos + 1, first)
            pos = _put_varint(model, pos, count)
            for j in range(0, count, 2):
                lo = maps[k, first + j]
                hi = maps[k, first + j + 1] if j + 1 < count else _NONE
                model[pos] = (lo & 15) | ((hi & 15) << 4)
                pos += 1
        for t in range(ntabs[k]):
            last = 0
            for s in range(1, ntok):
                cums[k, t, s] = cums[k, t, s - 1] + freqs[k, t, s - 1]
                if freqs[k, t, s] > 0:
                    last = s
            if defaults[k]:
                continue
            pos = _put_varint(model, pos, last + 1)
            acc = 0
            for s in range(last + 1):  # 6-bit codes, least significant bits first
                acc |= codes[k, t, s] << (6 * (s & 3))
                if (s & 3) == 3 or s == last:
                    for _ in range(((s & 3) * 6 + 6 + 7) // 8):
                        model[pos] = acc & 255
                        pos += 1
                        acc >>= 8
                    acc = 0
    return model[:pos], freqs, cums, raw_bits


@njit(**_JIT)
def _encode_stream(kind: np.ndarray, ctx: np.ndarray, val: np.ndarray, tok: np.ndarray, maps: np.ndarray,
                   freqs: np.ndarray, cums: np.ndarray, buf: np.ndarray) -> int:
    """rANS-encode all ops in reverse into the end of buf (division by reciprocal); returns the stream start."""
    # per (kind, table, symbol): x_max, reciprocal, shift, bias, complement (the classic byte-rANS encoder)
    xmax = np.empty(freqs.shape, np.uint64)
    rcp = np.empty(freqs.shape, np.uint64)
    rsh = np.empty(freqs.shape, np.uint64)
    bias = np.empty(freqs.shape, np.uint64)
    for k in range(2):
        for t in range(freqs.shape[1]):
            for s in range(freqs.shape[2]):
                f = freqs[k, t, s]
                if f == 0:
                    continue
                xmax[k, t, s] = ((_RANS_L >> _PROB_BITS) << 8) * f
                if f < 2:
                    rcp[k, t, s] = 0xFFFFFFFF
                    rsh[k, t, s] = 0
                    bias[k, t, s] = cums[k, t, s] + _PROB_SCALE - 1
                else:
                    sh = 0
                    while f > (1 << sh):
                        sh += 1
                    rcp[k, t, s] = ((1 << (sh + 31)) + f - 1) // f
                    rsh[k, t, s] = sh - 1
                    bias[k, t, s] = cums[k, t, s]
    x = np.uint64(_RANS_L)
    pos = buf.size
    for i in range(val.size - 1, -1, -1):
        v = val[i]
        s = int(tok[i])
        nb = _token_bits(s)
        if nb > 0:  # raw bits, highest chunk first (the decoder reads the lowest first)
            for ci in range((nb - 1) // 16, -1, -1):
                b = min(16, nb - 16 * ci)
                x, pos = _renorm_out(x, buf, pos, np.uint64(1 << (31 - b)))
                x = (x << np.uint64(b)) | ((v >> np.uint64(16 * ci)) & np.uint64((1 << b) - 1))
        k = kind[i]
        t = maps[k, ctx[i]]
        x, pos = _renorm_out(x, buf, pos, xmax[k, t, s])
        q = ((x * rcp[k, t, s]) >> np.uint64(32)) >> rsh[k, t, s]
        x = x + bias[k, t, s] + q * np.uint64(_PROB_SCALE - freqs[k, t, s])
    for _ in range(4):
        pos -= 1
        buf[pos] = np.uint8(x >> np.uint64(24))
        x = (x << np.uint64(8)) & np.uint64(0xFFFFFFFF)
    return pos


# ------------------------------------------------------------------------------------------- ops of each mode
@njit(**_JIT)
def _ops_sparse(idx: np.ndarray, old: np.ndarray, new: np.ndarray, bits: int, shift: int, kind: np.ndarray,
                ctx: np.ndarray, val: np.ndarray) -> int:
    """Sparse mode, per change: the gap over all elements (context: previous gap), then the value (context:
    the parent's class). Returns -1, or the first j whose old and new values are equal (not a change)."""
    prev = -1
    pctx = 0
    for j in range(idx.size):
        if old[j] == new[j]:
            return j
        g = np.uint64(idx[j] - prev - 1)
        prev = idx[j]
        kind[2 * j] = _GAP
        ctx[2 * j] = pctx
        val[2 * j] = g
        pctx = _gap_ctx(g)
        o = np.uint64(old[j])
        kind[2 * j + 1] = _VAL
        ctx[2 * j + 1] = _class_of(o, shift)
        val[2 * j + 1] = _zigzag(o, np.uint64(new[j]), bits) - np.uint64(1)
    return -1


@njit(**_JIT)
def _class_pass(a: np.ndarray, b: np.ndarray, shift: int, bits: int, start: int, h: np.ndarray, rank: np.ndarray,
                cls: np.ndarray, zv: np.ndarray, first: np.ndarray) -> tuple[int, int]:
    """The one pass of class mode over the dense chunks, resumable: per change (at most rank.size) its rank
    within its class, its class and its zigzag delta - 1, plus the positions of the first first.size changes.
    h holds the class counts so far, as four interleaved histograms that break the store-to-load chain of runs
    of same-class elements. Returns (element to resume at, changes written)."""
    j = 0
    sh = np.uint64(shift)
    for i in range(start, a.size):
        x = a[i]
        c = int((np.uint64(x) >> sh) & np.uint64(0xFF))
        if x != b[i]:
            if j == rank.size:
                return i, j
            rank[j] = h[0, c] + h[1, c] + h[2, c] + h[3, c]
            cls[j] = c
            zv[j] = _zigzag(np.uint64(x), np.uint64(b[i]), bits) - np.uint64(1)
            if j < first.size:
                first[j] = i
            j += 1
        h[i & 3, c] += 1
    return a.size, j


@njit(**_JIT)
def _ops_class(rank: np.ndarray, cls: np.ndarray, zv: np.ndarray, ncls: np.ndarray, kind: np.ndarray,
               ctx: np.ndarray, val: np.ndarray) -> int:
    """Class-mode ops: the first gap of each changing class (ascending class), then per change its value and
    the gap to its class's next change (the last one runs to the end of the class). The per-change ops go from
    offset 256, the first gaps just before them; returns the offset of the first op."""
    nxt = np.empty(256, np.int64)
    for c in range(256):
        nxt[c] = ncls[c]
    for j in range(rank.size - 1, -1, -1):
        c = cls[j]
        m = 256 + 2 * j
        kind[m] = _VAL
        ctx[m] = c
        val[m] = zv[j]
        kind[m + 1] = _GAP
        ctx[m + 1] = c
        val[m + 1] = np.uint64(nxt[c] - rank[j] - 1)
        nxt[c] = rank[j]
    m = 256
    for c in range(255, -1, -1):
        if nxt[c] != ncls[c]:
            m -= 1
            kind[m] = _GAP
            ctx[m] = c
            val[m] = np.uint64(nxt[c])
    return m


# ---------------------------------------------------------------------------------------------------- decoding
