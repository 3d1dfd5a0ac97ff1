"""Compiled stage functions called without TensorFlow's per-call costs.

`CompiledCall` calls a tf.function through its concrete functions, found by the arguments'
shapes, dtypes and Python values: TensorFlow's own lookup binds and hashes the whole signature
on every call, which a profile of 1-example microbatches put near a compiled call's cost.

`KeptPair` is a compiled forward that keeps its activations, and its backward, without a tape.
Under a GradientTape, TensorFlow runs a tf.function as a pair of compiled functions: a
forward that also returns the intermediates its gradient needs, and a backward that takes
them with the output gradients. An eager tape around that pair (recording the call, watching
every variable, matching outputs at the gradient) cost about 1 ms per microbatch on these
cores: more than a small stage's compute. Here the executor calls the pair itself: the
forward's extra outputs are the microbatch's kept activations, and the backward runs inside
one compiled call that also adds the weight gradients into the stage's sums.

The pair is TensorFlow's own (its first-order tape functions, a private class). The
TensorFlow version is pinned, and a test holds the pair's gradients to a tape's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ringtrain.tensorflow_loader import tf

# isort: split
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.python.framework import ops


def call_key(args: tuple) -> tuple[list, tuple]:
    """(the tensors in order, a key of every tensor's dtype and shape and every other value):
    what picks a traced function. A numpy value counts as a tensor, as a tf.function takes
    it; `as_traced` makes the arguments a trace takes."""
    leaves = [_as_tensor(leaf) for leaf in tf.nest.flatten(args)]
    tensors = [leaf for leaf in leaves if isinstance(leaf, tf.Tensor)]
    key = tuple(  # an eager tensor's shape tuple: its TensorShape costs more to build
        (leaf.dtype, leaf._shape_tuple()) if isinstance(leaf, tf.Tensor) else leaf
        for leaf in leaves
    )
    return tensors, key


def as_traced(args: tuple) -> tuple:
    """The arguments with numpy values as tensors: only a trace needs them packed again,
    which costs more than a small stage's call to do on every one."""
    return tf.nest.map_structure(_as_tensor, args)


def _as_tensor(leaf):
    """A numpy value as a tensor, as a tf.function takes it (a Python number is not one)."""
    return tf.convert_to_tensor(leaf) if isinstance(leaf, np.ndarray | np.generic) else leaf


def pack_outputs(structure, values: list):
    """`values` in `structure`'s nesting: a flat tuple or a single tensor directly, as tf.nest
    takes several times a small stage's dispatch of one op to do it."""
    if isinstance(structure, tf.Tensor):
        return values[0]
    if type(structure) is tuple and all(isinstance(s, tf.Tensor) for s in structure):
        return tuple(values[: len(structure)])
    return tf.nest.pack_sequence_as(structure, values[: len(tf.nest.flatten(structure))])


class CompiledCall:
    """A tf.function called through the concrete function its arguments pick."""

    def __init__(self, function):
        self.function = function
        self.concrete: dict[tuple, object] = {}

    def __call__(self, *args):
        if not tf.executing_eagerly():  # inside another graph: that graph's call, traced once
            return self.function(*args)
        tensors, key = call_key(args)
        found = self.concrete.get(key)
        if found is None:
            concrete = self.function.get_concrete_function(*as_traced(args))
            found = self.concrete[key] = (concrete, concrete.captured_inputs)
        concrete, captured = found
        return concrete._call_flat(tensors, captured)


@dataclass
class _Pair:
    """One traced signature's forward and backward, and how their values line up."""

    forward: object  # an atomic function: inputs, then outputs and the kept intermediates
    captured: list  # the forward's captured inputs (the variables' handles among them)
    structure: object  # the outputs' nesting
    n_outputs: int
    n_inputs: int  # tensors of the first argument (what crosses into the stage)
    backward: object  # a concrete function: output gradients in, input gradients out
    feeds: list[int | None]  # per backward capture: the forward output it is, or None
    variables: list[int | None]  # per weight: its input position (None: unused, no gradient)
    values: list  # a TensorSpec per forward output: what the backward is traced for
    relaxed: bool  # whether the trace takes any batch size (a partial batch's microbatches)
    # first -> the backward that also adds into the sums, and its captured inputs
    backward_calls: dict = field(default_factory=dict)


@dataclass
class Kept:
    """A microbatch's kept activations: everything its forward returned."""

    pair: _Pair
    values: list


class KeptPair:
    """`function`'s forward and backward pairs, one per traced signature."""

    def __init__(self, function, variables: Sequence, add_into_sums: Callable):
        """`add_into_sums(grads, first)` adds the weights' gradients into the sums inside the
        backward's graph and returns what it kept aside (an embedding's slices)."""
        self.function, self.variables, self.add_into_sums = function, list(variables), add_into_sums
        self.pairs: dict[tuple, _Pair] = {}  # by the arguments' key
        # by traced function: once shapes relax, arguments of a new shape reuse a trace, and
        # a second pair built on one trace would find the first's outputs added to its graph
        self.traced: dict[bytes | str, _Pair] = {}

    def forward(self, *args) -> tuple[object, Kept]:
        """The function's outputs, and what its backward will need."""
        tensors, key = call_key(args)
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = self._pair(as_traced(args), tensors)
        values = pair.forward.call_flat(*tensors, *pair.captured)
        return pack_outputs(pair.structure, values[: pair.n_outputs]), Kept(pair, list(values))

    def backward(self, kept: Kept, seeds: list | None, first: bool) -> tuple[list, dict]:
        """(gradients of the first argument's tensors, the kept-aside weight gradients),
        from the output gradients `seeds` (None: the output is a loss, seeded with one). The
        weights' gradients are written into the sums (`first`) or added to them."""
        pair = kept.pair
        found = pair.backward_calls.get(first)
        if found is None:  # traced for the pair's shapes: one concrete function per `first`
            function = tf.function(lambda s, v: self._backward_graph(pair, s, v, first))
            specs = None if seeds is None else [seed_spec(s, pair.relaxed) for s in seeds]
            call = function.get_concrete_function(specs, pair.values)
            found = pair.backward_calls[first] = (call, call.captured_inputs)
        call, captured = found
        tensors = kept.values if seeds is None else [*seeds, *kept.values]
        return call._call_flat(tensors, captured)

    def _backward_graph(self, pair: _Pair, seeds, values: list, first: bool):
        if seeds is None:
            seeds = [tf.ones_like(values[0])]
        captures = [
            own if at is None else values[at]
            for own, at in zip(pair.backward.captured_inputs, pair.feeds, strict=True)
        ]
        grads = pair.backward._call_flat(list(seeds), captures)
        weights = [None if i is None else grads[i] for i in pair.variables]
        kept_aside = self.add_into_sums(weights, first)
        return list(grads[: pair.n_inputs]), kept_aside

    def _pair(self, args: tuple, tensors: list) -> _Pair:
        concrete = self.function.get_concrete_function(*args)
        if concrete.name not in self.traced:
            self.traced[concrete.name] = self._new_pair(concrete, args, tensors)
        return self.traced[concrete.name]

    def _new_pair(self, concrete, args: tuple, tensors: list) -> _Pair:
        functions = concrete_function._FirstOrderTapeGradientFunctions(
            concrete._func_graph,
            concrete._attrs,
            concrete._garbage_collector,
            forwardprop_input_indices=(),
            delayed_rewrite_functions=concrete._delayed_rewrite_functions,
            need_gradients_for_jvps=False,
        )
        captured = list(concrete.captured_inputs)
        forward = functions.forward(tensors + captured, [])
        outputs = functions._forward_graph.outputs
        made = {ops.tensor_id(t): i for i, t in enumerate(outputs)}
        backward = functions._backward
        handles = {id(h): len(tensors) + j for j, h in enumerate(captured)}
        return _Pair(
            forward=forward,
            captured=captured,
            structure=concrete.structured_outputs,
            n_outputs=functions._num_inference_outputs,
            n_inputs=len(tf.nest.flatten(args[0])),
            backward=backward,
            feeds=[made.get(ops.tensor_id(c)) for c in backward.captured_inputs],
            variables=[handles.get(id(v.value.handle)) for v in self.variables],
            values=[tf.TensorSpec(t.shape, t.dtype) for t in outputs],
            relaxed=not all(t.shape.is_fully_defined() for t in concrete.inputs[: len(tensors)]),
        )


def seed_spec(seed, relaxed: bool) -> tf.TensorSpec:
    """What a backward is traced for from an output gradient: any batch size when relaxed."""
    shape = seed.shape.as_list()
    return tf.TensorSpec([None, *shape[1:]] if relaxed and shape else shape, seed.dtype)
