"""A solver's memory plans: its caffeplus_param applied to its train and test nets."""
from caffeplus.errors import CaffeplusError
from caffeplus.memory.apply import apply_named_plan
from caffeplus.memory.plan import check_plan_name
from caffeplus.memory.plan_options import _offload_policy
from caffeplus.solver import update_in_backward
from caffeplus.solver.types import solver_type_name


def apply_solver_plans(solver, default='shared'):
    """The solver's caffeplus_param: memory_plan (else `default`, 'shared'
    unless the solver says otherwise) for the train net, keep, offload,
    memory_budget, workspace_limit; each test net gets the same plan made for
    forward only (offload/auto: shared), its outputs kept."""
    p = solver.param
    cp = p.caffeplus_param
    name = cp.memory_plan or default or 'shared'
    check_plan_name(name)
    keep = [k.strip() for k in cp.keep if k.strip()]
    nets = [solver.net] + list(solver.test_nets)
    known = set()
    for n in nets:
        known.update(n._blob_names)
    missing = [k for k in keep if k not in known]
    if missing:
        raise CaffeplusError('caffeplus_param.keep: no net of the solver has a blob named %s '
                             '(train net blobs: %s)'
                             % (', '.join("'%s'" % m for m in missing),
                                ', '.join(solver.net._blob_names)))
    limit = int(cp.workspace_limit) or None
    budget = int(cp.memory_budget) or None
    apply_named_plan(solver.net, name, keep=[k for k in keep if k in solver.net._blob_names],
                     offload_policy=_offload_policy(cp.offload), workspace_limit=limit,
                     training=True, solver_type=solver_type_name(p), budget=budget,
                     param_diffs=getattr(solver, 'in_backward', None) is not None and
                     update_in_backward.places_gradients(name, solver))
    test_name = name if name in ('stock', 'arena') else 'shared'
    for n in solver.test_nets:
        apply_named_plan(n, test_name, keep=[k for k in keep if k in n._blob_names],
                         workspace_limit=limit, training=False)
