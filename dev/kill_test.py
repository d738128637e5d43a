#!/usr/bin/env python
"""kill -9 `caffeplus train` at random moments; the snapshots must stay usable.

    python dev/kill_test.py --trials 50 [--seed 1] [--format BINARYPROTO|HDF5|both] [--keep DIR]

Each trial starts `caffeplus train` on a small LeNet-like net (Dropout, a
Data layer with mirror and crop over the reference LMDBs copied to a scratch
folder) with a snapshot every iteration or two, waits until it is
training and snapshotting, sleeps a random time and sends SIGKILL. Then:

  * every .caffemodel[.h5] and .solverstate[.h5] in the snapshot folder
    parses (none is truncated: snapshots are written to a temporary file,
    synced and renamed);
  * the newest .solverstate names (learned_net) an existing weights file of
    the same iteration, and that file fits the net;
  * the newest state resumes: `caffeplus train -snapshot` runs on from it.

Trials run one after another in the same folder, so a later trial also finds
what the earlier kills left behind (temporary files included, which are
counted and reported). The exit status is 1 if a trial broke the property.

The module is also the library of tests/test_interruptions.py (the CI test
runs a few trials; this command runs many).
"""
import argparse
import glob
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
SHARED = os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))
REFERENCE = os.path.join(SHARED, 'reference')
TRAINING_DATA = os.path.join(REFERENCE, 'training', 'data')
IMAGES = os.path.join(REFERENCE, 'io', 'images')

_CONV_BODY = '''
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 8 kernel_size: 5 stride: 1
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 32 weight_filler { type: "xavier" }
    bias_filler { type: "constant" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 10 weight_filler { type: "xavier" }
    bias_filler { type: "constant" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''

DATA_NET = '''name: "SmallLeNet"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 mirror: true crop_size: 24 }
  data_param { source: "data/mnist_synth_train_lmdb" batch_size: 16 backend: LMDB } }
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 crop_size: 24 }
  data_param { source: "data/mnist_synth_test_lmdb" batch_size: 16 backend: LMDB } }
''' + _CONV_BODY

IMAGE_NET = '''name: "SmallImageNet"
layer { name: "images" type: "ImageData" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 mirror: true crop_size: 10 }
  image_data_param { source: "images/list.txt" root_folder: "images/" batch_size: 3
    shuffle: true new_height: 12 new_width: 12 } }
layer { name: "images" type: "ImageData" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 crop_size: 10 }
  image_data_param { source: "images/list.txt" root_folder: "images/" batch_size: 4
    new_height: 12 new_width: 12 } }
