"""Fragments: the parts of the parameters that take their outer steps in turn (OnebitDiLoCo's
``fragments=P``, after Streaming DiLoCo, arXiv 2501.18512), as pure functions of sizes and step
numbers, so that every rank derives the same schedule.

The buckets, in the optimizer's order, are cut into ``P`` runs of consecutive buckets of about
equal size (:func:`assign`); fragment ``k`` takes its outer step at the steps ``t`` with
``t % H == k * H // P`` (:func:`offset`, :func:`fragment_at`), ``H`` the steps of a round
(``sync_every``). With ``P = 1`` that is ``t % H == 0``, every bucket at once. ``P <= H`` gives
each fragment a step of its own in every round: one fragment is in flight at a time, the bytes
of a round are those of one all-reduce of every parameter, and the largest step sends about
``1 / P`` of them.
"""

from __future__ import annotations

__all__ = ["assign", "offset", "fragment_at"]


def offset(k: int, sync_every: int, fragments: int) -> int:
    """The step of the round (``t % sync_every``) at which fragment ``k`` takes its outer step."""
    return k * sync_every // fragments % sync_every


def fragment_at(step: int, sync_every: int, fragments: int) -> int | None:
    """The fragment whose outer step is step ``step``, or None (an inner step for every
    fragment). Needs ``1 <= fragments <= sync_every``: the offsets are then distinct."""
    r = step % sync_every
    k = -(-r * fragments // sync_every)  # the one k whose offset can be r (offsets grow by >= 1)
    return k if k < fragments and offset(k, sync_every, fragments) == r else None


def assign(numels: list[int], fragments: int) -> list[int]:
    """The fragment of each bucket (``numels``: their sizes, in order): runs of consecutive
    buckets, each bucket in the fragment its middle element falls in (``P * middle // total``),
    held to the runs that leave every fragment a bucket when there are at least ``P`` buckets (a
    bucket joins the fragment of the one before it or the next, and leaves as many fragments as
    there are buckets after it). With fewer buckets, the last fragments are empty."""
    total = sum(numels)
    out: list[int] = []
    before, last = 0, -1
    for i, numel in enumerate(numels):
        wanted = fragments * (2 * before + numel) // (2 * total) if total else i  # (twice the middle: exact)
        k = min(max(wanted, last, fragments - (len(numels) - i)), last + 1, fragments - 1)
        out.append(k)
        before, last = before + numel, k
    return out
