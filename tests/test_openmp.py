"""storage.openmp: a background thread's torch work on one OpenMP thread, the others' untouched."""

from __future__ import annotations

import threading

import pytest
import torch

from storage.openmp import _libgomp, single_threaded


@pytest.mark.skipif(_libgomp() is None, reason="torch here does not run on libgomp")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread already: nothing to show")
def test_single_threaded_holds_for_its_own_thread_only():
    before = torch.get_num_threads()
    seen: dict[str, int | bool] = {}

    def background() -> None:
        seen["took"] = single_threaded()
        a = torch.randn(256, 256)
        a @ a  # parallel work after the call stays on one thread
        seen["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == {"took": True, "threads": 1}
    assert torch.get_num_threads() == before  # the caller's (and torch's process-wide) count is unchanged
    other: list[int] = []
    fresh = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
    fresh.start()
    fresh.join()
    assert other == [before]  # a thread started later still gets torch's count
