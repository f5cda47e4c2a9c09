"""Readable loop-over-ranks references (numpy, fp32) for the collectives.

Every function takes a list of per-rank numpy arrays and loops over ranks explicitly; nothing here
uses fn.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------- plain collectives


def all_reduce(xs, op):
    total = xs[0].copy()
    for x in xs[1:]:
        total = total + x
    out = total / len(xs) if op == "mean" else total
    return [out.copy() for _ in xs]


def all_gather(xs):
    return [np.stack(xs) for _ in xs]


def all_to_all(xs):
    """xs[i] is [W, *chunk]; out[r][i] = xs[i][r]."""
    w = len(xs)
    return [np.stack([xs[i][r] for i in range(w)]) for r in range(w)]


def reduce_scatter(xs, op):
    w = len(xs)
    out = []
    for r in range(w):
        total = xs[0][r].copy()
        for i in range(1, w):
            total = total + xs[i][r]
        out.append(total / w if op == "mean" else total)
    return out


def split_groups(w, local):
    """(intra groups, inter groups) as lists of rank lists; rank = node * local + l."""
    nodes = w // local
    intra = [[n * local + i for i in range(local)] for n in range(nodes)]
    inter = [[n * local + i for n in range(nodes)] for i in range(local)]
    return intra, inter


def in_groups(collective, xs, groups, *args):
    """Runs ``collective`` inside every group; returns the per-rank results in rank order."""
    out = [None] * len(xs)
    for members in groups:
        results = collective([xs[r] for r in members], *args)
        for r, y in zip(members, results, strict=True):
            out[r] = y
    return out


# ----------------------------------------------------------------------------- 1-bit allreduce


def onebit_padded(n, w):
    unit = w * (w * 8 // math.gcd(w, 8))
    return -(-n // unit) * unit


def sign(v):
    return np.where(v >= 0, np.float32(1), np.float32(-1))  # -0.0 >= 0 is True


def unpack_signs(packed, count):
    return np.where(np.unpackbits(packed)[:count] == 1, np.float32(1), np.float32(-1))


def onebit_step(xs, worker_errors, server_errors):
    """One error-compensated 1-bit allreduce (docs/algorithms.md), as a loop over ranks."""
    w, n = len(xs), xs[0].size
    big_n = onebit_padded(n, w)
    chunk = big_n // w
    if n == 0:
        zeros_w = [np.zeros_like(e) for e in worker_errors]
        return [x.copy() for x in xs], zeros_w, [np.zeros_like(e) for e in server_errors]
    packed, scales, new_worker = [], [], []
    for i in range(w):
        m = np.zeros(big_n, np.float32)
        m[:n] = xs[i].reshape(-1)
        m = m + worker_errors[i]
        a = np.float32(np.linalg.norm(m) / np.sqrt(big_n))
        packed.append(np.packbits(m >= 0))  # MSB first
        scales.append(a)
        new_worker.append(m - a * sign(m))
    server_signs, server_scales, new_server = [], [], []
    for r in range(w):  # rank r is the server of chunk r
        c = np.zeros(chunk, np.float32)
        for i in range(w):
            piece = packed[i][r * chunk // 8 : (r + 1) * chunk // 8]
            c = c + unpack_signs(piece, chunk) * np.float32(scales[i] / w)
        c = c + server_errors[r]
        b = np.float32(np.linalg.norm(c) / np.sqrt(chunk))
        server_signs.append(sign(c))
        server_scales.append(b)
        new_server.append(c - b * sign(c))
    y = np.concatenate([b * s for b, s in zip(server_scales, server_signs, strict=True)])[:n]
    return [y.reshape(xs[0].shape) for _ in xs], new_worker, new_server


def hierarchical_onebit_padded(n, w, local):
    return local * onebit_padded(-(-n // local), w // local)


def hierarchical_onebit_step(xs, worker_errors, server_errors, local):
    """The hierarchical 1-bit allreduce (docs/algorithms.md): an exact mean inside each node
    (summed in rank order), the 1-bit allreduce above across nodes among the ranks of the same
    local index, and every node gathering its ranks' results."""
    w, n = len(xs), xs[0].size
    big_n = hierarchical_onebit_padded(n, w, local)
    shard = big_n // local
    padded = []
    for x in xs:
        p = np.zeros(big_n, np.float32)
        p[:n] = x.reshape(-1)
        padded.append(p)
    intra, inter = split_groups(w, local)
    means = [None] * w
    for members in intra:
        for position, r in enumerate(members):
            piece = slice(position * shard, (position + 1) * shard)
            total = padded[members[0]][piece].copy()
            for i in members[1:]:
                total = total + padded[i][piece]
            means[r] = total / np.float32(local)
    if len(inter[0]) == 1:  # one node: the exact mean, the errors untouched
        y = np.concatenate(means)[:n]
        copies = [e.copy() for e in worker_errors], [e.copy() for e in server_errors]
        return [y.reshape(xs[0].shape) for _ in xs], *copies
    results = [None] * w
    new_worker, new_server = [None] * w, [None] * w
    for members in inter:
        ys, ws, ss = onebit_step(
            [means[r] for r in members],
            [worker_errors[r] for r in members],
            [server_errors[r] for r in members],
        )
        for r, y, we, se in zip(members, ys, ws, ss, strict=True):
            results[r], new_worker[r], new_server[r] = y, we, se
    y = np.concatenate([results[r] for r in intra[0]])[:n]  # every node holds the same
    return [y.reshape(xs[0].shape) for _ in xs], new_worker, new_server


