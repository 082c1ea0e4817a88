"""Slow pure-Python references for the C++ index helpers (written from the spec in COMPAT.md 4.3)."""
import math

import numpy


class MT19937:
    """32-bit Mersenne Twister, seeded like std::mt19937(seed)."""

    def __init__(self, seed):
        self.mt = [0] * 624
        self.mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            self.mt[i] = (1812433253 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.i = 624

    def __call__(self):
        if self.i >= 624:
            for k in range(624):
                y = (self.mt[k] & 0x80000000) | (self.mt[(k + 1) % 624] & 0x7FFFFFFF)
                self.mt[k] = self.mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.i = 0
        y = self.mt[self.i]
        self.i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


class MT19937_64:
    """64-bit Mersenne Twister, seeded like std::mt19937_64(seed)."""

    M = 0xFFFFFFFFFFFFFFFF

    def __init__(self, seed):
        self.mt = [0] * 312
        self.mt[0] = seed & self.M
        for i in range(1, 312):
            self.mt[i] = (6364136223846793005 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 62)) + i) & self.M
        self.i = 312

    def __call__(self):
        if self.i >= 312:
            for k in range(312):
                y = (self.mt[k] & 0xFFFFFFFF80000000) | (self.mt[(k + 1) % 312] & 0x7FFFFFFF)
                self.mt[k] = self.mt[(k + 156) % 312] ^ (y >> 1) ^ (0xB5026F5AA96619E9 if y & 1 else 0)
            self.i = 0
        x = self.mt[self.i]
        self.i += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        return x ^ (x >> 43)


def build_sample_idx(sizes, doc_idx, seq_len, num_epochs, tokens_per_epoch, drop_last=True, extra=1):
    total = num_epochs * tokens_per_epoch - extra
    n = total // seq_len if drop_last else int(math.ceil(numpy.float32(total) / numpy.float32(seq_len)))
    rows = [(0, 0)]
    pos, off = 0, 0
    # flatten the token stream: sample i covers [i*seq_len, (i+1)*seq_len + extra)
    starts = numpy.concatenate([[0], numpy.cumsum([sizes[d] for d in doc_idx])])
    for i in range(1, n + 1):
        end = min(i * seq_len, int(starts[-1]) - extra)
        # the document holding token `end`, preferring the earlier document at a boundary
        pos = int(numpy.searchsorted(starts, end + extra, side="left")) - 1
        off = end - int(starts[pos])
        rows.append((pos, off))
    return numpy.array(rows, dtype=numpy.int64)


def build_blending_indices(weights, size):
    taken = [0] * len(weights)
    index, sample_index = [], []
    for k in range(size):
        errors = [w * max(k, 1) - t for w, t in zip(weights, taken)]
        best = errors.index(max(errors))
        index.append(best)
        sample_index.append(taken[best])
        taken[best] += 1
    return numpy.array(index), numpy.array(sample_index)


def build_exhaustive_blending_indices(sizes):
    total = sum(sizes)
    weights = [s / total for s in sizes]
    taken = [0] * len(sizes)
    index, sample_index = [], []
    for k in range(total):
        live = [d for d in range(len(sizes)) if taken[d] < sizes[d]]
        best = max(live, key=lambda d: (weights[d] * max(k, 1) - taken[d], -d))
        index.append(best)
        sample_index.append(taken[best])
        taken[best] += 1
    return numpy.array(index), numpy.array(sample_index)


def build_mapping(docs, sizes, num_epochs, max_samples, max_seq_len, short_seq_prob, seed, min_num_sent):
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0

    def target(rng):
        if ratio == 0:
            return max_seq_len
        r = rng()
        return 2 + r % (max_seq_len - 1) if r % ratio == 0 else max_seq_len

    rng = MT19937(seed)
    rows = []
    for _ in range(num_epochs):
        if len(rows) >= max_samples:
            break
        for d in range(len(docs) - 1):
            first, last = int(docs[d]), int(docs[d + 1])
            n = last - first
            if n < min_num_sent or (n > 1 and any(sizes[s] > 512 for s in range(first, last))):
                continue
            start, seq_len, num_sent, t = first, 0, 0, target(rng)
            for s in range(first, last):
                seq_len += int(sizes[s])
                num_sent += 1
                remain = last - s - 1
                if (seq_len >= t and remain > 1 and num_sent >= min_num_sent) or remain == 0:
                    rows.append([start, s + 1, t])
                    start, seq_len, num_sent, t = s + 1, 0, 0, target(rng)
    rng64 = MT19937_64(seed + 1)
    for i in range(len(rows) - 1, 0, -1):
        j = rng64() % (i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return numpy.array(rows, dtype=numpy.int64).reshape(-1, 3)
