"""caffeplus's settings: one table, read in one place.

Every choice a user makes beyond the prototxt files is a Setting in SETTINGS:
its name, type, default, and where it can be given. docs/configuration.md
describes each one. A setting's value comes from the first of:

  1. a command-line flag (caffeplus train/test/time/memory),
  2. the net's caffeplus_param (the innermost net being built),
  3. the solver's caffeplus_param,
  4. a value set in the program (set / using: pycaffe scripts, tests),
  5. the environment variable, read once, at the setting's first use,
  6. a command's own default (`caffeplus train -gpu` times cuDNN's algorithms),
  7. the setting's default.

Flags and caffeplus_param fields reach this module through scopes: a command
runs inside cli_scope(args), a solver builds its nets and plans inside
scope(solver_param), a net builds its layers inside scope(net_param). A
caller that holds the solver's parameters may also pass them to get().

Values are checked as they are read: a bad one is a CaffeplusError that
names where it came from (the flag, the field or the environment variable)
and what was given.
"""
import contextlib
import os
import threading

from caffeplus.errors import CaffeplusError

_OFF = ('0', 'off', 'false', 'no')
_ON = ('1', 'on', 'true', 'yes')


# -- value types ----------------------------------------------------------------------
def _switch(value):
    """A yes/no setting: 1/on/true/yes or 0/off/false/no (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError('must be 1 or 0 (on/off, true/false, yes/no)')


def _choice(*choices, aliases=None):
    """One of `choices`; `aliases` maps other spellings to a choice."""
    aliases = dict(aliases or {})

    def parse(value):
        text = str(value).strip().lower()
        text = aliases.get(text, text)
        if text not in choices:
            raise ValueError('must be one of %s' % ', '.join(choices))
        return text
    parse.choices = choices
    return parse


def _count(value):
    """A whole number, 0 or more."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ValueError('must be a whole number')
    if number < 0:
        raise ValueError('must be 0 or more')
    return number


def _path(value):
    return str(value).strip()


# 'plan' leaves the choice to each memory plan (docs/memory.md).
_PLAN_SWITCH = {'': 'plan', '0': 'off', 'false': 'off', 'no': 'off',
                '1': 'on', 'true': 'on', 'yes': 'on'}


class Setting:
    """One user setting and every place it can be given."""

    def __init__(self, name, parse, default, doc, env=None, solver_field=None,
                 net_field=None, flag=None, commands=(), unset=(None,)):
        self.name, self.parse, self.default, self.doc = name, parse, default, doc
        self.env, self.solver_field, self.net_field = env, solver_field, net_field
        self.flag, self.commands = flag, tuple(commands)
        # Values that mean "not given here" (data_workers: 0 is "one per core").
        self.unset = unset

    def check(self, value, where):
        """`value` parsed, or a CaffeplusError naming `where` and the value."""
        if value in self.unset:
            return None
        try:
            parsed = self.parse(value)
        except ValueError as exc:
            raise CaffeplusError("%s must be %s, not '%s'"
                                 % (where, str(exc)[len('must be '):], value))
        return None if parsed in self.unset else parsed


