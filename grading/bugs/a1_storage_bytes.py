"""Assignment 1, seeded bug: a role's bytes are its tensors' storages' (``untyped_storage().nbytes()``), not
their own: a shard that is a view of a fused weight counts the whole weight (and two views of one storage count
it twice)."""

import time

import torch

from grading.reference import a1 as ref

LOSES = {"test_a_view_counts_its_own_bytes_and_roles_are_read_at_each_sample"}


class Timeline(ref.Timeline):
    def _sample(self, phase, event):
        if self.gpu:
            torch.cuda.synchronize(self.device)
        s = {"t": time.perf_counter() - self._t0, "phase": phase, "event": event,
             "roles": {role: sum(t.untyped_storage().nbytes() for t in get() if t.device == self.device)  # the bug
                       for role, get in self.roles.items()},
             "allocated": torch.cuda.memory_allocated(self.device) if self.gpu else None}
        self.samples.append(s)
        return s