# ----------------------------------------------------------------------------- quantized allreduce


def quantized_padded(n, w, group_size):
    unit = w * group_size
    return -(-n // unit) * unit


def quantize_dequantize(v, bits, group_size):
    """DQ(Q(v)): symmetric absmax groups, round half to even, clamp to [-2^(b-1), 2^(b-1)-1]."""
    qmax = 2 ** (bits - 1)
    groups = v.reshape(-1, group_size)
    scale = (np.abs(groups).max(axis=1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(groups / safe[:, None]), -qmax, qmax - 1)
    return (q * scale[:, None]).astype(np.float32).reshape(-1)


def loco(v, error, bits, group_size, beta):
    """LoCo on one buffer: returns (DQ(Q(v + e)), e'); error None means no feedback."""
    if error is None:
        return quantize_dequantize(v, bits, group_size), None
    v = v + error
    dq = quantize_dequantize(v, bits, group_size)
    return dq, np.float32(beta) * error + np.float32(1 - beta) * (v - dq)


def quantized_reduce_scatter(xs, bits, group_size, errors=None, beta=0.0, local=None):
    """The reduce-scatter phase: {chunk index: (rank holding it, mean shard)}, new errors.

    errors: None, or per rank a list of buffers (hop 1, [hop 2,] all-gather); the returned new
    errors have the all-gather slot still None.
    """
    w, n = len(xs), xs[0].size
    big_n = quantized_padded(n, w, group_size)
    chunk = big_n // w
    hops = 1 if local is None else 2
    new = [[None] * (hops + 1) for _ in range(w)]

    def err(i, k):
        return None if errors is None else errors[i][k]

    values = []
    for i in range(w):
        v = np.zeros(big_n, np.float32)
        v[:n] = xs[i].reshape(-1)
        values.append(v)
    shard_of = {}  # global chunk index -> (rank holding it, averaged shard)
    if local is None:
        dq = []
        for i in range(w):
            d, new[i][0] = loco(values[i], err(i, 0), bits, group_size, beta)
            dq.append(d)
        for r in range(w):
            total = dq[0][r * chunk : (r + 1) * chunk]
            for i in range(1, w):
                total = total + dq[i][r * chunk : (r + 1) * chunk]
            shard_of[r] = (r, total / np.float32(w))
    else:
        nodes, piece = w // local, big_n // local
        dq1 = []
        for i in range(w):
            d, new[i][0] = loco(values[i], err(i, 0), bits, group_size, beta)
            dq1.append(d)
        node_sum = {}  # rank -> DQ(Q(its node's sum of piece `local index` + e2))
        for nd in range(nodes):
            for lc in range(local):
                ranks = [nd * local + j for j in range(local)]
                total = dq1[ranks[0]][lc * piece : (lc + 1) * piece]
                for r in ranks[1:]:
                    total = total + dq1[r][lc * piece : (lc + 1) * piece]
                i = nd * local + lc
                node_sum[i], new[i][1] = loco(total, err(i, 1), bits, group_size, beta)
        for nd in range(nodes):
            for lc in range(local):
                ranks = [m * local + lc for m in range(nodes)]
                part = slice(nd * chunk, (nd + 1) * chunk)
                total = node_sum[ranks[0]][part]
                for r in ranks[1:]:
                    total = total + node_sum[r][part]
                shard_of[lc * nodes + nd] = (nd * local + lc, total / np.float32(w))
    return shard_of, new


def quantized_allreduce(xs, bits, group_size, errors=None, beta=0.0, local=None):
    """Quantized mean allreduce, one or two hops, LoCo errors per rank per buffer.

    errors: None, or per rank a list of buffers (hop 1, [hop 2,] all-gather).
    Returns (y per rank, new errors per rank or None).
    """
    w, n = len(xs), xs[0].size
    shard_of, new = quantized_reduce_scatter(xs, bits, group_size, errors, beta, local)
    last = 1 if local is None else 2
    pieces = [None] * w
    for c, (holder, shard) in shard_of.items():
        error = None if errors is None else errors[holder][last]
        pieces[c], new[holder][last] = loco(shard, error, bits, group_size, beta)
    y = np.concatenate(pieces)[:n].reshape(xs[0].shape)
    return [y.copy() for _ in xs], (None if errors is None else new)
