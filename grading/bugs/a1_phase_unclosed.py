"""Assignment 1, seeded bug: a phase samples its end after ``yield`` but not in a ``finally``: a phase that raises
(an out-of-memory error in generate, the moment the timeline is read) is left without its end sample."""

import contextlib

from grading.reference import a1 as ref

LOSES = {"test_a_phase_that_raises_is_still_closed"}


class Timeline(ref.Timeline):
    @contextlib.contextmanager
    def phase(self, name):
        self.phases.append(name)
        self._sample(name, "begin")
        yield  # the bug: no try/finally around the yield
        self._sample(name, "end")
