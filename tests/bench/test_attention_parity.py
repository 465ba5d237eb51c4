"""bench/attention_parity.py on the CPU: the kernels that run there keep a sample's bits with and without autograd
and at any tile position, and one that does not run there is reported as such, not as a failure."""

import pytest
import torch


@pytest.fixture(scope="module")
def attention_parity(bench_script):
    with bench_script("attention_parity") as module:
        yield module


def test_the_cpu_kernels_keep_a_samples_bits(attention_parity):
    q, k, v = (torch.randn(3, 2, 24, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for name in ("flash", "math"):
        assert attention_parity.parity(attention_parity.BACKENDS[name], q, k, v) == (True, True)
    with pytest.raises(RuntimeError):  # no cuDNN on the CPU: main() prints "unavailable" for it
        attention_parity.parity(attention_parity.BACKENDS["cudnn"], q, k, v)
