"""Sequence augmentations for contrastive learning (CL4SRec, Xie et al. 2022; as ICLRec uses them).

Each view of a training example is one augmentation, drawn uniformly:

* crop: a random contiguous run of max(1, floor(keep * n)) items (shorter, order kept);
* mask: floor(fraction * n) random positions replaced by `MASK_ITEM` (same length);
* reorder: a random contiguous run of floor(fraction * n) items shuffled (same length, same items).

`MASK_ITEM` is 0, the item table's padding row: no loss and no ranking scores it (both run over rows
1..N) and the model zeroes the unused tail of a pack after the lookup, so that row is free to be
learned as the mask embedding.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gem_jax.config import RetrievalConfig

MASK_ITEM = 0
AUGMENTATIONS = ("crop", "mask", "reorder")


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """The three augmentations' rates (`retrieval.augment_*`)."""

    crop_keep: float = 0.6
    mask_fraction: float = 0.3
    reorder_fraction: float = 0.3

    @classmethod
    def from_config(cls, r: RetrievalConfig) -> Augmentation:
        return cls(r.augment_crop_keep, r.augment_mask_fraction, r.augment_reorder_fraction)

    def crop(self, seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        n = len(seq)
        k = max(1, int(self.crop_keep * n))
        start = int(rng.integers(0, n - k + 1))
        return seq[start : start + k].copy()

    def mask(self, seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = seq.copy()
        out[rng.choice(len(seq), int(self.mask_fraction * len(seq)), replace=False)] = MASK_ITEM
        return out

    def reorder(self, seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        n = len(seq)
        k = int(self.reorder_fraction * n)
        start = int(rng.integers(0, n - k + 1))
        out = seq.copy()
        out[start : start + k] = rng.permutation(out[start : start + k])
        return out

    def views(self, sequences: list[np.ndarray], rng: np.random.Generator) -> tuple[list, list]:
        """Two independently augmented views of each (non-empty) sequence."""
        kinds = rng.integers(0, len(AUGMENTATIONS), size=(2, len(sequences)))
        ops = [getattr(self, name) for name in AUGMENTATIONS]
        first = [ops[k](s, rng) for k, s in zip(kinds[0], sequences)]
        second = [ops[k](s, rng) for k, s in zip(kinds[1], sequences)]
        return first, second
