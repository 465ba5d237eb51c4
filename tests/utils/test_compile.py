"""miles/utils/compile.py: `compile_seconds` counts the forward's and the backward's compile time."""

import torch

from miles.utils.compile import compile_seconds


def test_compile_seconds_grow_with_a_forward_and_a_backward_compile():
    torch._dynamo.reset()
    layer = torch.nn.Linear(8, 8)
    step = torch.compile(lambda x: layer(x).tanh().sum(), backend="aot_eager")  # dynamo and AOT, no codegen
    # no cache hits: a cached graph loads its backward with the forward, at the first call
    with torch._inductor.config.patch(force_disable_caches=True):
        before = compile_seconds()
        loss = step(torch.randn(2, 8))
        after_forward = compile_seconds()
        loss.backward()  # the backward graph compiles here, at its first use
        after_backward = compile_seconds()
        step(torch.randn(2, 8))  # the cached graph: no compile
    assert after_forward > before and after_backward > after_forward
    assert compile_seconds() == after_backward
