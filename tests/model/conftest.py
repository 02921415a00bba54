import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def model64(tiny_cfg):
    return V4Model(tiny_cfg, seed=1).cast(torch.float64).eval()


def tokens(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)
