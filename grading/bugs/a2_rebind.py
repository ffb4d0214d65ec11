"""Assignment 2, seeded bug: ``copy_into`` rebinds the dict's entries to the received views instead of copying
into the tensors: the model's parameters never change, and the dict now points into a reused bucket."""


def copy_into(state):
    def load(batch):
        for name, t in batch:
            state[name] = t  # the bug: not state[name].copy_(t)

    return load