SETTINGS = {s.name: s for s in (
    Setting('cudnn_search', _choice('heuristic', 'timed', 'auto'), 'heuristic',
            "How convolutions choose their cuDNN algorithms: 'heuristic' (cuDNN's "
            "guess), 'timed' (FindEx for every net), 'auto' (timed for training nets "
            "under their own arena, as PyTorch's cudnn.benchmark). `caffeplus train`, "
            "`time` and `memory` on a GPU default to 'auto'.",
            env='CAFFEPLUS_CUDNN_SEARCH', flag='--cudnn_search',
            commands=('train', 'test', 'time', 'memory')),
    Setting('nan_check', _choice('stop', 'warn', 'off'), 'stop',
            "A NaN or Inf in the loss or a gradient: 'stop' training before the update, "
            "'warn' and go on, or 'off' (not checked).",
            env='CAFFEPLUS_NAN_CHECK', solver_field='nan_check', flag='--nan_check',
            commands=('train',)),
    Setting('update_in_backward', _switch, True,
            'Memory plans shared, offload and auto update each parameter as soon as '
            'its gradient is complete, so the large gradients share memory; 0 keeps '
            'every gradient until the update after backward.',
            env='CAFFEPLUS_UPDATE_IN_BACKWARD', solver_field='update_in_backward',
            flag='--update_in_backward', commands=('train',)),
    Setting('cuda_graphs', _switch, True,
            'On the GPU, launch each training iteration\'s forward and backward (after '
            'the data layers) as one CUDA graph once a few eager iterations have run: the '
            'same kernels, without the host time of launching them one by one. Nets it '
            'cannot replay run eagerly, and the log says why (caffeplus.pass_graph).',
            solver_field='cuda_graphs', flag='--cuda_graphs',
            commands=('train',)),
    Setting('recompute', _choice('plan', 'off', 'on', 'convs', 'split',
                                 aliases=_PLAN_SWITCH), 'plan',
            "Maps made again in backward instead of kept: 'plan' (each plan's own "
            "choice: offload and auto do), 'on' (shared too), 'off' (no plan), 'convs' "
            "(convolutions run again in every reusing plan), 'split' (convs, and their "
            "maps leave between backward uses).",
            env='CAFFEPLUS_RECOMPUTE', solver_field='recompute', flag='--recompute',
            commands=('train', 'time', 'memory')),
    Setting('masks', _choice('plan', 'off', 'on', aliases=_PLAN_SWITCH), 'plan',
            "Max-pooling and ReLU gradients from bit masks instead of kept maps: 'plan' "
            "(auto masks all it can, shared and offload only where the results stay "
            "those of stock), 'on' (every plan masks all it can), 'off' (none).",
            env='CAFFEPLUS_MASKS', solver_field='masks', flag='--masks',
            commands=('train', 'time', 'memory')),
    Setting('gemm_search', _choice('plan', 'off', 'on', aliases=_PLAN_SWITCH), 'plan',
            "Whether timed search also times im2col + cuBLAS for convolutions over few "
            "input channels (as im2row for a 16-bit image layer writing channels-last "
            "maps): 'plan' (caffeplus.cudnn.algo_search's switches, all off), 'on', "
            "'off'.",
            env='CAFFEPLUS_GEMM_SEARCH'),
    Setting('layout', _choice('nchw', 'nhwc'), 'nhwc',
            "How a 16-bit net's convolution maps are stored on the GPU: 'nhwc' "
            "(channels-last where convolutions read and write them and every layer "
            "touching them can: cuDNN's convolutions and pooling, BatchNorm and Scale, "
            "and the pointwise layers between; caffeplus.layout), 'nchw' (Caffe's "
            "order everywhere). "
            "Shapes, logs and pycaffe's views stay Caffe's.",
            flag='--layout', commands=('train', 'time', 'memory')),
    Setting('calibration', _path, '',
            "A table of measured cuDNN algorithms (JSON, written on a GPU by "
            "`tools/dump_algorithms.py --calibration FILE`) that plan auto plans with.",
            env='CAFFEPLUS_CALIBRATION', solver_field='calibration', flag='--calibration',
            commands=('train', 'memory'), unset=(None, '')),
    Setting('cudnn_library', _path, '',
            'The cuDNN library file to load, before the NVIDIA wheel\'s and the dynamic '
            "linker's search.",
            env='CAFFEPLUS_CUDNN_LIBRARY', flag='--cudnn_library',
            commands=('train', 'test', 'time', 'memory'), unset=(None, '')),
    Setting('no_python_layers', _switch, False,
            'Refuse `type: "Python"` layers (they run code the net file names): for '
            'net files you do not trust.',
            env='CAFFEPLUS_NO_PYTHON_LAYERS', flag='--no_python_layers',
            commands=('train', 'test', 'time')),
    Setting('data_workers', _count, 0,
            'Worker threads each Data/ImageData layer reads and decodes with (0: one '
            'per core); the batches are the same whatever the number.',
            env='CAFFEPLUS_DATA_WORKERS', solver_field='data_workers',
            net_field='data_workers', flag='--data_workers',
            commands=('train', 'test', 'time'), unset=(None, 0)),
)}


def setting(name):
    try:
        return SETTINGS[name]
    except KeyError:
        raise CaffeplusError("no setting named '%s' (settings: %s)"
                             % (name, ', '.join(sorted(SETTINGS))))


# -- where values are held ---------------------------------------------------------
_local = threading.local()      # .stack: [(cli, {name: (value, where)})]
_program = {}                   # set() / using(): {name: (value, where)}
_environment = {}               # read once: {name: (value, where) or None}
_command_defaults = {}          # a command's own defaults: {name: value}
_lock = threading.Lock()


def _stack():
    if not hasattr(_local, 'stack'):
        _local.stack = []
    return _local.stack


def _from_env(s):
    with _lock:
        if s.name not in _environment:
            text = os.environ.get(s.env, '') if s.env else ''
            where = 'the environment variable %s' % s.env
            value = s.check(text, where) if text.strip() else None
            _environment[s.name] = None if value is None else (value, '%s=%s' % (s.env, text))
        return _environment[s.name]


def _from_proto(param, field, kind):
    """(value, where) of caffeplus_param.`field` of a solver or net param, or None."""
    if param is None or field is None or not param.HasField('caffeplus_param'):
        return None
    cp = param.caffeplus_param
    if not cp.HasField(field):
        return None
    where = "the %s's caffeplus_param.%s" % (kind, field)
    value = SETTINGS_BY_FIELD[kind][field].check(getattr(cp, field), where)
    return None if value is None else (value, where)


SETTINGS_BY_FIELD = {
    'solver': {s.solver_field: s for s in SETTINGS.values() if s.solver_field},
    'net': {s.net_field: s for s in SETTINGS.values() if s.net_field},
}


