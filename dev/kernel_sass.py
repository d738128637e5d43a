#!/usr/bin/env python3
"""The machine code of caffeplus's CUDA kernels, without a GPU: each source
compiled by NVRTC as CuPy compiles it (dev/nvrtc.py), for the H200 (sm_90),
and read back with cuobjdump. Per kernel: registers a thread, instructions,
and a digest of the SASS with addresses and encodings left out.

    python3 dev/kernel_sass.py [--units kernels.nhwc16,...] [--kernels cp_bn_fwd,...]
    python3 dev/kernel_sass.py --against REV        # which kernels' code differs from REV's

With --against, the tree at REV is checked out into a temporary folder and
compiled the same way (a tree from before compile_units() with the options
dev/nvrtc.py gives it): a kernel whose SASS is the same in both runs the
same on the device, so a rewrite of the source that changes none needs no
device time to show it costs nothing, and the kernels that differ from the
last tree tested on the device are the ones a device run must check. `--show NAME` prints one kernel's SASS (with
--against, its diff against REV's).

cuobjdump comes from NVIDIA's wheel: pip install nvidia-cuda-cuobjdump.
"""
import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dev import nvrtc       # noqa: E402

_FUNCTION = re.compile(r'^\s*Function : (\w+)\s*$')
_INSTRUCTION = re.compile(r'^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;')


def _sass(tool, cubin):
    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, '-sass', f.name], capture_output=True, text=True,
                              check=True).stdout


def kernel_code(tool, cubin, log):
    """{kernel: {'sass': [instructions], 'registers'}} of a CUBIN and the
    ptxas report NVRTC logged while building it."""
    found, name = {}, None
    for line in _sass(tool, cubin).splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1)
            found[name] = {'sass': []}
            continue
        m = _INSTRUCTION.match(line)
        if m and name:
            found[name]['sass'].append(m.group(1))
    for name, registers in nvrtc.registers(log).items():
        if name in found:
            found[name]['registers'] = registers
    return found


def survey(units=None, kernels=None):
    """[(unit, kernel, record)] for the package's sources in this tree."""
    compiler = nvrtc.open_compiler()
    tool = nvrtc.nvidia_tool('cuobjdump')
    if compiler is None or tool is None:
        sys.exit('needs NVRTC, CUDA\'s headers and cuobjdump: pip install nvidia-cuda-nvrtc '
                 'nvidia-cuda-runtime nvidia-cuda-cuobjdump')
    rows = []
    for label, source, options in nvrtc.package_units():
        if units and label not in units:
            continue
        cubin, log = nvrtc.build(compiler, source, options, verbose=True)
        for name, rec in sorted(kernel_code(tool, cubin, log).items()):
            if kernels and name not in kernels:
                continue
            rec['digest'] = hashlib.sha1('\n'.join(rec['sass']).encode()).hexdigest()[:12]
            rows.append((label, name, rec))
    return rows


def _at_revision(rev, argv):
    """The survey of the tree at `rev`, run there in a process of its own."""
    folder = tempfile.mkdtemp(prefix='kernel_sass_')
    try:
        archive = subprocess.run(['git', '-C', ROOT, 'archive', rev], capture_output=True,
                                 check=True).stdout
        subprocess.run(['tar', '-x', '-C', folder], input=archive, check=True)
        # The tool and the loader of this tree, so that both sides are read alike.
        for name in ('kernel_sass.py', 'nvrtc.py'):
            shutil.copy(os.path.join(ROOT, 'dev', name), os.path.join(folder, 'dev', name))
        out = subprocess.run([sys.executable, os.path.join(folder, 'dev', 'kernel_sass.py'),
                              '--json'] + argv, capture_output=True, text=True, cwd=folder)
        if out.returncode != 0:
            sys.exit('at %s: %s' % (rev, out.stderr.strip()[-2000:]))
        return {(u, k): r for u, k, r in json.loads(out.stdout)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--units', help='compile units, separated by "," (default: all)')
    ap.add_argument('--kernels', help='kernel names, separated by "," (default: all)')
    ap.add_argument('--against', metavar='REV', help='compare each kernel with the tree at REV')
    ap.add_argument('--show', metavar='KERNEL', help='print this kernel\'s SASS')
    ap.add_argument('--json', action='store_true', help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sub = []
    for flag in ('units', 'kernels'):
        if getattr(args, flag):
            sub += ['--' + flag, getattr(args, flag)]
    units = set(args.units.split(',')) if args.units else None
    kernels = set(args.kernels.split(',')) if args.kernels else None
    rows = survey(units, kernels)
    if args.json:
        print(json.dumps(rows))
        return 0
    theirs = _at_revision(args.against, sub) if args.against else None
    if args.show:
        for label, name, rec in rows:
            if name != args.show:
                continue
            if theirs is None:
                print('// %s %s: %d registers' % (label, name, rec.get('registers', -1)))
                print('\n'.join(rec['sass']))
            else:
                old = theirs.get((label, name), {'sass': []})['sass']
                sys.stdout.writelines(difflib.unified_diff(
                    [i + '\n' for i in old], [i + '\n' for i in rec['sass']],
                    '%s %s at %s' % (label, name, args.against), '%s %s here' % (label, name)))
        return 0
    changed = 0
    for label, name, rec in rows:
        line = '%-30s %-34s %4s regs %6d instr  %s' % (label, name, rec.get('registers', '?'),
                                                       len(rec['sass']), rec['digest'])
        if theirs is not None:
            other = theirs.pop((label, name), None)
            if other is None:
                line += '  new'
                changed += 1
            elif other['digest'] != rec['digest']:
                line += '  differs (%s: %s regs %d instr)' % (args.against, other.get('registers'),
                                                              len(other['sass']))
                changed += 1
            else:
                line += '  same'
        print(line)
    if theirs is not None:
        for label, name in sorted(theirs):
            print('%-30s %-34s gone' % (label, name))
        print('%d of %d kernels differ from %s, %d gone'
              % (changed, len(rows), args.against, len(theirs)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
