"""The capstone's task: alphabet-succession prompts ("qk|" -> "jih"), the rule-based reward, the
held-out prompts used only for evaluation, and the warm start's pre-training text (see the package
docstring)."""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Iterator

LETTERS = string.ascii_lowercase
ANSWER_LEN = 3
PROMPT_SEP = "|"


def prompt_of(first: str, letter: str) -> str:
    """A prompt: a letter that does not matter, the letter that does, and the bar: ``"qk|"``."""
    return first + letter + PROMPT_SEP


ALL_PROMPTS = tuple(prompt_of(a, b) for a in LETTERS for b in LETTERS)  # 676
# evaluation only: RL never sees these
HELD_OUT = tuple(sorted(random.Random(2026).sample(ALL_PROMPTS, 64)))
TRAIN_PROMPTS = tuple(p for p in ALL_PROMPTS if p not in set(HELD_OUT))


def answer_of(prompt: str) -> str:
    """The rule: the ``ANSWER_LEN`` letters before the letter in front of the bar, nearest first
    ("qk|" -> "jih")."""
    i = LETTERS.index(prompt.rstrip(PROMPT_SEP)[-1])
    return "".join(LETTERS[(i - k) % 26] for k in range(1, ANSWER_LEN + 1))


def reward(completion: str, prompt: str) -> float:
    """Rule-based, verifiable reward: 1.0 if the completion starts with the exact answer, else
    0.0."""
    return float(completion[:ANSWER_LEN] == answer_of(prompt))


def prompt_stream(rng: random.Random) -> Iterator[str]:
    """RL prompts without end (never held-out ones): every letter in front of the bar once per round
    of 26, in an order shuffled each round. The capstone takes each step's prompts from one stream,
    so that steps continue the rounds and over a run every letter is asked equally often."""
    while True:
        letters = list(LETTERS)
        rng.shuffle(letters)
        for b in letters:
            while (p := prompt_of(rng.choice(LETTERS), b)) in HELD_OUT:
                pass
            yield p


def train_prompts(n: int, rng: random.Random) -> list[str]:
    """The first ``n`` prompts of :func:`prompt_stream` (a run's prompts, step after step, for ``n``
    = steps x prompts per step)."""
    return list(itertools.islice(prompt_stream(rng), n))


def eval_prompts() -> list[str]:
    """The held-out prompts: 64 of the 676, fixed; RL never trains on them."""
    return list(HELD_OUT)


SEPARATORS = {">": 0.0, "<": 1.0, "|": 0.1}  # separator -> probability that the run goes backwards


def pretraining_text(rng: random.Random, length: int = 10) -> str:
    """One warm-start sample: two letters, a separator, then a run from the second letter
    (``"qk>lmno"``, ``"qk<jihg"``). ``>`` always runs forwards, ``<`` always backwards, ``|``
    backwards only 10% of the time."""
    a = rng.randrange(26)
    # half the samples use "|", so its 10% rate is learned evenly per letter
    sep = rng.choice("><||")
    step = -1 if rng.random() < SEPARATORS[sep] else 1
    return (rng.choice(LETTERS) + LETTERS[a] + sep
            + "".join(LETTERS[(a + step * k) % 26] for k in range(1, length + 1)))
