import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """These tests run many small matmuls: on a shared 2-core machine, a second intra-op thread
    waits for a busy core more than it helps (measured 10-60x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
