#!/usr/bin/env python3
"""Run a script or module with the layout switches set, in its process and
in every Python process it spawns:

  image    layers/cudnn_conv.IMAGE_CHANNELS_LAST (on by default): a 16-bit
           image convolution runs channels-last where its top stays in
           Caffe's order;
  argmax   layers/cudnn_pooling.ARGMAX_BETWEEN_ORDERS (on by default): a
           ceil-rule max pooling stores its top in the other order than its
           bottom;
  lrn      layers/cudnn_lrn.CHANNELS_LAST (off by default): a 16-bit LRN
           reads and writes channels-last maps on caffeplus's kernels;
  grouped  layers/cudnn_conv.GROUPED_CHANNELS_LAST (off by default): a
           grouped 16-bit convolution runs channels-last.

SPEC: `on` (all four), `off` (all four), `default` (as the code has them),
or a comma list such as `lrn=on,grouped=on` (the rest as the code has them).

    python3 dev/layout_switches.py on dev/kernel_profile.py --net alexnet_b128 ...
    python3 dev/layout_switches.py off -m caffeplus memory -model NET -gpu 0 --precision fp16

(`caffeplus memory -gpu` measures each plan in a spawned process: a
sitecustomize module on PYTHONPATH sets the switches there too.)
"""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (module in caffeplus.layers, attribute)
SWITCHES = {'image': ('cudnn_conv', 'IMAGE_CHANNELS_LAST'),
            'argmax': ('cudnn_pooling', 'ARGMAX_BETWEEN_ORDERS'),
            'lrn': ('cudnn_lrn', 'CHANNELS_LAST'),
            'grouped': ('cudnn_conv', 'GROUPED_CHANNELS_LAST')}
SITECUSTOMIZE = '''import importlib, os
for _item in filter(None, os.environ.get('CAFFEPLUS_DEV_LAYOUT_SWITCHES', '').split(',')):
    _module, _name, _value = _item.split(':')
    setattr(importlib.import_module('caffeplus.layers.' + _module), _name, _value == 'on')
'''


def parse(spec):
    """{switch: 'on' or 'off'} of a SPEC (see above); ValueError if unknown."""
    if spec in ('on', 'off'):
        return {name: spec for name in SWITCHES}
    if spec == 'default':
        return {}
    out = {}
    for item in spec.split(','):
        name, _, value = item.partition('=')
        if name not in SWITCHES or value not in ('on', 'off'):
            raise ValueError('unknown switch setting %r (switches: %s; values on, off)'
                             % (item, ', '.join(SWITCHES)))
        out[name] = value
    return out


def main(argv):
    try:
        settings = parse(argv[0]) if len(argv) >= 2 else None
    except ValueError as exc:
        print('layout_switches.py: %s' % exc, file=sys.stderr)
        return 2
    if settings is None:
        print(__doc__, file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix='layout_switches_')
    with open(os.path.join(folder, 'sitecustomize.py'), 'w') as f:
        f.write(SITECUSTOMIZE)
    env = dict(os.environ, CAFFEPLUS_DEV_LAYOUT_SWITCHES=','.join(
        '%s:%s:%s' % (SWITCHES[name] + (value,)) for name, value in sorted(settings.items())))
    env['PYTHONPATH'] = os.pathsep.join(p for p in (folder, ROOT, env.get('PYTHONPATH')) if p)
    os.execvpe(sys.executable, [sys.executable] + argv[1:], env)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
