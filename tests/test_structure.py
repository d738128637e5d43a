"""The package's shape: no import cycles (imports inside functions count)
and no module over MAX_LINES lines, checked on the source with `ast`."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'dev'))
import import_cycles  # noqa: E402

MAX_LINES = 1200
# Modules still over MAX_LINES, to be split; each entry must still be over
# (the list only shrinks), and no other module may be.
OVERSIZE = set()


def _line_count(path):
    with open(path, encoding='utf-8') as f:
        return sum(1 for _ in f)


def test_no_import_cycles():
    cycles = import_cycles.cycles(import_cycles.import_graph())
    assert cycles == []


def test_the_check_finds_cycles_through_imports_inside_functions(tmp_path):
    pkg = tmp_path / 'caffeplus'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    (pkg / 'low.py').write_text('def f():\n    from caffeplus import high\n    return high\n')
    (pkg / 'high.py').write_text('from caffeplus.low import f\n')
    (pkg / 'apart.py').write_text('import caffeplus.high\n')
    (tmp_path / 'layers').mkdir()
    (tmp_path / 'layers' / '__init__.py').write_text('from . import conv\n')
    (tmp_path / 'layers' / 'conv.py').write_text(
        'def g():\n    from caffeplus.layers import pool\n')
    (tmp_path / 'layers' / 'pool.py').write_text('from .conv import g\n')
    graph = import_cycles.import_graph(str(tmp_path))
    assert graph['caffeplus.apart'] == {'caffeplus.high'}
    assert import_cycles.cycles(graph) == [['caffeplus.high', 'caffeplus.low'],
                                           ['caffeplus.layers.conv', 'caffeplus.layers.pool']]


@pytest.mark.parametrize('folder', ['caffeplus', 'layers'])
def test_no_module_over_max_lines(folder):
    over = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d != '__pycache__']
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith('.py') and _line_count(path) > MAX_LINES:
                over.add(os.path.relpath(path, ROOT).replace(os.sep, '/'))
    expected = {p for p in OVERSIZE if p.startswith(folder + '/')}
    assert over == expected


def _top_level_layers_imports(path):
    import ast
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
        for name in names:
            if name == 'layers' or (name or '').startswith('layers.'):
                yield node.lineno, name


def test_code_imports_the_layers_as_caffeplus_layers():
    """`layers/` is installed as caffeplus.layers; importing it as the
    top-level `layers` too makes a second copy of each module, whose classes
    register again and replace the package's for every later net."""
    found = []
    for folder in ('caffeplus', 'layers', 'tests', 'tools', 'benchmarks', 'dev'):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != '__pycache__']
            for name in filenames:
                if name.endswith('.py'):
                    path = os.path.join(dirpath, name)
                    found += [(os.path.relpath(path, ROOT), line, module)
                              for line, module in _top_level_layers_imports(path)]
    assert found == []


def test_the_layers_import_check_sees_both_forms(tmp_path):
    path = tmp_path / 'm.py'
    path.write_text('import layers.data\nfrom layers import fused_chain\n'
                    'from caffeplus.layers import data\nfrom . import layers\n')
    assert list(_top_level_layers_imports(str(path))) == [(1, 'layers.data'), (2, 'layers')]
