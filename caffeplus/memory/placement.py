"""Static placement of buffers with known lifetimes in one arena.

Offline first fit: buffers are placed largest first (or longest-lived
first: ORDERS, the smallest arena wins); each goes at the lowest offset
where it overlaps in address no buffer it overlaps in time. The
arena's size is the highest end offset. Alignment keeps device pointers
suitable for cuDNN and vectorised kernels.

When the best order leaves the arena above the bytes live at the busiest
moment (the bound no placement beats) by more than SEARCH_GAP, a short
local search moves the buffers that end above that bound earlier in the
order, one at a time, and keeps every order that places no worse: AlexNet
b128's `free` plan went from 718.9 to 638.3 MiB against a bound of 635.8.
The moves come from fixed seeds (a few independent chains, the best
kept), so a plan places the same every time.
"""
import random

ALIGN = 512
# Search only when the arena exceeds the bound by more than this share, and
# at most SEARCH_WORK buffer placements (moves x buffers) per search: nets
# of hundreds of buffers (GoogLeNet, ResNet-50) place within 0.5% of the
# bound by ORDERS alone, where a search would cost seconds.
SEARCH_GAP = 0.01
SEARCH_WORK = 80000
SEARCH_SEED = 1
# Independent chains from seeds SEARCH_SEED.. (SEARCH_WORK shared between
# them): one chain can stall in a layout none of its moves improves
# (AlexNet's `free` with fc8's gradient placed: 604.5 MiB from seed 1, the
# bound of 569.2 from seeds 2 and 3).
SEARCH_CHAINS = 4


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


def live_bound(buffers):
    """The most aligned bytes live at one time: no placement's arena is smaller."""
    events = sorted({b.start for b in buffers})
    return max([sum(_align(b.nbytes) for b in buffers if b.start <= t <= b.end)
                for t in events] + [0])


def _search(order, done, bound):
    """The best of SEARCH_CHAINS local searches from `order` (placed as
    `done`), stopping once one reaches `bound`."""
    best = done
    for chain in range(SEARCH_CHAINS):
        if best[2] <= bound:
            break
        found = _search_chain(order, done, bound, SEARCH_SEED + chain,
                              max(SEARCH_WORK // SEARCH_CHAINS, 1))
        if found[2] < best[2]:
            best = found
    return best


def _search_chain(order, done, bound, seed, work):
    """Local search from `order` (placed as `done`): move a buffer that
    ends above `bound` to an earlier place in the order; keep the new order
    when its arena is no larger. Returns the best placement found."""
    n = len(order)
    if n < 2:
        return done
    rng = random.Random(seed)
    best = done
    for _ in range(max(work // n, 1)):
        if best[2] <= bound:
            break
        offsets = best[1]
        high = [i for i, b in enumerate(order) if offsets[b.key] + _align(b.nbytes) > bound]
        i = rng.choice(high) if high and rng.random() < 0.8 else rng.randrange(n)
        j = rng.randrange(i) if i else rng.randrange(n)
        trial = list(order)
        trial.insert(j, trial.pop(i))
        placed = _place_in_order(trial)
        if placed[2] <= best[2]:
            order, best = trial, placed
    return best


def place(buffers, last=(), search=True):
    """Return ({buffer.key: offset}, arena_bytes). Buffers of the kinds in
    `last` are placed after all others (plan auto's workspace: each call
    sized to fit the holes the others leave at its step, free_at), in the
    layout the others take. `search`: improve on the orders' best by a
    local search where it is far from the bound (see the module's doc)."""
    first = [b for b in buffers if b.kind not in last]
    rest = [b for b in buffers if b.kind in last]
    best, best_order = None, None
    for key in ORDERS:
        order = sorted(first, key=key)
        done = _place_in_order(order)
        if best is None or done[2] < best[2]:
            best, best_order = done, order
    if search and first:
        bound = live_bound(first)
        if best[2] > bound * (1 + SEARCH_GAP):
            best = _search(best_order, best, bound)
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
