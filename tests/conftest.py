"""Session-wide test settings: torch runs single-threaded. Every test model is tiny, so intra-op threads only
add contention (on a 2-core CI machine they made the suite several times slower)."""

import os
import subprocess
import sys

import pytest
import torch


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def full_budget_one(tmp_path_factory):
    """The folder of one unsharded CPU smoke run of benchmarks/full_budget.py (``smoke_run``'s arguments, tag
    ``one``, one thread), run once per session for the tests that hold a sharded or reusing run against it."""
    from test_full_budget_shards import BENCH, smoke_run

    out = tmp_path_factory.mktemp("full_budget_one")
    common, env = smoke_run(out)
    one = subprocess.run([sys.executable, os.path.join(BENCH, "full_budget.py"), *common, "--tag", "one",
                          "--threads", "1"], env=env, capture_output=True, text=True)  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    return out
