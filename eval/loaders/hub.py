"""Loading an evaluation set by Hugging Face dataset name through `datasets.load_dataset`.

A name works online only (or from the local datasets cache); a builder name such as "json"
with `data_files` works offline, which is how the tests exercise this path."""

from __future__ import annotations

from typing import Any

PREFERRED_SPLITS = ("test", "validation", "train")


def load_hub_records(
    name: str,
    *,
    split: str | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Rows of dataset `name` as dicts. `name` may carry a config after a colon
    ("THUDM/LongBench:2wikimqa"). Without `split` the first of test, validation, train that
    exists is used. May download (and cache) the dataset; does not modify anything else.
    """
    import datasets  # deferred: importing datasets costs about a second

    config = None
    if ":" in name:
        name, config = name.split(":", 1)
    kwargs: dict[str, Any] = {}
    if data_files is not None:
        kwargs["data_files"] = data_files
    try:
        if split is not None:
            return datasets.load_dataset(name, config, split=split, **kwargs).to_list()
        splits = datasets.load_dataset(name, config, **kwargs)
    except (ValueError, KeyError):
        raise
    except Exception as err:  # not on the Hub, no network, no cached copy: datasets' own error types
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise ValueError(f"{name!r} is not a file here, and no dataset of that name could be loaded "
                         f"({type(err).__name__}: {reason}); check the path, or the dataset name and your "
                         "network") from None
    for candidate in (*PREFERRED_SPLITS, *splits.keys()):
        if candidate in splits:
            return splits[candidate].to_list()
    raise ValueError(f"dataset {name!r} has no splits; pass split=... (--split)")
