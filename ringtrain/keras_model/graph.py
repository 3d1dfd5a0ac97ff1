"""Cut a user's functional Keras graph into pipeline stages.

The model is first flattened: a functional model nested as one layer (a `keras_hub` backbone
called on new inputs, a Sequential inside a functional model) is inlined, calling its own
layers, so it is split through rather than kept whole. The flat graph reuses the user's layer
objects, so its weights are the user's, under the same paths.

Its layer calls are then put in topological order. A cut between two calls is valid when:
- at most one tensor that depends on weights crosses it: the stream of hidden states. Model
  inputs, and tensors computed from inputs alone without weights (a padding mask), may cross
  with it. So a residual or skip block, whose two branches cross together, stays whole;
- no layer is called on both sides of it (a shared layer would need its weights on two ranks).

The calls between two valid cuts form a block; a stage is a run of whole blocks, built as a
keras.Model from the tensors crossing into it to those crossing out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.tensorflow_loader import tf  # noqa: F401  (before Keras: keeps scikit-learn out)

# isort: split
import keras
import numpy as np

from ringtrain.errors import UserError


def _graph(model):
    """The functional graph of a functional or Sequential model; None for a subclassed one."""
    graph = getattr(model, "_functional", None) or model  # a Sequential keeps one inside
    return graph if isinstance(model, keras.Model) and hasattr(graph, "_nodes_by_depth") else None


def flatten(model: keras.Model, example_shapes: list[tuple[int, ...]]) -> keras.Model:
    """The same computation as one functional graph of plain layers (nested models inlined),
    on inputs of the data's own per-example shapes, so every tensor that crosses a cut has a
    known size (a sequence length the model leaves open is the data's)."""
    graph = _graph(model)
    if graph is None:
        raise UserError(
            f"model {model.name!r} is subclassed (no layer graph), so it cannot be split into "
            "stages; it trains under --strategy single and data"
        )
    inputs = [
        keras.Input(shape=shape, dtype=t.dtype, name=t.name)
        for t, shape in zip(graph.inputs, example_shapes, strict=True)
    ]
    return keras.Model(inputs, _inline(graph, inputs), name=f"{model.name}_flat")


def _inline(graph, inputs):
    """Run a graph on symbolic `inputs`, calling nested graphs' layers one by one."""

    def call(op):
        inner = _graph(op)
        if inner is not None:
            return lambda *args, **_kwargs: _inline(inner, inner._standardize_inputs(args[0]))
        return op

    return graph._run_through_graph(inputs, operation_fn=call)


@dataclass
class Block:
    """Layer calls between two valid cuts."""

    layers: list[str]
    params: int

    def describe(self) -> str:
        if len(self.layers) == 1:
            return f"layer {self.layers[0]}"
        return f"{self.layers[0]} .. {self.layers[-1]} ({len(self.layers)} layers)"


class GraphSplit:
    """A flattened model's blocks, and the stage models any contiguous grouping of them makes."""

    def __init__(self, model: keras.Model, example_shapes: list[tuple[int, ...]]):
        self.model = model
        self.flat = flatten(model, example_shapes)
        nodes = [
            node
            for depth in sorted(self.flat._nodes_by_depth, reverse=True)
            for node in self.flat._nodes_by_depth[depth]
            if node.operation is not None and not node.is_input
        ]
        self.nodes = nodes
        made_at = {id(t): -1 for t in self.flat.inputs}
        for i, node in enumerate(nodes):
            for t in node.outputs:
                made_at[id(t)] = i
        self.made_at = made_at
        last_use: dict[int, int] = {}
        for i, node in enumerate(nodes):
            for t in node.input_tensors:
                last_use[id(t)] = i
        for t in self.flat.outputs:
            last_use[id(t)] = len(nodes)
        self.last_use = last_use
        self.tensors = {id(t): t for t in self.flat.inputs}
        self.tensors |= {id(t): t for node in nodes for t in node.outputs}
        weightless = {id(t) for t in self.flat.inputs}
        for node in nodes:  # tensors computed from inputs alone, with no weights on the way
            if not getattr(node.operation, "weights", None) and all(
                id(t) in weightless for t in node.input_tensors
            ):
                weightless |= {id(t) for t in node.outputs}
        self.weightless = weightless
        uses: dict[int, list[int]] = {}
        for i, node in enumerate(nodes):
            uses.setdefault(id(node.operation), []).append(i)
        cuts = [i for i in range(1, len(nodes)) if self._valid_cut(i, uses)]
        starts = [0, *cuts]
        ends = [*cuts, len(nodes)]
        self.block_starts = starts
        self.blocks = [self._block(a, b) for a, b in zip(starts, ends, strict=True)]

    def crossing(self, cut: int) -> list:
        """Tensors made before call `cut` and needed at or after it, inputs first, then in the
        order they were made (the same order on both sides of the cut)."""
        crossing = [
            t
            for key, t in self.tensors.items()
            if self.made_at[key] < cut <= self.last_use.get(key, -1)
        ]
        return sorted(crossing, key=lambda t: self.made_at[id(t)])

    def _valid_cut(self, cut: int, uses: dict[int, list[int]]) -> bool:
        weighted = [t for t in self.crossing(cut) if id(t) not in self.weightless]
        if len(weighted) > 1:
            return False
        return all(min(at) >= cut or max(at) < cut for at in uses.values())

    def _block(self, a: int, b: int) -> Block:
        layers = [self.nodes[i].operation for i in range(a, b)]
        unique = list({id(layer): layer for layer in layers}.values())
        params = sum(
            int(np.prod(v.shape))
            for layer in unique
            for v in getattr(layer, "trainable_weights", [])
        )
        return Block([layer.name for layer in layers], params)

    def check(self, n_stages: int) -> None:
        """Enough blocks for the stages, or one line naming the largest that cannot be cut."""
        if len(self.blocks) >= n_stages:
            return
        largest = max(self.blocks, key=lambda block: len(block.layers))
        raise UserError(
            f"model {self.model.name!r} has {len(self.blocks)} block(s) between valid cuts, too "
            f"few for {n_stages} stages; the largest that cannot be cut is {largest.describe()}"
        )

    def bounds_at(self, names: list[str], n_stages: int) -> list[tuple[int, int]]:
        """--split-at: each named layer begins a stage; it must begin a block."""
        if len(names) != n_stages - 1:
            raise UserError(
                f"--split-at names {len(names)} layer(s); {n_stages} stages need {n_stages - 1}"
            )
        firsts = {block.layers[0]: i for i, block in enumerate(self.blocks)}
        cuts = []
        for name in names:
            if name in firsts:
                cuts.append(firsts[name])
                continue
            inside = next((b for b in self.blocks if name in b.layers), None)
            if inside is not None:
                raise UserError(
                    f"--split-at {name}: the layer lies inside the block {inside.describe()}, "
                    "which cannot be cut there"
                )
            known = ", ".join(list(firsts)[:6])
            raise UserError(f"--split-at {name}: no such layer (blocks begin at {known}, ...)")
        if cuts != sorted(set(cuts)) or 0 in cuts:
            raise UserError("--split-at: name the layers in model order, after the first layer")
        starts = [0, *cuts]
        return list(zip(starts, [*cuts, len(self.blocks)], strict=True))

    def stage_models(self, bounds: list[tuple[int, int]]) -> list[keras.Model]:
        """One keras.Model per stage (bounds over blocks), sharing the user's layers."""
        pieces = []
        for s, (a, b) in enumerate(bounds):
            start = self.block_starts[a]
            end = self.block_starts[b] if b < len(self.blocks) else len(self.nodes)
            inputs = list(self.flat.inputs) if s == 0 else self.crossing(start)
            outputs = list(self.flat.outputs) if b == len(self.blocks) else self.crossing(end)
            if s > 0:  # Keras cannot output an intermediate input as it is: pass it through
                outputs = [
                    _passed(t, f"{self.model.name}_stage{s}_{j}") if t in inputs else t
                    for j, t in enumerate(outputs)
                ]
            pieces.append(keras.Model(inputs, outputs, name=f"{self.model.name}_stage{s}"))
        return pieces


def _passed(tensor, name: str):
    """A tensor that crosses a stage untouched (a padding mask), through a weightless layer."""
    return keras.layers.Identity(name=name)(tensor)


def split_graph(model: keras.Model, x) -> GraphSplit:
    """The model's split, for examples `x` (an array, or a dict keyed by input name)."""
    graph = _graph(model)
    names = [t.name for t in graph.inputs] if graph is not None else []
    if isinstance(x, dict):
        missing = [name for name in names if name not in x]
        if missing:
            raise UserError(f"the data has no input named {missing[0]} (it has {sorted(x)})")
        shapes = [tuple(x[name].shape[1:]) for name in names]
    else:
        shapes = [tuple(x.shape[1:])] * len(names)
    return GraphSplit(model, shapes)