''' + _CONV_BODY

SOLVER = '''net: "net.prototxt"
test_iter: 2
test_interval: {test_interval}
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: {display}
max_iter: {max_iter}
snapshot: {snapshot}
snapshot_prefix: "snap/small"
snapshot_format: {fmt}
solver_mode: CPU
random_seed: 1701
'''


def make_workdir(path, variant='data'):
    """A folder with net.prototxt, data/ (copies of the reference LMDBs) or
    images/ (the reference PNGs and list), and snap/."""
    os.makedirs(path, exist_ok=True)
    if variant == 'data':
        os.makedirs(os.path.join(path, 'data'), exist_ok=True)
        for name in ('mnist_synth_train_lmdb', 'mnist_synth_test_lmdb'):
            dst = os.path.join(path, 'data', name)
            if not os.path.exists(dst):
                shutil.copytree(os.path.join(TRAINING_DATA, name), dst)
        net = DATA_NET
    elif variant == 'images':
        dst = os.path.join(path, 'images')
        if not os.path.exists(dst):
            shutil.copytree(IMAGES, dst)
        net = IMAGE_NET
    else:
        raise ValueError(variant)
    with open(os.path.join(path, 'net.prototxt'), 'w') as f:
        f.write(net)
    os.makedirs(os.path.join(path, 'snap'), exist_ok=True)
    return path


def write_solver(workdir, name='solver.prototxt', max_iter=100000, snapshot=0, fmt='BINARYPROTO',
                 display=1, test_interval=1000, extra=''):
    text = SOLVER.format(max_iter=max_iter, snapshot=snapshot, fmt=fmt, display=display,
                         test_interval=test_interval) + extra
    path = os.path.join(workdir, name)
    with open(path, 'w') as f:
        f.write(text)
    return name


def child_env(extra=None):
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    env['OPENBLAS_NUM_THREADS'] = '1'
    env['OMP_NUM_THREADS'] = '1'
    env['MKL_NUM_THREADS'] = '1'
    env.pop('GLOG_minloglevel', None)
    if extra:
        env.update(extra)
    return env


class Train:
    """`caffeplus train` in a subprocess, its log lines read by a thread."""

    def __init__(self, workdir, *args, env=None):
        self.workdir = workdir
        self.proc = subprocess.Popen([sys.executable, '-m', 'caffeplus', 'train'] + list(args),
                                     cwd=workdir, env=child_env(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines = []
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip('\n')
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern, timeout=120):
        """The first log line (from now on) matching `pattern`."""
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError('caffeplus train ended (status %s) before %r; log tail:\n%s'
                                     % (self.proc.wait(), pattern, self.tail()))
            if rx.search(line):
                return line
        raise AssertionError('no %r within %d s; log tail:\n%s' % (pattern, timeout, self.tail()))

    def signal(self, signum):
        self.proc.send_signal(signum)

    def wait(self, timeout=120):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError('caffeplus train did not end within %d s; log tail:\n%s'
                                 % (timeout, self.tail()))
        self._thread.join(timeout=10)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def tail(self, n=25):
        return '\n'.join(self.lines[-n:])

    def log(self):
        return '\n'.join(self.lines)


# -- checking a snapshot folder --------------------------------------------------------
_ITER = re.compile(r'_iter_(\d+)\.(caffemodel|solverstate)(\.h5)?$')


def snapshot_files(snapdir):
    """{'caffemodel': {iter: path}, 'solverstate': {iter: path}, 'tmp': [paths]}."""
    out = {'caffemodel': {}, 'solverstate': {}, 'tmp': [], 'sidecar': {}}
    for path in sorted(glob.glob(os.path.join(snapdir, '*')) +
                       glob.glob(os.path.join(snapdir, '.*'))):
        name = os.path.basename(path)
        if name.endswith('.tmp'):
            out['tmp'].append(path)
            continue
        if name.endswith('.caffeplus.json'):
            m = _ITER.search(name[:-len('.caffeplus.json')])
            if m:
                out['sidecar'][int(m.group(1))] = path
            continue
        m = _ITER.search(name)
        if m:
            out[m.group(2)][int(m.group(1))] = path
    return out


def check_snapshots(snapdir, net_prototxt=None, workdir=None):
    """Problems (a list of strings; empty when all is well) with the
    snapshots in `snapdir`: every file parses, the newest state names an
    existing weights file of its iteration that fits the net."""
    from caffeplus.errors import CaffeplusError
    from caffeplus.io import prototxt, weights
    from caffeplus.solver import state as state_io
    problems = []
    files = snapshot_files(snapdir)
    net = None
    if net_prototxt is not None:
        import caffeplus
        old = os.getcwd()
        if workdir:
            os.chdir(workdir)
        try:
            from caffeplus.io.dummy import swap_data_layers
            net = caffeplus.Net(swap_data_layers(prototxt.read_net_param(net_prototxt),
                                                 batch_size=1), caffeplus.TRAIN)
        finally:
            os.chdir(old)
    for it, path in sorted(files['caffemodel'].items()):
        try:
            if path.endswith('.h5'):
                if net is not None:
                    weights.copy_from_hdf5(net, path)
                else:
                    import h5py
                    with h5py.File(path, 'r') as f:
                        list(f['data'])
            else:
                param = prototxt.read_net_param_binary(path)
                if net is not None:
                    weights.copy_from_net_param(net, param, path)
        except (CaffeplusError, OSError) as exc:
            problems.append('weights file %s does not load: %s' % (path, exc))
    states = {}
    for it, path in sorted(files['solverstate'].items()):
        try:
            states[it] = state_io.read_state(path)
        except (CaffeplusError, OSError) as exc:
            problems.append('solver state %s does not load: %s' % (path, exc))
            continue
        if states[it].iter != it:
            problems.append('solver state %s holds iteration %d' % (path, states[it].iter))
    if states:
        newest = max(states)
        st = states[newest]
        learned = st.learned_net
        if not learned:
            problems.append('the newest state %s names no weights file' % st.path)
        else:
            candidates = [learned, os.path.join(workdir or '', learned),
                          os.path.join(snapdir, os.path.basename(learned))]
            found = [c for c in candidates if os.path.exists(c)]
            if not found:
                problems.append('the newest state %s names %s, which does not exist'
                                % (st.path, learned))
            m = _ITER.search(learned)
            if not m or int(m.group(1)) != newest:
                problems.append('the newest state %s (iteration %d) names weights %s of another '
                                'iteration' % (st.path, newest, learned))
            elif newest not in files['caffemodel']:
                problems.append('no weights file of iteration %d beside the newest state'
                                % newest)
    return problems


def sidecar_note(snapdir):
    """A note when the newest state has no sidecar that matches it (a kill
    between writing the state and its sidecar): resuming from it then
    continues as stock Caffe would (data read from the start, fresh RNG),
    not bit-identically. None when it has one."""
    from caffeplus.solver import state as state_io
    path = newest_state(snapdir)
    if path is None:
        return None
    payload, reason = state_io.read_sidecar(path)
    return None if payload is not None else '%s: %s' % (os.path.basename(path), reason)


def newest_state(snapdir):
    states = snapshot_files(snapdir)['solverstate']
    return states[max(states)] if states else None


# -- one trial ---------------------------------------------------------------------------
def kill_trial(workdir, rnd, fmt='BINARYPROTO', snapshot_every=1, max_delay=1.5, solver=None):
    """Start training, SIGKILL it at a random moment once it snapshots.
    Returns (iteration reached as logged, problems)."""
    solver = solver or write_solver(workdir, 'solver_kill_%s.prototxt' % fmt.lower(),
                                    snapshot=snapshot_every, fmt=fmt)
    args = ['-solver', solver]
    resume = newest_state(os.path.join(workdir, 'snap'))
    if resume and rnd.random() < 0.5:
        args += ['-snapshot', os.path.relpath(resume, workdir)]
    t = Train(workdir, *args)
    try:
        t.wait_for(r'Snapshotting to', timeout=180)
        time.sleep(rnd.uniform(0, max_delay))
    finally:
        t.kill()
    its = [int(m.group(1)) for m in (re.search(r'Iteration (\d+)', l) for l in t.lines) if m]
    problems = check_snapshots(os.path.join(workdir, 'snap'), os.path.join(workdir, 'net.prototxt'),
                               workdir)
    return (max(its) if its else -1), problems


def resume_check(workdir, fmt='BINARYPROTO', iterations=3):
    """Resume from the newest state for a few iterations; problems or []."""
    snapdir = os.path.join(workdir, 'snap')
    state = newest_state(snapdir)
    if state is None:
        return []
    from caffeplus.solver import state as state_io
    it = state_io.read_state(state).iter
    solver = write_solver(workdir, 'solver_resume.prototxt', max_iter=it + iterations,
                          snapshot=0, fmt=fmt, extra='snapshot_after_train: false\n')
    t = Train(workdir, '-solver', solver, '-snapshot', os.path.relpath(state, workdir))
    rc = t.wait(timeout=300)
    if rc != 0:
        return ['resuming from %s failed (status %d):\n%s' % (state, rc, t.tail())]
    if 'Optimization Done.' not in t.log():
        return ['resuming from %s did not finish:\n%s' % (state, t.tail())]
    return []


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--trials', type=int, default=20)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--format', default='both', choices=('BINARYPROTO', 'HDF5', 'both'))
    parser.add_argument('--snapshot-every', type=int, default=1)
    parser.add_argument('--max-delay', type=float, default=1.5,
                        help='the kill comes up to this many seconds after the first snapshot')
    parser.add_argument('--keep', default=None, help='work in this folder and keep it')
    args = parser.parse_args(argv)
    from caffeplus import log
    log.set_level(3)   # this process only checks files; the run logs itself
    rnd = random.Random(args.seed)
    base = args.keep or tempfile.mkdtemp(prefix='caffeplus-kill-')
    formats = ['BINARYPROTO', 'HDF5'] if args.format == 'both' else [args.format]
    # One folder per format: a binary and an HDF5 snapshot of one iteration
    # would otherwise sit side by side under one prefix.
    workdirs = {fmt: make_workdir(os.path.join(base, fmt.lower())) for fmt in formats}
    failures = no_sidecar = 0
    start = time.time()
    try:
        for i in range(args.trials):
            fmt = formats[i % len(formats)]
            workdir = workdirs[fmt]
            it, problems = kill_trial(workdir, rnd, fmt, args.snapshot_every, args.max_delay)
            files = snapshot_files(os.path.join(workdir, 'snap'))
            status = 'ok' if not problems else 'BROKEN'
            print('trial %3d %-11s killed near iteration %5d: %d weights, %d states, %d temp '
                  'files: %s' % (i + 1, fmt, it, len(files['caffemodel']),
                                 len(files['solverstate']), len(files['tmp']), status), flush=True)
            for p in problems:
                print('    ' + p, flush=True)
            note = sidecar_note(os.path.join(workdir, 'snap'))
            if note:
                no_sidecar += 1
                print('    note: the newest state has no matching sidecar (%s)' % note,
                      flush=True)
            failures += bool(problems)
            if (i + 1) % 10 == 0 or i + 1 == args.trials:
                problems = resume_check(workdir, fmt)
                print('  resume from the newest state: %s' % ('ok' if not problems else
                                                              'BROKEN'), flush=True)
                for p in problems:
                    print('    ' + p, flush=True)
                failures += bool(problems)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print('\nkill_test: %d trials in %.0f s, %d broken; %d left the newest state without its '
          'sidecar' % (args.trials, time.time() - start, failures, no_sidecar))
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
