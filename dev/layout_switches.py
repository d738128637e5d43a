#!/usr/bin/env python3
"""Run a script or module with the two layout switches (on by default) set
on or off, in its process and in every Python process it spawns:
layers/cudnn_conv.IMAGE_CHANNELS_LAST (a 16-bit image convolution runs
channels-last where its top stays in Caffe's order) and
layers/cudnn_pooling.ARGMAX_BETWEEN_ORDERS (a ceil-rule max pooling stores
its top in the other order than its bottom).

    python3 dev/layout_switches.py on dev/kernel_profile.py --net alexnet_b128 ...
    python3 dev/layout_switches.py off -m caffeplus memory -model NET -gpu 0 --precision fp16

(`caffeplus memory -gpu` measures each plan in a spawned process: a
sitecustomize module on PYTHONPATH sets the switches there too.)
"""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITECUSTOMIZE = '''import os
_on = os.environ.get('CAFFEPLUS_DEV_LAYOUT_SWITCHES')
if _on in ('on', 'off'):
    from caffeplus.layers import cudnn_conv, cudnn_pooling
    cudnn_conv.IMAGE_CHANNELS_LAST = _on == 'on'
    cudnn_pooling.ARGMAX_BETWEEN_ORDERS = _on == 'on'
'''


def main(argv):
    if len(argv) < 2 or argv[0] not in ('on', 'off'):
        print(__doc__, file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix='layout_switches_')
    with open(os.path.join(folder, 'sitecustomize.py'), 'w') as f:
        f.write(SITECUSTOMIZE)
    env = dict(os.environ, CAFFEPLUS_DEV_LAYOUT_SWITCHES=argv[0])
    env['PYTHONPATH'] = os.pathsep.join(p for p in (folder, ROOT, env.get('PYTHONPATH')) if p)
    os.execvpe(sys.executable, [sys.executable] + argv[1:], env)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
