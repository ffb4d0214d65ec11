"""Assignment 1, seeded bug: a role's size is its tensors' element count, not their bytes (right for uint8
only: a float32 timeline reads four times too small, a bfloat16 one two)."""

import time

import torch

from grading.reference import a1 as ref

LOSES = {"test_bytes_by_role_at_every_phase_edge",
         "test_a_phase_that_raises_is_still_closed",
         "test_a_view_counts_its_own_bytes_and_roles_are_read_at_each_sample"}
# on a GPU the timeline is also checked against the allocator's count, which a bfloat16 model's numel misses too
LOSES_ON_GPU = {"test_gpu_timeline_reads_the_allocator"}


class Timeline(ref.Timeline):
    def _sample(self, phase, event):
        if self.gpu:
            torch.cuda.synchronize(self.device)
        s = {"t": time.perf_counter() - self._t0, "phase": phase, "event": event,
             "roles": {role: sum(t.numel() for t in get() if t.device == self.device)  # the bug: numel
                       for role, get in self.roles.items()},
             "allocated": torch.cuda.memory_allocated(self.device) if self.gpu else None}
        self.samples.append(s)
        return s
