import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests use tiny tensors: on a 2-core machine extra OpenMP threads only fight over the cores
    (tiny ops got up to 100x slower with two threads while another process was busy)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
