"""Fixtures for the MLA tests: the tiny models are far too small to gain from intra-op threads, and on a shared
CPU extra threads only contend, so each test here runs torch single-threaded (restored afterwards)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
