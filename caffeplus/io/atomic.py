"""Write files so that an interrupted write never replaces a good file.

The data goes to a temporary file beside the target, is flushed and synced,
then renamed over the target (rename is atomic on POSIX file systems).

A stop signal's handler (SIGTERM from a scheduler or mpirun, Ctrl-C) may
raise between any two bytecodes of this code: Python runs handlers in the
main thread whichever thread the signal was delivered to, so blocking the
signal here cannot hold it back. The temporary file's name is therefore
chosen before the file exists, and removing that name is always safe.
"""
import contextlib
import os
import secrets


def _temporary_name(path):
    """A fresh hidden name beside `path` (the file itself is not made)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, '.%s.%s.tmp' % (base, secrets.token_hex(8)))


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path` to write (for libraries that want
    a filename, such as h5py); on success it is synced and renamed to `path`,
    on any failure removed, leaving `path` as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        while True:
            tmp = _temporary_name(path)
            try:
                # 'x' refuses an existing file, so the name is ours; the
                # mode is what open() gives (0666 less the umask).
                with open(tmp, 'xb'):
                    break
            except FileExistsError:
                # Another file has this name (64 random bits make this
                # all but impossible): it is not ours to remove.
                tmp = None
        yield tmp
        with open(tmp, 'rb+') as f:
            os.fsync(f.fileno())
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
