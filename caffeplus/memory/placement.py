"""Static placement of buffers with known lifetimes in one arena.

Offline first fit: buffers are placed largest first (or longest-lived
first: ORDERS, the smallest arena wins); each goes at the lowest offset
where it overlaps in address no buffer it overlaps in time. The
arena's size is the highest end offset. Alignment keeps device pointers
suitable for cuDNN and vectorised kernels.
"""
ALIGN = 512


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


# Orders tried; the one giving the smallest arena wins. Equal sizes are
# common (a blob's data and diff, a map's lives before and after it is made
# again): placing the longer-lived first leaves the short ones the gaps
# (VGG-16 b2304 under plan auto: 77.1 GiB against 84.0 by start time).
ORDERS = (
    lambda b: (-b.nbytes, -(b.end - b.start), b.start, b.key),
    lambda b: (-b.nbytes, b.start, b.key),
    lambda b: (-(b.end - b.start), -b.nbytes, b.start, b.key),
)


def _lowest_offset(used, size):
    """The lowest offset where `size` bytes overlap none of `used` (sorted
    (lo, hi) ranges)."""
    offset = 0
    for lo, hi in used:
        if offset + size <= lo:
            break
        offset = max(offset, hi)
    return offset


def _place_in_order(order, placed=None):
    placed = list(placed or [])      # (start, end, offset, size)
    offsets = {}
    arena = max([off + sz for (_, _, off, sz) in placed] + [0])
    for b in order:
        size = _align(b.nbytes)
        offset = _lowest_offset(sorted((off, off + sz) for (s, e, off, sz) in placed
                                       if not (e < b.start or b.end < s)), size)
        placed.append((b.start, b.end, offset, size))
        offsets[b.key] = offset
        arena = max(arena, offset + size)
    return placed, offsets, arena


def place(buffers, last=()):
    """Return ({buffer.key: offset}, arena_bytes). Buffers of the kinds in
    `last` are placed after all others (plan auto's workspace: each call
    sized to fit the holes the others leave at its step, free_at), in the
    layout the others take."""
    first = [b for b in buffers if b.kind not in last]
    rest = [b for b in buffers if b.kind in last]
    best = None
    for key in ORDERS:
        done = _place_in_order(sorted(first, key=key))
        if best is None or done[2] < best[2]:
            best = done
    placed, offsets, _ = best
    _, more, arena = _place_in_order(sorted(rest, key=ORDERS[1]), placed)
    offsets.update(more)
    return offsets, max(arena, best[2]) if first else arena


def _used_at(buffers, offsets, t, taken):
    """Sorted (lo, hi) byte ranges of the buffers live at time `t` and of
    `taken` ((offset, size) pairs)."""
    return sorted([(offsets[b.key], offsets[b.key] + _align(b.nbytes)) for b in buffers
                   if b.start <= t <= b.end] + [(o, o + _align(n)) for o, n in taken])


def free_at(buffers, offsets, t, limit, taken=()):
    """The largest run of bytes below `limit` that no buffer live at time
    `t` (placed at `offsets`) nor any (offset, size) of `taken` occupies:
    what a buffer placed there then, after them, can have without raising
    the arena past `limit`."""
    best, at = 0, 0
    for lo, hi in _used_at(buffers, offsets, t, taken) + [(limit, limit)]:
        if lo > at:
            best = max(best, min(lo, limit) - at)
        at = max(at, hi)
    return max(best, 0)


def lowest_fit(buffers, offsets, t, nbytes, taken=()):
    """The offset place() would give a buffer of `nbytes` live at `t` only."""
    return _lowest_offset(_used_at(buffers, offsets, t, taken), _align(nbytes))


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
