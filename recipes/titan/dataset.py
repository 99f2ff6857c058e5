"""``register_local_text_dataset``: the ptops text corpus as an entry of torchtitan's ``DATASETS``
table, so that a small run needs no hub download.

Its own module: only the job config (``registry.py``) names it; torchtitan's dataloader looks the
name up, the trainer never sees it.
"""

from __future__ import annotations

import random

DATASET_NAME = "ptops_text"


def register_local_text_dataset(seed: int = 0) -> str:
    """Add ``ptops_text`` to torchtitan's dataset table; returns its name.

    The corpus comes from ``ptops.recipes.assets.text_corpus()`` (generated,
    deterministic); its order is shuffled with ``seed`` so that ``train.seed``
    also fixes the data order.
    """
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from ptops.recipes.assets import text_corpus

    def loader(path: str) -> Dataset:
        rows = text_corpus()
        random.Random(seed).shuffle(rows)
        return Dataset.from_dict({"text": rows})

    DATASETS[DATASET_NAME] = DatasetConfig(
        path="ptops://text_corpus",
        loader=loader,
        sample_processor=lambda sample: sample["text"],
    )
    return DATASET_NAME
