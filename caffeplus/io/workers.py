"""Worker threads for the data layers, and how many of them to run.

Reading a batch is mostly work that releases the GIL: JPEG decoding in
libjpeg-turbo (simplejpeg), PNG and other decoding in Pillow, NumPy copies,
casts and arithmetic over whole arrays. Threads therefore run it in parallel
without the cost of processes (pickling every decoded image back); what
remains under the GIL (parsing a Datum, a few Python calls per image) is
small next to the decoding.

WorkerPool.map(fn, items) runs fn over items on the pool's threads and
returns the results in item order; the first failure in item order is raised,
so errors are the same whatever the number of workers or their timing.
Nothing random ever runs here: data layers draw every random choice in their
prefetch coordinator, so the batches do not depend on the worker count.

How many workers a data layer uses (data_workers), the first that is given:
  1. the CLI's --data_workers N (caffeplus train/test/time),
  2. the net's caffeplus_param { data_workers: N },
  3. the solver's caffeplus_param { data_workers: N },
  4. the environment variable CAFFEPLUS_DATA_WORKERS,
  5. the cores this process may run on.
caffeplus.config holds the setting and resolves it as it does every other.
"""
import contextlib
import os
import queue
import threading

ENV_VAR = 'CAFFEPLUS_DATA_WORKERS'     # (named in messages; caffeplus.config reads it)



def host_cores():
    """The number of cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_count(value, where):
    """A worker count from `where` (a flag or field name), checked."""
    from caffeplus.errors import CaffeplusError
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise CaffeplusError('%s must be a whole number of data workers (got %r)'
                             % (where, value))
    if value < 0:
        raise CaffeplusError('%s must be 0 (as many as the host has cores) or positive '
                             '(got %d)' % (where, value))
    return value


@contextlib.contextmanager
def setting(value, where='data_workers', cli=False):
    """Nets built inside use `value` data workers (None or 0: no setting here).

    A CLI setting wins over every setting inside it; otherwise the innermost
    wins (a net's own over its solver's)."""
    from caffeplus import config
    value = check_count(value, where) if value else None
    with config.given('data_workers', value, where, cli=cli):
        yield


def proto_value(caffeplus_param_owner):
    """caffeplus_param.data_workers of a NetParameter or SolverParameter (None if unset)."""
    if caffeplus_param_owner is None or not caffeplus_param_owner.HasField('caffeplus_param'):
        return None
    cp = caffeplus_param_owner.caffeplus_param
    if not cp.HasField('data_workers'):
        return None
    return check_count(cp.data_workers, 'caffeplus_param.data_workers') or None


def resolve():
    """The number of data workers for a layer set up now (see the module doc)."""
    from caffeplus import config
    return config.get('data_workers') or host_cores()


# -- the pool --------------------------------------------------------------------
class _Work:
    """One map() call: its results, its first failure, and who waits."""

    def __init__(self, count):
        self.results = [None] * count
        self.errors = {}
        self.remaining = count
        # Items after the first failed one are skipped; items before it
        # still run, so the failure raised is the first in item order.
        self.stop_after = count
        self.done = threading.Condition()

    def finish(self, index, result=None, error=None):
        with self.done:
            if error is not None:
                self.errors[index] = error
                self.stop_after = min(self.stop_after, index)
            else:
                self.results[index] = result
            self.remaining -= 1
            if self.remaining == 0:
                self.done.notify_all()

    def wait(self):
        with self.done:
            while self.remaining:
                self.done.wait()
        if self.errors:
            raise self.errors[min(self.errors)]
        return self.results


def _run_task(work, index, fn, item):
    if index > work.stop_after:
        work.finish(index, error=_Skipped())
        return
    try:
        result = fn(item)
    except BaseException as exc:  # raised again by the waiting caller
        work.finish(index, error=exc)
        return
    work.finish(index, result)


class _Skipped(Exception):
    """Not run because an earlier item failed (never raised: the earlier one is)."""


class WorkerPool:
    """`count` daemon threads that run map() calls; count 1 runs in the caller.

    Threads start at the first map() that needs them and end at close() (or
    with the process: they are daemons, so an interrupted program never waits
    for them). After close() the pool can be used again: it starts afresh.
    """

    def __init__(self, count, name='data'):
        self.count = max(1, int(count))
        self.name = name
        self._tasks = None
        self._threads = []
        self._lock = threading.Lock()

    def _start(self):
        with self._lock:
            if self._threads:
                return self._tasks
            self._tasks = queue.SimpleQueue()
            self._threads = [threading.Thread(target=self._serve, args=(self._tasks,),
                                              name='caffeplus-%s-worker-%d' % (self.name, i),
                                              daemon=True)
                             for i in range(self.count)]
            for t in self._threads:
                t.start()
            return self._tasks

    @staticmethod
    def _serve(tasks):
        while True:
            task = tasks.get()
            if task is None:
                return
            _run_task(*task)

    def map(self, fn, items):
        """[fn(item) for item in items], run on the workers, in item order."""
        items = list(items)
        if self.count == 1 or len(items) <= 1:
            return [fn(item) for item in items]
        tasks = self._start()
        work = _Work(len(items))
        for index, item in enumerate(items):
            tasks.put((work, index, fn, item))
        return work.wait()

    def map_chunked(self, fn, items):
        """map(fn, items) with each worker taking one contiguous run of the
        items: a few tasks a batch instead of one an item, so the queue's
        and the threads' hand-overs (under the GIL) cost little. The first
        failure in item order is still the one raised: runs are in item
        order, and a run stops at its first failure."""
        items = list(items)

        def run(bounds):
            lo, hi = bounds
            return [fn(item) for item in items[lo:hi]]
        return [result for part in self.map(run, self.chunks(len(items))) for result in part]

    def chunks(self, total):
        """(lo, hi) ranges that split `total` items evenly over the workers."""
        parts = max(1, min(self.count, total))
        bounds = [total * k // parts for k in range(parts + 1)]
        return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]

    def close(self):
        """Let the threads finish the work queued so far, then end them."""
        with self._lock:
            threads, tasks = self._threads, self._tasks
            self._threads, self._tasks = [], None
        for _ in threads:
            tasks.put(None)
        for t in threads:
            if t is not threading.current_thread():
                t.join()

    def owns_current_thread(self):
        """Whether the calling thread is one of this pool's workers."""
        return threading.current_thread() in self._threads

    @property
    def running(self):
        return any(t.is_alive() for t in self._threads)


# -- the CLI's --data_workers ------------------------------------------------------
def add_argument(parser):
    """--data_workers N for caffeplus train/test/time."""
    parser.add_argument('--data_workers', '--data-workers', type=int, default=None,
                        metavar='N',
                        help='worker threads each Data/ImageData layer reads and decodes '
                        'with (default: caffeplus_param.data_workers, else the environment '
                        'variable %s, else one per core: %d here); the batches are the '
                        'same whatever the number' % (ENV_VAR, host_cores()))


def cli_setting(args):
    """The context in which a command builds its nets: --data_workers wins
    over every caffeplus_param (checked: a negative count is an error)."""
    value = getattr(args, 'data_workers', None)
    if value is not None:
        check_count(value, '--data_workers')
    return setting(value, '--data_workers', cli=True)
