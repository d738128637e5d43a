"""Solver type names: SolverParameter.type, or the old solver_type enum."""


# The old SolverParameter.solver_type enum, by value.
_LEGACY_TYPES = {0: 'SGD', 1: 'Nesterov', 2: 'AdaGrad', 3: 'RMSProp', 4: 'AdaDelta', 5: 'Adam'}


def solver_type_name(param):
    if not param.HasField('type') and param.HasField('solver_type'):
        return _LEGACY_TYPES.get(param.solver_type, str(param.solver_type))
    return param.type
