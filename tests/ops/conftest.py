import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: faster on a shared 2-core machine, and it keeps MKL's kernel choice
    fixed (the inverse controls below rely on CPU torch.mm, not on thread timing)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
