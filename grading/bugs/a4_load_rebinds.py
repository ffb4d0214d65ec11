"""Assignment 4, seeded bug: ``load`` puts a copy of each view in the dict instead of copying into the tensor
there: the dict looks updated, but the model's own parameters (the tensors it computes with) are unchanged."""

import torch

LOSES = {"test_load_copies_into_the_receivers_tensors_in_place"}


@torch.no_grad()
def load(params, views):
    for name, view in views:
        params[name] = view.clone()  # the bug: not params[name].copy_(view)
    return sum(v.nbytes for _, v in views)
