"""DirectCompiled (runner/cpu_compile_direct.py): after a key's first call through Dynamo its
compiled graph is called directly, with the inputs fetched from the same places (a module's
parameters as they are now, the arguments), the results equal to the function's; a static input
of another shape, or a new key, goes through Dynamo again and compiles for it."""

from __future__ import annotations

import pytest
import torch

from foretell.runner.cpu_compile_direct import DirectCompiled


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def scaled_sum(layer: torch.nn.Linear, x: torch.Tensor, index: torch.Tensor, scale: float):
    out = torch.nn.functional.linear(x, layer.weight, layer.bias)  # [T, out]
    return out[:, index].sum(-1) * scale, out.relu()


@pytest.mark.slow
def test_direct_calls_match_the_function_and_fall_back_on_new_shapes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6)
    compiled = DirectCompiled(scaled_sum)
    with torch.inference_mode():
        for step in range(4):
            for rows in (1, 3):
                x = torch.randn(rows, 8)
                index = torch.arange(2 + step)  # its length varies: dynamic
                if not compiled.knows(("rows", rows)):
                    torch._dynamo.mark_static(x, 0)
                    torch._dynamo.mark_dynamic(index, 0)
                got = compiled(("rows", rows), layer=layer, x=x, index=index, scale=0.5)
                want = scaled_sum(layer, x, index, 0.5)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w)
        assert set(compiled.direct) == {("rows", 1), ("rows", 3)} and compiled.num_direct_calls == 6
        layer.weight.mul_(2.0)  # parameters are read as they are at each call
        x = torch.randn(3, 8)
        index = torch.arange(3)
        got = compiled(("rows", 3), layer=layer, x=x, index=index, scale=0.5)
        torch.testing.assert_close(got[0], scaled_sum(layer, x, index, 0.5)[0])
        assert compiled.num_direct_calls == 7
        wider = torch.nn.Linear(8, 10)  # a static input of another shape: through Dynamo (recompiled)
        got = compiled(("rows", 3), layer=wider, x=x, index=index, scale=0.5)
        torch.testing.assert_close(got[1], scaled_sum(wider, x, index, 0.5)[1])
        assert compiled.num_direct_calls == 7
