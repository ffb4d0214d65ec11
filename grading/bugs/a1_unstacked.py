"""Assignment 1, seeded bug: the plot draws every role's bars from zero, so they overlap instead of stacking (the
largest role hides the others, and the bar's top is not the total)."""

import matplotlib.pyplot as plt

LOSES = {"test_plot_stacks_the_roles"}


def plot(tl, unit=1e6, ax=None):
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    x = range(len(tl.samples))
    for role in tl.roles:
        ax.bar(x, [s["roles"][role] / unit for s in tl.samples], 0.8, label=role)  # the bug: no bottom=
    for k, name in enumerate(tl.phases):
        ax.text(2 * k + 0.5, 1.01, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
    ax.legend(loc="upper left", fontsize=7)
    return ax
