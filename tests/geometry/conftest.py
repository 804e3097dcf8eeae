"""Tiny models gain nothing from intra-op threads, and OpenMP spinning makes them slow on a busy
CI box: run each geometry test single-threaded, restoring the previous setting afterwards."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _single_torch_thread():
    try:
        import torch
    except ImportError:  # the config-only tests run without torch
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
