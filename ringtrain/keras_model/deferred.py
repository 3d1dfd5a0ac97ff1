"""A model built without its weights' values, so a pipeline rank allocates its own stages' only.

The user's FUNCTION (or a built-in) runs inside `keras.StatelessScope(initialize_variables=
False)`: every variable it makes keeps its shape, dtype and initializer but holds no value.
Keras's random initializers draw their integer seed when they are made, in the order the
layers are made after `set_random_seed`, so a variable initialised later, alone, gets the
value one process gives it. Values the FUNCTION assigned (weights it loaded to fine-tune) are
recorded by the scope instead of applied; they are kept and become those variables' values.

Inside the scope Keras refuses a variable made from a value rather than an initializer (an
optimizer's step count and learning rate); here such a value becomes an initializer that
returns it, so the compiling FUNCTION runs unchanged.

The variables are taken off Keras's own list of uninitialised variables: Keras initialises
that whole list when any outermost StatelessScope exits, which calling a layer on symbolic
tensors (building a stage's sub-model) does.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from ringtrain.tensorflow_loader import tf

# isort: split
import keras
import numpy as np
from keras.src.backend.common import global_state
from keras.src.backend.common.variables import Variable
from tensorflow.python.ops import resource_variable_ops

_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Pending


class Pending:
    """A model's variables that hold no value yet, and the values its build assigned them."""

    def __init__(self, variables: list, assigned: dict):
        self.variables = {id(v): v for v in variables}
        self.initializers = {id(v): v._initializer for v in variables}
        self.assigned = assigned  # id(variable) -> the value the build gave it

    def materialize(self, variables: Iterable, for_good: bool = True) -> list:
        """Give each pending variable among `variables` its value; returns those it gave. A
        value the build assigned is let go once it is the variable's `for_good`, and kept for
        later while the variable only holds it for a while."""
        made = []
        for variable in variables:
            key = id(variable)
            if key not in self.variables or variable._value is not None:
                continue
            value = self.assigned.pop(key, None) if for_good else self.assigned.get(key)
            if value is None:
                variable._initialize(_made(variable, self.initializers[key]))
            else:
                variable._initialize(value)
            made.append(variable)
        return made

    def release(self, variables: Iterable) -> None:
        """Drop the values of variables materialized for a while (a unit timed alone)."""
        for variable in variables:
            variable._value = None

    def keep_only(self, others: set[int]) -> None:
        """Materialize every pending variable but `others` (by id): the optimizer's, the
        metrics', this rank's layers'. The values the build assigned to `others` are let go
        first, so they are not held while this rank's are made."""
        self.assigned = {key: v for key, v in self.assigned.items() if key not in others}
        self.materialize(v for key, v in self.variables.items() if key not in others)


COMPILED_FROM_BYTES = 16 * 2**20  # a compiled call's own graph costs about 0.2 MiB to keep


def _made(variable, initializer):
    """A variable's value made by its initializer. Eagerly each of the initializer's few steps
    (draw, scale, shift) makes a whole tensor, and the variable copies the last: four times the
    variable's bytes at the peak, measured on a 256 MiB one. In one compiled call the steps run
    in place and only the copy into the variable adds: twice. A large variable is made so."""
    shape, dtype = tuple(variable.shape), variable.dtype
    if math.prod(shape) * np.dtype(dtype).itemsize < COMPILED_FROM_BYTES:
        return initializer(shape, dtype=dtype)
    made = resource_variable_ops.UninitializedVariable(
        shape=shape, dtype=dtype, trainable=variable.trainable, name=variable.name
    )
    quiet = tf.get_logger().level
    tf.get_logger().setLevel("ERROR")  # each variable's own function, traced once: no warning
    try:
        tf.function(lambda: made.assign(initializer(shape, dtype=dtype)))()
    finally:
        tf.get_logger().setLevel(quiet)
    return made


def build_weightless(build: Callable[[], keras.Model]) -> keras.Model:
    """`build()` with every variable it makes left without a value, pending."""
    with keras.StatelessScope(initialize_variables=False) as scope, _values_as_initializers():
        model = build()
    made = global_state.get_global_attribute("uninitialized_variables") or []
    global_state.set_global_attribute("uninitialized_variables", [])
    assigned = {id(v): scope.get_current_value(v) for v in made}
    _PENDING[model] = Pending(made, {k: v for k, v in assigned.items() if v is not None})
    return model


@contextmanager
def _values_as_initializers() -> Iterator[None]:
    made = Variable.__init__

    def init(self, initializer, shape=None, dtype=None, *args, **kwargs):
        if not callable(initializer) and not isinstance(initializer, str):
            value = keras.ops.convert_to_tensor(initializer, dtype=dtype)
            shape, dtype = tuple(value.shape), dtype or value.dtype.name

            def initializer(_shape, dtype=None):
                return value

        made(self, initializer, shape, dtype, *args, **kwargs)

    Variable.__init__ = init
    try:
        yield
    finally:
        Variable.__init__ = made


def pending(model) -> Pending | None:
    """The model's pending variables, if it was built weightless."""
    return _PENDING.get(model)


@contextmanager
def held(model, variables: list) -> Iterator[None]:
    """`variables` hold their values inside the block (a unit timed alone on a rank that will
    not hold it), and pending ones are let go again after."""
    waiting = pending(model)
    made = waiting.materialize(variables, for_good=False) if waiting else []
    try:
        yield
    finally:
        if waiting:
            waiting.release(made)


def set_value(variable, value) -> None:
    """Assign, or first initialise a variable built weightless (rank 0 receiving the stages)."""
    if variable._value is None:
        variable._initialize(value)
    else:
        variable.assign(value)
