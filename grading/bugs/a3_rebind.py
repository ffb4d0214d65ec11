"""Assignment 3, seeded bug: ``copy_into`` rebinds the dict's entries to the received views instead of copying
into the tensors: the model's parameters never change, and the dict now points into a reused bucket."""

LOSES = {"test_receivers_hold_the_trainers_bytes", "test_copy_into_writes_in_place"}


def copy_into(state):
    def load(batch):
        for name, t in batch:
            state[name] = t  # the bug: not state[name].copy_(t)

    return load
