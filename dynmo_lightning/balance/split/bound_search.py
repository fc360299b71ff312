"""Exact search for the least feasible bottleneck bound, shared by the central and the diffusion planner."""

from __future__ import annotations

import math
from collections.abc import Iterable


class BoundSearch:
    """Find the least bound ``B`` at which a monotone feasibility probe succeeds, exactly.

    While not :attr:`done`, the caller probes the bound :meth:`point` proposes and reports back with
    :meth:`record`:

    * feasible: the bottleneck the probe's split actually reached (a block sum ``<= B``); it becomes the upper end.
    * infeasible: the least block sum the probe could still have admitted (``> B``); nothing below it can be
      feasible, so it becomes the lower end.

    Both ends are therefore block sums, the optimum lies between them, and every probe at least halves the gap
    in value, so the search stops after finitely many probes with ``lo == hi == optimum`` - no epsilon involved.
    A probe that is infeasible even at ``inf`` records ``inf``; the search then ends with ``hi == inf``.
    """

    def __init__(self, lower: float, guesses: Iterable[float] = ()) -> None:
        """Start the search.

        Args:
            lower: a bound known not to exceed the optimum.
            guesses: bounds to probe first (skipped when already outside the open range); good guesses save probes.

        """
        self.lo = lower
        self.hi = math.inf
        self._guesses = list(guesses)

    @property
    def done(self) -> bool:
        """Whether the search is over; the answer is then :attr:`hi` (``inf`` if nothing is feasible)."""
        return self.lo >= self.hi

    def point(self) -> float:
        """Next bound to probe; call only while the search is not :attr:`done`.

        Returns:
            A bound in ``[lo, hi)``.

        """
        while self._guesses:
            guess = self._guesses.pop(0)
            if self.lo <= guess < self.hi:
                return guess
        if self.hi == math.inf:
            return math.inf
        mid = self.lo + (self.hi - self.lo) / 2
        # Adjacent floats: probing lo itself still settles the search in one step.
        return mid if mid < self.hi else self.lo

    def record(self, feasible: bool, value: float) -> None:
        """Take in a probe's outcome at the bound :meth:`point` proposed.

        Args:
            feasible: whether a split within the bound exists.
            value: if feasible, the bottleneck of the split found; otherwise the least bound that could be feasible.

        """
        if feasible:
            self.hi = value
        else:
            self.lo = value
