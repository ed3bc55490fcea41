"""The dataset strategies (`lifelong.dataset_strategy`): what stage i of a lifelong run trains, and computes its
Fisher, on. One entry per strategy; `leanagent.run.strategy` writes and records what an entry asks for.

- `single` (LeanAgent's main setup): repository i's own folder.
- `merge_all` (LeanAgent's other setup): the merge of repositories 0..i (`leanagent.data.merge`, LeanAgent's rules).
- `replay`: the same merge, with only `lifelong.replay_fraction` of the training theorems of each of repositories
  0..i-1 (`leanagent.data.replay`), repository i whole. A fraction of 1 is `merge_all`; 0 would be `single`.

Every merging strategy keeps every validation and test theorem of the repositories it merges, so validation is the
union of their validation splits, and each example's negatives come from what its own theorem may use in the merged
corpus. Evaluation does not depend on the strategy: each repository is scored on its own test split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from leanagent.ground.config import LifelongConfig

# (repository position, share of its training theorems): None keeps all of them, a number draws that share
Part = tuple[int, float | None]


@dataclass(frozen=True)
class DatasetStrategy:
    """`parts(i, lifelong)`: the repositories stage i's dataset is merged from, in curriculum order, each with the
    share of its training theorems kept; None for no merge: stage i trains on repository i's own folder."""

    parts: Callable[[int, LifelongConfig], tuple[Part, ...]] | None

    @property
    def merges(self) -> bool:
        """Whether a stage's dataset is written (under run_dir/merged) and recorded as the stage `NN-name/merge`."""
        return self.parts is not None


DATASET_STRATEGIES: dict[str, DatasetStrategy] = {
    "single": DatasetStrategy(None),
    "merge_all": DatasetStrategy(lambda i, _: tuple((j, None) for j in range(i + 1))),
    "replay": DatasetStrategy(lambda i, lifelong: (*((j, lifelong.replay_fraction) for j in range(i)), (i, None))),
}


def merges(name: str | None) -> bool:
    """Whether the strategy `name` (as a manifest records it: None for a run from before strategies) merges."""
    strategy = DATASET_STRATEGIES.get(name or "single")
    return strategy is not None and strategy.merges
