import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The transform tests run many tiny ops, which intra-op threads only slow down."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
