"""Caffe's prefetch queue for the data layers: one thread loads batches
ahead of the net (BasePrefetchingDataLayer), a source's `load_batch()`
each, handing failures to the consumer and closing what the loading reads
only once no batch is loading."""
import queue
import threading

from caffeplus.errors import CaffeplusError


class Batch:
    """A loaded batch: tops, the source's state after it, and how long the
    coordinator spent reading/decoding (read_s) and transforming it."""
    __slots__ = ('data', 'label', 'state', 'read_s', 'transform_s')

    def __init__(self, data, label, state, read_s=0.0, transform_s=0.0):
        self.data, self.label, self.state = data, label, state
        self.read_s, self.transform_s = read_s, transform_s


class _Failure:
    def __init__(self, exc):
        self.exc = exc


def _prefetch_loop(source, full, free, stop, pool, on_exit):
    # Runs in the prefetch thread: the only user of `source` while it lives.
    # on_exit: what a stop asked from inside the loading (Prefetcher.stop)
    # to run once it is over.
    try:
        while True:
            free.acquire()
            if stop.is_set():
                return
            try:
                batch = source.load_batch()
            except BaseException as exc:  # handed to the consumer, raised there
                if pool is not None:
                    pool.close()      # nothing more will be asked of the workers
                full.put(_Failure(exc))
                return
            full.put(batch)
            if stop.is_set():
                return
    finally:
        for then in on_exit:
            then()


class Prefetcher:
    """Caffe's prefetch queue: up to `count` batches loaded ahead by one thread.

    As in Caffe the batch a forward returned stays "in use" until the next
    forward, so the thread runs at most `count` batches ahead. count 0 loads
    each batch synchronously in forward.
    """

    def __init__(self, source, count, name, pool=None):
        self.source = source
        self.count = int(count)
        self.name = name
        self.pool = pool
        self._thread = None
        self._failure = None

    def start(self):
        if self.count <= 0 or self._thread is not None:
            return
        self._full = queue.Queue()
        self._free = threading.Semaphore(self.count)
        self._stop = threading.Event()
        self._on_exit = []
        self._holding = False
        self._thread = threading.Thread(
            target=_prefetch_loop,
            args=(self.source, self._full, self._free, self._stop, self.pool, self._on_exit),
            name='caffeplus-prefetch-%s' % self.name, daemon=True)
        self._thread.start()

    def next(self):
        if self._failure is not None:
            raise self._failure
        if self.count <= 0:
            return self.source.load_batch()
        if self._thread is None:
            self.start()
        if self._holding:
            self._free.release()
            self._holding = False
        while True:
            try:
                item = self._full.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._full.empty():
                    raise CaffeplusError('layer %s: the data prefetch thread stopped'
                                         % self.name)
        self._holding = True
        if isinstance(item, _Failure):
            self._failure = item.exc
            raise item.exc
        return item

    def stop(self, then=None):
        """Stop the thread and drop the batches it loaded ahead; then call
        `then` (closing what the loading reads) once no batch is loading."""
        thread = self._thread
        if thread is None:
            if then is not None:
                then()
            return
        self._stop.set()
        self._free.release()
        # The layer's finalizer can run in any thread the collector runs in:
        # the prefetch thread itself, or a worker decoding for it, which the
        # prefetch thread waits for. Neither can wait for the batch in hand,
        # and the records it decodes are views of the open database: the
        # thread calls `then` itself as it ends.
        loading = thread is threading.current_thread() or (
            self.pool is not None and self.pool.owns_current_thread())
        if loading and thread.is_alive():
            if then is not None:
                self._on_exit.append(then)
        else:
            thread.join()
            if then is not None:
                then()
        self._thread = None
        self._failure = None
