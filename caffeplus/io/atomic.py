"""Write files so that an interrupted write never replaces a good file.

The data goes to a temporary file beside the target, is flushed and synced,
then renamed over the target (rename is atomic on POSIX file systems).
"""
import contextlib
import os
import signal
import tempfile
import threading


def _umask_mode():
    """0666 less the process umask: what open() would have given the file
    (mkstemp creates 0600, which would hide snapshots from other users)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ('SIGTERM', 'SIGINT', 'SIGHUP')
                      if hasattr(signal, name))


@contextlib.contextmanager
def _signals_held():
    """Hold back the stop signals (delivered when the block ends)."""
    mask = getattr(signal, 'pthread_sigmask', None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield           # (handlers run in the main thread only)
        return
    old = mask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path` to write (for libraries that want
    a filename, such as h5py); on success it is synced and renamed to `path`,
    on any failure removed, leaving `path` as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        # A stop signal (mpirun's SIGTERM to a rank, Ctrl-C) raises in its
        # handler; held back while the file is made and named, it raises
        # below, where the temporary file is known and removed.
        with _signals_held():
            fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.',
                                       suffix='.tmp', dir=directory)
        os.close(fd)
        yield tmp
        with open(tmp, 'rb+') as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def atomic_write(path, mode='wb'):
    """Yield a file object; its contents replace `path` only once complete."""
    with atomic_path(path) as tmp:
        with open(tmp, mode) as f:
            yield f
