"""Every CUDA source caffeplus builds at run time compiles with NVRTC, the
compiler CuPy uses, with the options the code passes, for the H200 (sm_90),
and holds the kernels the code looks up by name.

On the GPU a module that fails to build makes its layers fall back to slower
generic code (the solver's update has no fallback at all), so a compile error
would otherwise show only as a speed loss on the device. Here it fails CI.
"""
import os
import re

import pytest

from caffeplus import kernels
from caffeplus.io import device_transform
from caffeplus.solver import gpu_kernels
from dev import nvrtc

_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(')

UNITS = nvrtc.package_units()


@pytest.fixture(scope='module')
def compiler():
    found = nvrtc.open_compiler()
    if found is None:
        pytest.skip('NVRTC or CUDA headers not found (pip install nvidia-cuda-nvrtc '
                    'nvidia-cuda-runtime, or set CUDA_PATH)')
    return found


_BUILT = {}


def _build(compiler, label, source, options):
    """(CUBIN, registers by kernel) of a unit, compiled once per run."""
    if label not in _BUILT:
        try:
            cubin, log = nvrtc.build(compiler, source, options, verbose=True)
        except nvrtc.CompileError as exc:
            pytest.fail('%s does not compile with NVRTC %d.%d:\n%s'
                        % (label, *compiler[0].version(), str(exc)[:4000]))
        _BUILT[label] = cubin, nvrtc.registers(log)
    return _BUILT[label]


@pytest.mark.parametrize('label,source,options', UNITS, ids=[u[0] for u in UNITS])
def test_each_cuda_source_compiles_with_its_kernels(compiler, label, source, options):
    cubin, _ = _build(compiler, label, source, options)
    names = _KERNEL.findall(source)
    assert names, label
    missing = [n for n in names if b'\0' + n.encode() + b'\0' not in cubin]
    assert not missing, '%s: kernels missing from the CUBIN: %s' % (label, missing)


@pytest.mark.parametrize('label,source,options', UNITS, ids=[u[0] for u in UNITS])
def test_each_kernel_launches_at_its_largest_block(compiler, label, source, options):
    """A kernel whose registers do not fit its block fails at launch on the
    device (too many resources requested), not at compile time. The
    channels-last BatchNorm vector kernels take NHWC_THREADS threads a
    block; any other may take up to 1,024 (kernels.channel_block, the bias
    sums' apply)."""
    from caffeplus.layers.fused_chain import NHWC_THREADS
    _, regs = _build(compiler, label, source, options)
    assert set(regs) == set(_KERNEL.findall(source)), label
    for name, r in regs.items():
        threads = NHWC_THREADS if name.endswith('_nhwc_vec') else 1024
        assert nvrtc.fits(r, threads), ('%s %s: %d registers a thread do not fit %d threads'
                                        % (label, name, r, threads))


def test_every_module_that_builds_cuda_source_is_checked():
    """A new RawModule or RawKernel in the package must offer compile_units()
    and be listed above, or its source would escape this check."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    building = set()
    for folder in ('caffeplus', 'layers'):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith('.py') and re.search(r'\bRaw(Module|Kernel)\(',
                                                      open(path).read()):
                    building.add(os.path.relpath(path, root))
    checked = {os.path.relpath(m.__file__, root).replace('.pyc', '.py')
               for m in (kernels, gpu_kernels, device_transform)}
    assert building == checked
    assert kernels.MAP_KERNELS <= {n for _, s, _ in UNITS for n in _KERNEL.findall(s)}
