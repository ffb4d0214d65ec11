"""Assignment 6, seeded bug: TIS weights are the raw importance ratios, never capped: one token the engine
found unlikely and the trainer likely gets a huge weight, and the gradient's variance explodes."""

import torch

LOSES = {"test_tis_weights_and_mis_mask",
         "test_tis_and_mis_at_the_cap_and_in_other_dtypes"}


def tis_weights(logp_trainer, logp_engine, cap=2.0):
    return torch.exp(logp_trainer.detach() - logp_engine)  # the bug: no .clamp(max=cap)
