"""Caffe's SignalHandler: SIGINT, SIGHUP and SIGTERM turned into solver
actions (`caffeplus train`, and rank 0 of a data-parallel run)."""
import signal


class SignalHandler:
    """Caffe's SignalHandler: remember SIGINT, SIGHUP and SIGTERM, turn them
    into solver actions when the solver asks. SIGINT and SIGHUP do what
    their effect flags say; SIGTERM always stops (with the final snapshot):
    `docker stop`, systemd and batch schedulers send it before SIGKILL, and
    a run they stop must end, whatever the flags say.

    on_sigterm(handler), run inside the signal handler for each SIGTERM, may
    raise to unwind at once instead of at the iteration's end; by default a
    second SIGTERM before the first was acted on exits (status 143)."""

    def __init__(self, sigint_effect, sighup_effect, on_sigterm=None):
        self.effects = {signal.SIGINT: sigint_effect}
        if hasattr(signal, 'SIGHUP'):
            self.effects[signal.SIGHUP] = sighup_effect
        if hasattr(signal, 'SIGTERM'):
            self.effects[signal.SIGTERM] = 'stop'
        self.on_sigterm = on_sigterm or exit_on_second_sigterm
        self.pending = []
        self.previous = {}

    def _handle(self, signum, frame):
        if signum == getattr(signal, 'SIGTERM', None):
            self.on_sigterm(self)
            if signum not in self.pending:
                self.pending.append(signum)
            return
        if signum in self.pending and signum == signal.SIGINT:
            # A second Ctrl-C before the solver took the first one: the
            # trainer is stuck (in a long forward, say); give up at once (an
            # unfinished snapshot is abandoned, its temporary file removed:
            # caffeplus.io.atomic).
            raise KeyboardInterrupt
        self.pending.append(signum)

    def __enter__(self):
        for signum in self.effects:
            try:
                self.previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for signum, old in self.previous.items():
            signal.signal(signum, old)
        self.previous = {}

    def action(self):
        if not self.pending:
            return 'none'
        sigterm = getattr(signal, 'SIGTERM', None)
        if sigterm in self.pending:
            # A stop outranks a snapshot still queued: the stop writes the
            # final snapshot anyway, and SIGKILL may follow soon.
            self.pending.remove(sigterm)
            return 'stop'
        signum = self.pending.pop(0)
        return self.effects.get(signum, 'none')


def exit_on_second_sigterm(handler):
    """A SIGTERM while an earlier one waits for the iteration's end: the
    trainer is stuck, so exit now (143, as a process killed by SIGTERM)."""
    if signal.SIGTERM in handler.pending:
        raise SystemExit(128 + signal.SIGTERM)
