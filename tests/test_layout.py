"""The repository's layout: what is installed, what tools/ holds, and that
the library never imports the scripts beside it."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_FOLDERS = ('tools', 'dev', 'benchmarks')
# A module name that says it investigates, profiles or stresses rather than serves users.
DEVELOPER_NAME = re.compile(r'(probe|profile|trace|bench|fuzz|soak|kill_test|emu|census)')


def _setup_kwargs():
    """The arguments setup.py gives setuptools.setup, read without running it."""
    tree = ast.parse(open(os.path.join(ROOT, 'setup.py')).read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, 'id', None) == 'setup']
    assert len(calls) == 1
    return {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords
            if k.arg in ('packages', 'package_dir')}


def _installed_folders():
    """{package: the folder setup.py installs it from}."""
    kw = _setup_kwargs()
    mapping = kw.get('package_dir', {})
    folders = {}
    for package in kw['packages']:
        folder = mapping.get(package) or package.replace('.', os.sep)
        folders[package] = os.path.join(ROOT, folder)
    return folders


def test_the_installed_packages_hold_no_developer_script():
    folders = _installed_folders()
    for package, folder in folders.items():
        top = os.path.relpath(folder, ROOT).split(os.sep)[0]
        assert top not in SCRIPT_FOLDERS, (package, folder)
        modules = [f for f in os.listdir(folder) if f.endswith('.py')]
        assert modules, (package, folder)
        assert not [m for m in modules if DEVELOPER_NAME.search(m)], (package, modules)


def _wrapped_command(path):
    """The `caffeplus NAME` whose module a tools/ script's docstring points
    to (caffeplus/commands/NAME.py), or None."""
    doc = ast.get_docstring(ast.parse(open(path).read())) or ''
    found = re.search(r'caffeplus/commands/(\w+)\.py', doc)
    return found.group(1) if found else None


# Beside the wrappers: scripts users run that have no subcommand. The GPU shell
# scripts still in tools/ are for the developers' GPU machine (to move to dev/),
# and offload_race_probe.py is a probe to move there too.
NOT_WRAPPERS = {'__init__.py', 'dump_algorithms.py', 'offload_race_probe.py'}


def test_tools_holds_wrappers_of_caffeplus_subcommands():
    from caffeplus import cli
    commands = set(cli.COMMANDS)
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, 'tools'))
                     if f.endswith('.py') and f not in NOT_WRAPPERS)
    assert scripts
    for name in scripts:
        command = _wrapped_command(os.path.join(ROOT, 'tools', name))
        assert command == name[:-3], name
        assert command in commands, name
        text = open(os.path.join(ROOT, 'tools', name)).read()
        assert 'caffeplus.commands.%s' % command in text, name


def _imported_modules(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            for alias in node.names:            # `from tools import x` names tools.x
                yield node.module + '.' + alias.name


@pytest.mark.parametrize('top', ['caffeplus', 'layers'])
def test_the_library_imports_no_script(top):
    offenders = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
        dirnames[:] = [d for d in dirnames if d != '__pycache__']
        for name in filenames:
            if name.endswith('.py'):
                path = os.path.join(dirpath, name)
                for module in _imported_modules(path):
                    if module.split('.')[0] in SCRIPT_FOLDERS:
                        offenders.append((os.path.relpath(path, ROOT), module))
    assert offenders == []


def test_scripts_import_their_neighbours_by_their_new_folders():
    """A script moved out of tools/ must not still import tools.<itself or a
    neighbour that moved with it>."""
    moved = {f[:-3] for folder in ('dev', 'benchmarks')
             for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith('.py')}
    offenders = []
    for folder in SCRIPT_FOLDERS + ('tests',):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith('.py'):
                path = os.path.join(ROOT, folder, name)
                for module in _imported_modules(path):
                    parts = module.split('.')
                    if parts[0] == 'tools' and len(parts) > 1 and parts[1] in moved:
                        offenders.append((folder + '/' + name, module))
    assert offenders == []
