"""A fixture for test modules of tiny models: torch's intra-op threads only wait on each other there (seconds on a
busy 2-core machine). Import it into the module (``from tests.threads import one_thread``) to apply it."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the module's tests, the previous count restored after them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
