"""Trace once, run any batch: mechanisms by which a graph could keep something of its trace sample.

Each test is a small synthetic model whose forward uses one such mechanism; the graph traced on one
sample must equal eager execution on inputs of another batch size and length (DESIGN invariant 1).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.proxy import Proxy

from seqcal import trace_subgraphs
from test_trace_equivalence import assert_same_outputs


class Layer(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Stack(torch.nn.Module):
    """Layers whose outputs a forward collects in Python containers (lists, dicts) by method calls."""

    def __init__(self, width: int = 8, layers: int = 3, named: bool = True) -> None:
        super().__init__()
        self.named = named
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, width)
        self.seen: list[torch.Tensor] = []  # held by the model across forwards

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = [x]
        named: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x)
            outs.append(x)  # a list the forward built, appended to with a value known only at run time
            if self.named:
                named.update({f"layer{i}": x})
        self.seen.append(x)  # the model's own list: must get real tensors, as in eager mode
        extra = [outs[0]]
        for i in range(1, len(outs)):  # reaches no target, but reuses the loop variable name ``i``
            extra.append(self.head(outs[i]))
        return {"stacked": torch.stack(extra).mean(0), "last": named.get(f"layer{len(self.layers) - 1}", x)}


@pytest.mark.parametrize("named", [False, True], ids=["list", "list-and-dict"])
def test_container_mutated_by_method_calls_follows_the_run(named: bool) -> None:
    # A list built by the forward and appended to in a traced loop used to become an `append` node that
    # changed the trace-time list only at run time, so `torch.stack` read the list as it was before the loop:
    # silently wrong outputs (the dict's `update` failed at run time instead).
    model = Stack(named=named).eval()
    sg = trace_subgraphs(model, {"x": torch.randn(1, 5, 8)}, sequential_targets=["Layer"])
    assert sg.targets == ["layers.0", "layers.1", "layers.2"]
    assert not any(isinstance(v, Proxy) for v in model.seen)  # no proxy left on the model
    model.seen.clear()
    for shape in [(2, 3, 8), (3, 7, 8)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x)
        assert_same_outputs(sg.run(x=x), want)
    assert len(model.seen) == 4 and all(type(v) is torch.Tensor for v in model.seen)


class LoopLocals(torch.nn.Module):
    """A layer loop whose opaque statements read the loop variable and a local the loop body assigns."""

    def __init__(self, width: int = 8, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))
        self.gates = torch.nn.Linear(width, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.gates(x)  # [batch, seq, layers]
        started = False
        for i, layer in enumerate(self.layers):
            # `is` on a value known only at run time: opaque, and it reads the loop variable `i`.
            gate = gates[..., i : i + 1] if gates is not None else None
            # Opaque too; reads `prev`, which the previous iteration assigned.
            x = x + 0.5 * prev if started and gates is not None else x  # noqa: F821
            x = layer(x) * gate
            prev = x  # noqa: F841 - read by the next iteration (ruff does not see loop-carried reads)
            started = True
        return x


def test_opaque_code_in_a_loop_reads_the_loop_locals() -> None:
    # The loop variable and the locals a loop body assigns used to be looked up as globals by the opaque
    # helpers lifted from the loop body: NameError at run time.
    model = LoopLocals().eval()
    sg = trace_subgraphs(model, {"x": torch.randn(1, 5, 8)}, sequential_targets=["Layer"])
    assert len(sg.traced.failures) == 2  # both statements run opaquely, as one helper
    for shape in [(2, 3, 8), (1, 9, 8)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x)
        assert_same_outputs(sg.run(x=x), want)


class Encoder(torch.nn.Module):
    def __init__(self, width: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if scale is None else x * scale


class Checked(torch.nn.Module):
    """Input checks (on runtime values) right before code that only reads a constant flag."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()

    def forward(self, x: torch.Tensor, use_scale: bool | None = None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("x must be [batch, seq, width]")
        if use_scale:
            state = {"scale": 2.0}
        else:
            state = None
        return self.encoder(x, scale=state["scale"] if state is not None else None)


@pytest.mark.parametrize("use_scale", [False, True])
def test_opaque_statements_on_constants_are_folded_one_by_one(use_scale: bool) -> None:
    # Consecutive opaque statements used to be one helper: the check on `x` made everything the group
    # assigned (`state`) a value only known at run time, so the `is` test on it failed and the encoder call,
    # with the layers inside, became opaque too.
    model = Checked().eval()
    sg = trace_subgraphs(
        model, {"x": torch.randn(1, 5, 8), "use_scale": use_scale}, sequential_targets=["Layer"]
    )
    assert sg.targets == ["encoder.layers.0", "encoder.layers.1"]
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        want = model(x, use_scale=use_scale)
    assert_same_outputs(sg.run(x=x, use_scale=use_scale), want)


class DirectForward(torch.nn.Module):
    """Layers called through ``layer.forward(x)``, not ``layer(x)`` (SqueezeBERT's encoder does this)."""

    def __init__(self, width: int = 8, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer.forward(x) + x
        return x


def test_a_target_called_through_its_forward_method_is_a_node() -> None:
    model = DirectForward().eval()
    subgraphs = trace_subgraphs(model, {"x": torch.randn(1, 5, 8)})
    assert subgraphs.targets == ["layers.0", "layers.1", "layers.2"] and len(subgraphs) == 4
    nodes = [n.target for n in subgraphs.traced.graph.nodes if n.op == "call_module"]
    assert nodes == ["layers.0", "layers.1", "layers.2"]
    other = torch.randn(3, 7, 8)
    with torch.no_grad():
        assert_same_outputs(subgraphs.run(x=other), model(x=other))
    seen: list[str] = []  # at run time the layers are called as modules: calibration hooks see them
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, n=n: seen.append(n))
        for n, m in model.layers.named_children()
    ]
    subgraphs.run(x=other)
    for handle in handles:
        handle.remove()
    assert seen == ["0", "1", "2"]
