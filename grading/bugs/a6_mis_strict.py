"""Assignment 6, seeded bug: MIS keeps ratios strictly inside ``(1/cap, cap)``: a token exactly at a bound (at
cap = 1, every token the engine and the trainer agree on) is dropped from the loss."""

import torch

LOSES = {"test_tis_and_mis_at_the_cap_and_in_other_dtypes"}


def mis_mask(logp_trainer, logp_engine, cap=2.0):
    ratio = torch.exp(logp_trainer.detach() - logp_engine)
    return ((ratio < cap) & (ratio > 1 / cap)).to(logp_trainer.dtype)  # the bug: < and >, not <= and >=
