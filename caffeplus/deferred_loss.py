"""A forward pass's loss that may still be on the device.

Reading a GPU loss as a Python float waits for the forward pass to finish,
and the GPU then sits idle while the host launches the backward pass. The
solver runs its forward with Net.forward_from_to(..., defer_loss=True) and
reads the loss once the iteration's work is all queued
(caffeplus.solver.solver.Solver.step).

The value is the one a synchronous forward returns, bit for bit: the same
float() of each term, summed in the same order (per layer from 0.0, then
across layers from 0.0, as Net.forward_from_to and Layer.weighted_loss do).
Errors a term finds when it is read (a fused loss layer's label check) are
raised by float().
"""


class DeferredLoss:
    """The loss of the layers run so far; float() reads it (once)."""

    def __init__(self):
        self._terms = []            # per layer: a float or a callable returning one
        self._value = None

    def add(self, term):
        """A layer's weighted loss: a number or a zero-argument callable
        (Layer.forward_deferred)."""
        if self._value is not None:
            raise RuntimeError('a read loss takes no more terms')
        self._terms.append(term)

    @property
    def terms(self):
        """The terms added so far (caffeplus.pass_graph reads its capture's)."""
        if self._value is not None:
            raise RuntimeError('a read loss keeps no terms')
        return list(self._terms)

    def __float__(self):
        if self._value is None:
            loss = 0.0
            for term in self._terms:
                loss += term() if callable(term) else term
            self._value, self._terms = loss, None
        return self._value


def read_later(values):
    """A layer's weighted loss from its per-top device values, read later:
    the same sum as Layer.weighted_loss makes now."""
    def read():
        loss = 0.0
        for v in values:
            loss += float(v)
        return loss
    return read
