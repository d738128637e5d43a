"""Static placement of buffers with known lifetimes in one arena.

Offline first fit: buffers are placed largest first (or longest-lived
first: ORDERS, the smallest arena wins); each goes at the lowest offset
where it overlaps in address no buffer it overlaps in time. The
arena's size is the highest end offset. Alignment keeps device pointers
suitable for cuDNN and vectorised kernels.

When the best order leaves the arena above the bytes live at the busiest
moment (the bound no placement beats) by more than SEARCH_GAP, a search
moves the buffers that end above that bound earlier in the order, one at
a time, and anneals: a move that places larger is kept too, with a
chance that falls with how much larger and as the search cools. A search
that only kept moves placing no worse stalled where the first moves led
it: on six of AlexNet b128's `free` layouts (H200) its chains from 16
seeds ended anywhere from the bound of 569.2 to 620 MiB, and the plan's
four chains gave 575.5 to 598 MiB from run to run; annealed, the best of
the chains reaches the bound on each of them in about a second. The moves
come from fixed seeds (independent chains, the best kept), so a plan
places the same every time.
"""
import math
import random

ALIGN = 512
# Search only when the arena exceeds the bound by more than this share.
SEARCH_GAP = 0.01
SEARCH_SEED = 1
# Chains from seeds SEARCH_SEED.., each of up to SEARCH_MOVES moves, at
# most SEARCH_WORK (offsets tried: a buffer against each buffer it meets
# in time, summed over every placement) in all: GoogLeNet and ResNet-50
# place within 0.5% of the bound by ORDERS alone, where SEARCH_WORK keeps a
# search to seconds.
SEARCH_CHAINS = 32
SEARCH_MOVES = 500
SEARCH_WORK = 16000000
# The starting temperature, a share of the bound: a move placing this much
# larger is kept with chance 1/e at first; it cools to nothing.
SEARCH_HEAT = 0.2


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
    # One sweep: at equal times a buffer starting comes before one ending
    # (a life includes both its ends).
    events = sorted([(b.start, 0, _align(b.nbytes)) for b in buffers] +
                    [(b.end, 1, _align(b.nbytes)) for b in buffers])
    live = most = 0
    for _, ends, size in events:
        if ends:
            live -= size
        else:
            live += size
            most = max(most, live)
    return most


class _Meets:
    """Which buffers meet which in time, to place an order quickly."""

    def __init__(self, bufs):
        self.sizes = [_align(b.nbytes) for b in bufs]
        by_start = sorted(range(len(bufs)), key=lambda i: bufs[i].start)
        self.meets = [[] for _ in bufs]
        for n, i in enumerate(by_start):
            for j in by_start[n + 1:]:
                if bufs[j].start > bufs[i].end:
                    break
                self.meets[i].append(j)
                self.meets[j].append(i)
        self.cost = len(bufs) + sum(len(m) for m in self.meets)

    def place(self, order):
        """(offsets by index, arena) of first fit in `order` (indices)."""
        sizes, meets = self.sizes, self.meets
        offsets = [None] * len(sizes)
        arena = 0
        for i in order:
            offset = _lowest_offset(sorted((offsets[j], offsets[j] + sizes[j])
                                           for j in meets[i] if offsets[j] is not None),
                                    sizes[i])
            offsets[i] = offset
            arena = max(arena, offset + sizes[i])
        return offsets, arena


def _search(order, done, bound):
    """The best of the annealing chains from `order` (placed as `done`),
    stopping once one reaches `bound`: (placed, offsets, arena) as
    _place_in_order gives them."""
    meets = _Meets(order)
    moves = max(SEARCH_WORK // meets.cost, 1)
    chains = max(min(SEARCH_CHAINS, moves // SEARCH_MOVES), 1)
    best_arena, best_order = done[2], None
    for chain in range(chains):
        if best_arena <= bound:
            break
        arena, indices = _anneal(meets, bound, SEARCH_SEED + chain,
                                 min(SEARCH_MOVES, moves // chains))
        if arena < best_arena:
            best_arena, best_order = arena, indices
    if best_order is None:
        return done
    return _place_in_order([order[i] for i in best_order])


def _anneal(meets, bound, seed, moves):
    """(arena, order of indices) of the best placement one chain finds."""
    n = len(meets.sizes)
    rng = random.Random(seed)
    order = list(range(n))
    offsets, arena = meets.place(order)
    best = (arena, order)
    heat = SEARCH_HEAT * bound
    for k in range(moves):
        if best[0] <= bound or n < 2:
            break
        high = [p for p, i in enumerate(order) if offsets[i] + meets.sizes[i] > bound]
        i = rng.choice(high) if high and rng.random() < 0.8 else rng.randrange(n)
        j = rng.randrange(i) if i else rng.randrange(n)
        trial = list(order)
        trial.insert(j, trial.pop(i))
        trial_offsets, trial_arena = meets.place(trial)
        worse = trial_arena - arena
        temperature = heat * (1.0 - k / float(moves)) + 1.0
        if worse <= 0 or rng.random() < math.exp(-worse / temperature):
            order, offsets, arena = trial, trial_offsets, trial_arena
            if arena < best[0]:
                best = (arena, order)
    return best


def place(buffers, last=(), search=True):
    """Return ({buffer.key: offset}, arena_bytes). Buffers of the kinds in
    `last` are placed after all others (plan auto's workspace: each call
    sized to fit the holes the others leave at its step, free_at), in the
    layout the others take. `search`: improve on the orders' best by a
    search where it is far from the bound (see the module's doc)."""
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


def place_refitted(buffers, last):
    """place(buffers, last), or every buffer placed together where that
    takes less. For buffers of the kinds in `last` sized to the holes of
    another layout (plan auto's workspace, each call fitted to the holes
    of the plan's own placement, free_at): the buffers applied to a net
    leave other holes (an offloaded map's return copy starts half a step
    early), and placed after them the calls may not fit (VGG-16 b256
    under 12 GiB: 1.6 GB over the bytes live at the busiest step)."""
    offsets, arena = place(buffers, last)
    if last and any(b.kind in last for b in buffers):
        together = place(buffers)
        if together[1] < arena:
            return together
    return offsets, arena


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