def lookup(name, solver=None, net=None):
    """(value, where it came from) of setting `name` (see the module doc);
    `solver` / `net`: a SolverParameter / NetParameter whose caffeplus_param counts."""
    s = setting(name)
    stack = _stack()
    for cli, values in stack:
        if cli and name in values:
            return values[name]
    found = _from_proto(net, s.net_field, 'net')
    if found:
        return found
    for cli, values in reversed(stack):
        if not cli and name in values:
            return values[name]
    found = _from_proto(solver, s.solver_field, 'solver')
    if found:
        return found
    if name in _program:
        return _program[name]
    found = _from_env(s)
    if found:
        return found
    if name in _command_defaults:
        return _command_defaults[name], "the command's default"
    return s.default, 'the default'


def get(name, solver=None, net=None):
    """The value of setting `name` now (see lookup)."""
    return lookup(name, solver, net)[0]


# -- giving values ------------------------------------------------------------------
def _checked(values, where_of):
    out = {}
    for name, value in values.items():
        s = setting(name)
        where = where_of(s)
        checked = s.check(value, where)
        if checked is not None:
            out[name] = (checked, where)
    return out


@contextlib.contextmanager
def _pushed(cli, values):
    stack = _stack()
    entry = (cli, values)
    stack.append(entry)
    try:
        yield
    finally:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is entry:
                del stack[i]
                break


def given(name, value, where, cli=False):
    """Inside: setting `name` is `value` (already checked; None: not given
    here), given by `where`, as a flag (cli) or a caffeplus_param field."""
    values = {} if value in setting(name).unset else {name: (value, where)}
    return _pushed(cli, values)


def scope(param, kind):
    """Inside: the caffeplus_param of `param` (a SolverParameter, kind
    'solver', or a NetParameter, kind 'net') counts; a net's wins over its
    solver's, the innermost over the outer."""
    fields = SETTINGS_BY_FIELD[kind]
    values = {}
    for field, s in fields.items():
        found = _from_proto(param, field, kind)
        if found:
            values[s.name] = found
    return _pushed(False, values)


def cli_scope(args):
    """Inside: the command-line flags of `args` (argparse; unset flags are
    None) win over every other source."""
    values = {name: getattr(args, name) for name in SETTINGS
              if getattr(args, name, None) is not None}
    return flags_scope(values)


def flags_scope(values):
    """Inside: `values` ({name: value}) count as command-line flags."""
    return _pushed(True, _checked(values, lambda s: s.flag or s.name))


def flag_values():
    """{name: value} of the command-line flags in force (for processes a
    command starts, which do not inherit this module's state)."""
    out = {}
    for cli, values in _stack():
        if cli:
            for name, (value, _) in values.items():
                out.setdefault(name, value)
    return out


def set(name, value):  # noqa: A001 - config.set reads as the verb it is
    """Give setting `name` a value for this process (above the environment;
    None: back to the environment)."""
    if value is None:
        _program.pop(name, None)
        return
    _program.update(_checked({name: value}, lambda s: "caffeplus.config.set('%s')" % s.name))


@contextlib.contextmanager
def using(**values):
    """Inside: set(name, value) for each of `values`; restored after."""
    saved = {name: _program.get(name) for name in values}
    try:
        for name, value in values.items():
            set(name, value)
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                _program.pop(name, None)
            else:
                _program[name] = old


@contextlib.contextmanager
def command_defaults(**values):
    """Inside: a command's own defaults, below the environment (restored after)."""
    saved = dict(_command_defaults)
    try:
        for name, value in values.items():
            _command_defaults[name] = setting(name).parse(value)
        yield
    finally:
        _command_defaults.clear()
        _command_defaults.update(saved)


def set_command_default(name, value):
    """A command's own default for `name`, until its command_defaults() ends."""
    _command_defaults[name] = setting(name).parse(value)


def reload_environment():
    """Forget the environment variables read so far (tests; a process whose
    environment changed on purpose)."""
    with _lock:
        _environment.clear()


def reset():
    """Back to a fresh process: no values set in the program, no command
    defaults, the environment read again at the next use (tests)."""
    _program.clear()
    _command_defaults.clear()
    reload_environment()


# -- the CLI's flags -------------------------------------------------------------------
def add_arguments(parser, command, skip=()):
    """The flags of every setting `command` takes (but those in `skip`,
    which the command declares itself)."""
    for s in SETTINGS.values():
        if command not in s.commands or s.name in skip:
            continue
        kwargs = dict(default=None, help=_flag_help(s))
        if s.parse is _switch:
            kwargs['metavar'] = '0|1'
        elif getattr(s.parse, 'choices', None):
            kwargs['metavar'] = '|'.join(s.parse.choices)
        elif s.parse is _count:
            kwargs['metavar'] = 'N'
        else:
            kwargs['metavar'] = 'FILE'
        dashed = s.flag.replace('_', '-')
        parser.add_argument(*([s.flag, dashed] if dashed != s.flag else [s.flag]), **kwargs)


def _flag_help(s):
    more = []
    if s.solver_field:
        more.append("the solver's caffeplus_param.%s" % s.solver_field)
    if s.env:
        more.append('$%s' % s.env)
    text = s.doc.replace('%', '%%')
    return text + (' (default: %s)' % ', else '.join(more) if more else '')
