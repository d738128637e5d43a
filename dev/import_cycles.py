"""Import cycles among caffeplus's modules, imports inside functions included.

Parses every module of caffeplus/ and layers/ (installed as
caffeplus.layers) with `ast`, builds the graph of which module imports
which (at any depth: module level, functions, methods), and prints each
strongly connected component of more than one module, largest first.
Exit status 1 when there is one.

    python3 dev/import_cycles.py

`from package import name` counts as an import of package.name when that
is a module, else of the package; `importlib.import_module` calls are not
followed (their names are computed).
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder -> the package it is installed as (setup.py's package_dir).
PACKAGES = (('caffeplus', 'caffeplus'), ('layers', 'caffeplus.layers'))


def module_files(root=ROOT):
    """{module name: path} of every .py file of the packages."""
    out = {}
    for folder, package in PACKAGES:
        base = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != '__pycache__')
            rel = os.path.relpath(dirpath, base)
            parts = [package] + ([] if rel == '.' else rel.split(os.sep))
            for name in sorted(filenames):
                if not name.endswith('.py'):
                    continue
                stem = name[:-3]
                dotted = '.'.join(parts if stem == '__init__' else parts + [stem])
                out[dotted] = os.path.join(dirpath, name)
    return out


def _absolute(module, is_package, level, name):
    """The absolute name of a relative import `from .(level) name`."""
    if level == 0:
        return name
    base = module.split('.')
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return '.'.join(base + ([name] if name else []))


def imports_of(module, path, known):
    """The modules of `known` that `module` imports anywhere in its file."""
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == '__init__.py'
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module or '')
            for alias in node.names:
                sub = base + '.' + alias.name
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(module)
    return found


def import_graph(root=ROOT):
    files = module_files(root)
    return {m: imports_of(m, p, files) for m, p in files.items()}


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan's
    algorithm, iterative), each sorted, largest first."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def main():
    graph = import_graph()
    found = cycles(graph)
    for component in found:
        print('cycle of %d modules:' % len(component))
        for m in component:
            inside = sorted(graph[m] & set(component))
            print('  %s -> %s' % (m, ', '.join(inside)))
    if not found:
        print('no import cycles among %d modules' % len(graph))
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
