"""What an applied plan tracks of each planned storage (caffeplus.memory.
apply.AppliedPlan): the steps a pass touches it at, its device lives and
views, its entry (kind, names, blobs, producer, offload state)."""


ANY = 'any'


class _OverLimit(Exception):
    """A layout larger than the arena may be (AppliedPlan.adopt_lookahead),
    found before the arena is taken."""


def storage_uses(net, training=True):
    """{id(storage): set of steps} at which a pass reads or writes it (the
    touches caffeplus.memory.liveness derives intervals from)."""
    L = len(net.layers)
    uses = {}

    def touch(storage, step):
        uses.setdefault(id(storage), set()).add(step)

    for i, layer in enumerate(net.layers):
        reads = layer.backward_reads
        back = training and net.layer_need_backward[i]
        b = 2 * L - 1 - i
        for blob in net.bottom_vecs[i]:
            touch(blob.data_storage, i)
            if back and 'bottom_data' in reads:
                touch(blob.data_storage, b)
        for blob in net.top_vecs[i]:
            touch(blob.data_storage, i)
            if back and 'top_data' in reads:
                touch(blob.data_storage, b)
        if back:
            for blob in net.top_vecs[i]:
                touch(blob.diff_storage, b)
            for blob, prop in zip(net.bottom_vecs[i], net.bottom_need_backward[i]):
                if prop:
                    touch(blob.diff_storage, b)
    return uses


class _Life:
    """One device life of a planned Storage: steps start..end, a view at offset."""
    __slots__ = ('buf', 'start', 'end', 'offset', 'view')

    def __init__(self, buf):
        self.buf, self.start, self.end = buf, buf.start, buf.end
        self.offset = None
        self.view = None


class _Entry:
    """A planned Storage: its blobs, its lives, whether it stays outside the arena."""
    __slots__ = ('storage', 'kind', 'names', 'blobs', 'lives', 'persistent', 'offloaded',
                 'reasons', 'uses', 'valid', 'stale', 'producer', 'overwritten_at')

    def __init__(self, storage, kind, names, blobs):
        self.storage, self.kind, self.names, self.blobs = storage, kind, names, blobs
        self.lives = []
        self.persistent = False
        self.offloaded = False
        self.producer = None        # a map made again in backward: its layers (recompute)
        # A top diff that shares its life with its layer's bottom diff
        # (liveness.diff_overlays): the backward step that writes over it.
        self.overwritten_at = None
        self.reasons = {}
        self.uses = ()
        # The life whose values the storage holds now: ANY right after the
        # plan is applied (nothing computed yet, as stock), None: released.
        self.valid = ANY
        self.stale = None

    def live_at(self, t):
        for life in self.lives:
            if life.start <= t <= life.end:
                return life
        return None

    def capacity(self):
        return min(life.view.size for life in self.lives if life.view is not None)

    def needed(self):
        return max(b.count for b in self.blobs)

    @property
    def name(self):
        return self.names[0]
