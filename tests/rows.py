"""A row as the policies see it (policy.base.Row), for their pure tests."""

from mlx_dflash.policy.base import DFLASH, LOOKUP, Plan


class Row:
    """A guarded row as the guard sees it (policy.base.Row)."""

    def __init__(self, cap=5, uid=1, context=0, fixed=False, lookup=False, offer=0, carry=True, match=4):
        self.uid, self.context, self.left, self.offer, self.match = uid, context, 10**6, offer, match
        self.unseen = 0  # context rows the drafter has not taken in (its catch-up)
        self.plan = Plan("dflash", cap, fixed, True, lookup, carry=carry)

    def offers(self, source, n):
        return n if source == DFLASH else min(n, self.offer)

    def grade(self, source):
        return self.match if source == LOOKUP and self.offer else 0
