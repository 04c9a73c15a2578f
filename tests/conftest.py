"""Session-wide test settings: torch runs single-threaded. Every test model is tiny, so intra-op threads only
add contention (on a 2-core CI machine they made the suite several times slower)."""

import torch


def pytest_configure(config):
    torch.set_num_threads(1)
