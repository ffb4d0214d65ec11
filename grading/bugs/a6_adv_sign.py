"""Assignment 6, seeded bug: the advantage's sign is flipped (the group's mean minus the reward): every step
pushes the policy away from what was rewarded, while the loss still goes down."""

from grading.reference import a6 as ref

LOSES = {"test_group_advantages",
         "test_grpo_learns_the_rewarded_action",
         "test_group_advantages_eps_and_dtype"}


def group_advantages(rewards, eps=1e-6, scale=True):
    return -ref.group_advantages(rewards, eps, scale)  # the bug: mean - reward
