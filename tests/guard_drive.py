"""A guard (policy.guard.Guard) driven by hand, for its pure tests: a cost curve,
its CostModel, one row, and the decisions, cycles and timed steps the engine
would feed it."""

from mlx_dflash.policy.base import DFLASH, CycleResult
from mlx_dflash.policy.costs import CostModel, Costs
from rows import Row


def curve_for(k, w=5):
    """A curve whose width-w cycle costs k plain tokens (a plain token 0.8 of a
    1-token step, as pipelining gives; verify and draft split 3:1)."""
    t1, tp = 0.01, 0.008
    steps = k * tp / t1
    return Costs(t1, {1: 1.0, w: 0.75 * steps}, {1: 0.0, w: 0.25 * steps}, t_plain=tp)


def model_for(base, long=None):
    """The CostModel of one curve (and a long-context one)."""
    return CostModel(lambda at: base if at is None else long, sorted(base.c),
                     priced_at=(lambda n: None) if long is None else (lambda n: long.context if n > 512 else None))


ROW = Row()


def due(g, rows=(ROW,)) -> int:
    """0 when the guard drafts now, else -1 (plain steps)."""
    return 0 if g.decide(list(rows)).width > 1 else -1


def cycle(g, accepted, w=5, rows=(ROW,)):
    """A DFlash cycle at width w in which each row accepted `accepted` drafts."""
    g.observe(list(rows), [CycleResult(w, accepted, accepted + 1, source=DFLASH) for _ in rows])


def plain(g, k, rows=(ROW,)):
    for _ in range(k):
        g.observe(list(rows), [CycleResult(1, 0, 1) for _ in rows])


def drive(g, accepted, cycles, rows=(ROW,)):
    """Run the guard's loop for `cycles` decisions, each draft cycle accepting
    `accepted(i)` drafts per row. Returns the decisions: a width, or -1 per plain step."""
    seq = []
    for i in range(cycles):
        d = g.decide(list(rows))
        if d.width == 1:
            plain(g, 1, rows)
            seq.append(-1)
        else:
            assert set(d.sources) == {DFLASH}
            cycle(g, accepted(i), d.width, rows)
            seq.append(d.width)
    return seq


def step(g, w, secs, rows=(ROW,), accepted=0):
    """One step the engine accounted `secs` after its previous one (CycleResult.t_step)."""
    g.decide(list(rows))
    src = DFLASH if w > 1 else ""
    g.observe(list(rows), [CycleResult(w, accepted, accepted + 1, source=src, t_step=secs) for _ in rows])
