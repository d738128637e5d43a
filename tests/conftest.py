import contextlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The stock-Caffe reference outputs, the zoo's prototxts and the bench nets
# ship with the tests (tests/data/reference/README.md says what made them);
# CAFFEPLUS_SHARED points the tests at another copy.
SHARED = os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))
REFERENCE = os.path.join(SHARED, 'reference')
ZOO = os.path.join(SHARED, 'zoo')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs a CUDA GPU with CuPy (skipped without one)')
    config.addinivalue_line('markers', 'slow: takes more than a few seconds')


def _have_gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason='no CUDA GPU with CuPy on this machine')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_mode_and_seed():
    import caffeplus
    from caffeplus import config
    from caffeplus.backend import mathmode
    caffeplus.set_mode_cpu()
    caffeplus.set_random_seed(1701)
    mode = mathmode.math_mode()
    # caffeplus.config reads the environment once: each test reads its own,
    # and what a test set there (config.set) ends with it.
    config.reset()
    yield
    config.reset()
    # GPU tests train with deterministic math (a global setting): it must
    # not reach the tests after them (a workspace test once found it set).
    if mathmode.math_mode() != mode:
        mathmode.set_math_mode(mode)


@pytest.fixture
def caplog_caffeplus():
    """The messages caffeplus logs while the test runs."""
    import logging
    from caffeplus import log

    messages = []

    class Grab(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    h = Grab()
    log.logger.addHandler(h)
    old = log.logger.level
    log.logger.setLevel(logging.INFO)
    yield messages
    log.logger.removeHandler(h)
    log.logger.setLevel(old)


def need(path):
    """`path`, which the tests' own data holds: missing, the test fails
    (a silent skip would hide a broken checkout)."""
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return path


# -- the fused GPU kernels emulated on the host (dev/kernel_emu.py) ----------------
# The emulator's compiled kernels go to this session's own temporary folder
# (pytest's, under its retention rules), not a cache left in the system's.
_EMULATOR_CACHE = []


@pytest.fixture(scope='session', autouse=True)
def _emulator_cache(tmp_path_factory):
    _EMULATOR_CACHE.append(str(tmp_path_factory.mktemp('kernel_emu')))
    yield
    _EMULATOR_CACHE.pop()


def build_emulator(source=None):
    """dev.kernel_emu.Emulator of the kernels' source (or `source`); the
    test fails on a compile error and is skipped without g++ 20."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from dev.kernel_emu import Emulator
    try:
        emu = Emulator.build(source=source,
                             cache_dir=_EMULATOR_CACHE[-1] if _EMULATOR_CACHE else None)
    except RuntimeError as exc:          # a compile error in the kernels' source
        pytest.fail(str(exc))
    if emu is None:
        pytest.skip('no g++ with C++20 to emulate the kernels')
    return emu


@contextlib.contextmanager
def one_blas_thread():
    """One BLAS thread, as the stock-Caffe reference runs: on a busy 2-core
    machine OpenBLAS's spinning threads make LeNet several times slower."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api='blas'):
        yield


@contextlib.contextmanager
def emulating(emu):
    """The kernels on the host, NumPy arrays standing in for device arrays;
    no fused path may fall back meanwhile."""
    from caffeplus import kernels
    previous = kernels.set_emulator(emu)
    kernels.reset_kernels()
    was = kernels.set_enabled(True)
    before = len(kernels.failures())
    yield emu
    kernels.set_emulator(previous)
    kernels.reset_kernels()
    kernels.set_enabled(was)
    assert kernels.failures()[before:] == []


@pytest.fixture(scope='session')
def emulator():
    return build_emulator()


@pytest.fixture
def emulated(emulator):
    with emulating(emulator) as emu:
        yield emu


@pytest.fixture
def gpu():
    """GPU mode for the test (the CuPy module handed in); CPU mode after,
    once the device has finished."""
    import cupy
    import caffeplus
    caffeplus.set_mode_gpu()
    yield cupy
    cupy.cuda.Device().synchronize()
    caffeplus.set_mode_cpu()
