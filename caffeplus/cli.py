"""The `caffeplus` command: Caffe's tool, subcommand by subcommand.

    caffeplus train -solver s.prototxt [-weights w.caffemodel | -snapshot s.solverstate] [-gpu 0]
    caffeplus test -model m.prototxt -weights w.caffemodel -iterations 50
    caffeplus time -model m.prototxt -iterations 50
    caffeplus memory -model m.prototxt --plans stock,shared
    caffeplus device_query -gpu 0
    caffeplus upgrade IN OUT

Caffe's single-dash flags (-solver, -gpu 0,1) work as well as double-dash
ones, and, as Caffe's global flags, every command takes each of them (one it
does not use gets a warning and is ignored). Errors print one line and exit 1; --debug shows the traceback.
Each subcommand lives in caffeplus/commands/<name>.py with add_arguments(p)
and run(args) -> exit code.
"""
import argparse
import importlib
import sys

from caffeplus.errors import CaffeplusError

COMMANDS = {
    'train': 'train or finetune a model',
    'test': 'score a model',
    'time': 'benchmark model execution time',
    'memory': 'measure or estimate the memory a model needs under each plan',
    'device_query': 'show GPU diagnostic information',
    'upgrade': 'upgrade a V0/V1 net or an old solver prototxt to the current format',
    'convert_imageset': 'convert a set of images to an LMDB of Datums',
    'compute_image_mean': 'compute the mean image of a Datum database',
    'extract_features': 'extract features of a layer into a database',
    'parse_log': 'parse a Caffe/caffeplus training log into CSV files',
    'plot_training_log': 'plot a training log as PNG charts',
    'draw_net': 'draw a net diagram',
}

# Caffe's gflags names, accepted with one dash as with two.
LONG_FLAGS = {'solver', 'model', 'weights', 'snapshot', 'gpu', 'iterations', 'phase',
              'level', 'stage', 'sigint_effect', 'sighup_effect', 'debug', 'memory',
              'workspace_limit', 'memory_budget', 'plans', 'batch', 'budget', 'plot',
              'json', 'estimate', 'keep', 'offload', 'math', 'backend', 'resize_height',
              'resize_width', 'gray', 'shuffle', 'encoded', 'encode_type', 'check_size',
              'encoded_color', 'help', 'shape', 'solver_type', 'precision'}


# Caffe 1.0's `caffe` tool flags (tools/caffe.cpp). gflags are global: every
# command takes all of them and ignores those it does not use, so scripts
# pass one set of flags to train, test and time alike.
CAFFE_FLAGS = ('gpu', 'solver', 'model', 'phase', 'level', 'stage', 'snapshot', 'weights',
               'iterations', 'sigint_effect', 'sighup_effect')
UNUSED_PREFIX = 'unused_caffe_flag_'


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help with each option's default, where it has one worth saying
    (not an empty string, None or off) and its help does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ''
        default = action.default
        if not action.option_strings or 'default' in text or default is argparse.SUPPRESS \
                or default is None or default is False or default == '' or default == []:
            return text
        return text + ' (default: %(default)s)'


def accept_caffe_flags(parser):
    """Give `parser` each of Caffe's flags it does not define, to be
    warned about and ignored (warn_unused_caffe_flags)."""
    for flag in CAFFE_FLAGS:
        if '--' + flag not in parser._option_string_actions:
            parser.add_argument('--' + flag, dest=UNUSED_PREFIX + flag, default=None,
                                help=argparse.SUPPRESS)


def warn_unused_caffe_flags(args):
    for flag in CAFFE_FLAGS:
        value = getattr(args, UNUSED_PREFIX + flag, None)
        if value is not None:
            from caffeplus import log
            log.warning('Flag -%s (%s) is not used by `caffeplus %s`; ignored.',
                        flag, value, args.command)


def normalize_flags(argv):
    """Turn Caffe-style '-flag' and '-flag=value' into '--flag'."""
    out = []
    for arg in argv:
        if arg.startswith('-') and not arg.startswith('--') and len(arg) > 2:
            name = arg[1:].split('=', 1)[0]
            if name.replace('-', '_') in LONG_FLAGS:
                arg = '-' + arg
        out.append(arg)
    return out


def build_parser():
    parser = argparse.ArgumentParser(
        prog='caffeplus', description='caffeplus: Caffe-compatible training with less GPU memory')
    parser.add_argument('--version', action='store_true', help='print the version and exit')
    sub = parser.add_subparsers(dest='command', metavar='command')
    parser.command_parsers = {}
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=DefaultsHelpFormatter)
        p.add_argument('--debug', action='store_true', help='show tracebacks on errors')
        module = _command_module(name)
        if module is not None:
            module.add_arguments(p)
        accept_caffe_flags(p)
        parser.command_parsers[name] = p
    return parser


def _command_module(name):
    try:
        return importlib.import_module('caffeplus.commands.' + name)
    except ModuleNotFoundError as exc:
        if exc.name == 'caffeplus.commands.' + name:
            return None
        raise


def main(argv=None):
    argv = normalize_flags(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The command's own usage, not the top level's, says what it takes.
        parser.command_parsers.get(args.command, parser).error(
            'unrecognized arguments: %s' % ' '.join(unknown))
    if args.version:
        from caffeplus import __version__
        print('caffeplus version %s (Caffe 1.0.0 compatible)' % __version__)
        return 0
    if not args.command:
        parser.print_help()
        return 1
    warn_unused_caffe_flags(args)
    module = _command_module(args.command)
    if module is None:
        print('caffeplus %s: not available in this build' % args.command, file=sys.stderr)
        return 1
    try:
        return module.run(args) or 0
    except CaffeplusError as exc:
        if args.debug:
            raise
        print('caffeplus %s: error: %s' % (args.command, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == '__main__':
    sys.exit(main())
