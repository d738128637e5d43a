"""Static placement of buffers with known lifetimes in one arena.

Offline best fit: buffers are placed largest first; each goes at the lowest
offset where it overlaps in address no buffer it overlaps in time. The
arena's size is the highest end offset. Alignment keeps device pointers
suitable for cuDNN and vectorised kernels.
"""
ALIGN = 512


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def place(buffers, last=()):
    """Return ({buffer.key: offset}, arena_bytes). Buffers of the kinds in
    `last` are placed after all others (plan auto's workspace: each call
    sized to fit the holes the others leave at its step, free_at)."""
    order = sorted(buffers, key=lambda b: (b.kind in last, -b.nbytes, b.start, b.key))
    placed = []          # (start, end, offset, size)
    offsets = {}
    arena = 0
    for b in order:
        size = _align(b.nbytes)
        conflicts = sorted((off, off + sz) for (s, e, off, sz) in placed
                           if not (e < b.start or b.end < s))
        offset = 0
        for lo, hi in conflicts:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        placed.append((b.start, b.end, offset, size))
        offsets[b.key] = offset
        arena = max(arena, offset + size)
    return offsets, arena


def free_at(buffers, offsets, t, limit, taken=()):
    """The largest run of bytes below `limit` that no buffer live at time
    `t` (placed at `offsets`) nor any (offset, size) of `taken` occupies:
    what a buffer placed there then, after them, can have without raising
    the arena past `limit`."""
    used = sorted([(offsets[b.key], offsets[b.key] + _align(b.nbytes)) for b in buffers
                   if b.start <= t <= b.end] + [(o, o + _align(n)) for o, n in taken])
    best, at = 0, 0
    for lo, hi in used + [(limit, limit)]:
        if lo > at:
            best = max(best, min(lo, limit) - at)
        at = max(at, hi)
    return max(best, 0)


def lowest_fit(buffers, offsets, t, nbytes, taken=()):
    """The offset place() would give a buffer of `nbytes` live at `t` only."""
    used = sorted([(offsets[b.key], offsets[b.key] + _align(b.nbytes)) for b in buffers
                   if b.start <= t <= b.end] + [(o, o + _align(n)) for o, n in taken])
    offset = 0
    for lo, hi in used:
        if offset + _align(nbytes) <= lo:
            break
        offset = max(offset, hi)
    return offset


def validate(buffers, offsets):
    """Raise AssertionError if two buffers live at once share bytes."""
    items = [(b, offsets[b.key], offsets[b.key] + _align(b.nbytes)) for b in buffers]
    for i, (a, a0, a1) in enumerate(items):
        for b, b0, b1 in items[i + 1:]:
            if a.end < b.start or b.end < a.start:
                continue
            if a0 < b1 and b0 < a1:
                raise AssertionError('buffers %s and %s overlap in time and address'
                                     % (a.key, b.key))
