"""A layer's workspace call sites: which of its passes runs each cuDNN call
('fwd', 'bwd_data', 'bwd_filter'), and the workspace view each one uses."""


VIEW_NAMES = ('forward', 'backward', 'backward_filter')


def view_part(layer, kind):
    """Which of a layer's workspace views a call site uses: 0 its forward,
    1 its backward's data call, 2 its backward's filter call."""
    if kind in forward_kinds(layer):
        return 0
    return 2 if kind == 'bwd_filter' else 1


def forward_kinds(layer):
    """The call sites a layer's forward uses (a Deconvolution's forward is
    the convolution's backward-data); the others run in its backward."""
    return ('bwd_data',) if getattr(layer, 'reverse', False) else ('fwd',)
