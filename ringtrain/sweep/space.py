"""A sweep's search space: a YAML or JSON file mapping each parameter to its range.

    lr: {type: float, low: 1.0e-4, high: 0.3, log: true}
    batch-size: {type: int, low: 32, high: 256, step: 32}
    model-arg.units: {type: categorical, choices: [32, 64, 128]}

A name is a `ringtrain train` flag without its dashes, or `model-arg.KEY` for `--model-arg
KEY=VALUE`. Pure data: no Optuna, TensorFlow or MPI here, so a space is checked in
milliseconds, before a launch starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from ringtrain.errors import UserError

TYPES = ("float", "int", "categorical")
MODEL_ARG = "model-arg."
KEYS = {
    "float": {"type", "low", "high", "log", "step", "choices"},
    "int": {"type", "low", "high", "log", "step", "choices"},
    "categorical": {"type", "choices"},
}


@dataclass(frozen=True)
class Param:
    """One dimension of the space; `choices`, when listed, are its only values."""

    name: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple | None = None

    def grid_values(self) -> list:
        """The values a grid visits: its choices, or every step of an int range."""
        if self.choices is not None:
            return list(self.choices)
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        raise UserError(
            f"search space: {self.name}: the grid sampler needs listed values (choices: [...]) "
            "for a float range"
        )

    def flags(self, value) -> list[str]:
        """The `train` flags that set this parameter to `value`."""
        if self.name.startswith(MODEL_ARG):
            return ["--model-arg", f"{self.name[len(MODEL_ARG) :]}={value!r}"]
        if isinstance(value, bool):
            return [f"--{self.name}"] if value else [f"--no-{self.name}"]
        return [f"--{self.name}", str(value)]


def load_space(path: str) -> list[Param]:
    """The space in `path` (.yaml, .yml or .json), checked; a fault is named in one line."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise UserError(f"search space {path}: {exc.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as exc:  # a parser's own error, in one line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"search space {path}: not valid YAML/JSON: {first}") from None
    return parse_space(raw, path)


def parse_space(raw, where: str = "search space") -> list[Param]:
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{where}: expected a mapping of parameter names to ranges")
    return [_param(str(name), spec, where) for name, spec in raw.items()]


def _param(name: str, spec, where: str) -> Param:
    said = f"{where}: {name}"
    a_number = "an int" if spec.get("type") == "int" else "a number"
    if not isinstance(spec, dict):
        raise UserError(f"{said}: expected a mapping such as {{type: float, low: 0.01, high: 1}}")
    kind = spec.get("type")
    if kind not in TYPES:
        raise UserError(f"{said}: unknown type {kind!r}; one of {', '.join(TYPES)}")
    unknown = set(spec) - KEYS[kind]
    if unknown:
        raise UserError(f"{said}: unknown key(s) {', '.join(sorted(unknown))} for type {kind}")
    choices = spec.get("choices")
    if choices is not None or kind == "categorical":
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{said}: choices must be a non-empty list")
        if len({json.dumps(c) for c in choices}) < len(choices):
            raise UserError(f"{said}: choices repeat a value")
        if set(spec) & {"low", "high", "log", "step"}:
            raise UserError(f"{said}: give either choices or low/high, not both")
        if kind != "categorical" and not all(_is_number(c, kind == "int") for c in choices):
            raise UserError(
                f"{said}: every choice must be {'an int' if kind == 'int' else 'a number'}"
            )
        return Param(name, kind, choices=tuple(choices))
    for key in ("low", "high"):
        if key not in spec:
            raise UserError(f"{said}: a {kind} range needs low and high (or choices)")
        if not _is_number(spec[key], kind == "int"):
            raise UserError(f"{said}: {key} must be {a_number}")
    low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
    if low > high:
        raise UserError(f"{said}: low {low} is above high {high}")
    if not isinstance(log, bool):
        raise UserError(f"{said}: log must be true or false")
    if log and low <= 0:
        raise UserError(f"{said}: log: true needs low above 0 (got {low})")
    if step is not None and (not _is_number(step, kind == "int") or step <= 0 or log):
        raise UserError(f"{said}: step must be a positive {kind}, without log: true")
    return Param(name, kind, low, high, log, step)


def _is_number(value, integral: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integral else isinstance(value, (int, float))


def check_names(space: Iterable[Param], is_flag: Callable[[str], bool]) -> None:
    """Every name must set something: a `train` flag that takes a value, or a model argument."""
    for p in space:
        if p.name.startswith(MODEL_ARG):
            if not p.name[len(MODEL_ARG) :].isidentifier():
                raise UserError(f"search space: {p.name}: model-arg.KEY needs a KEY such as units")
        elif not is_flag(p.name):
            raise UserError(
                f"search space: {p.name} names no `ringtrain train` flag (use e.g. lr, "
                "batch-size, or model-arg.KEY for --model-arg KEY=VALUE)"
            )


def as_record(space: Iterable[Param]) -> str:
    """The space as one canonical JSON text: what a study remembers to refuse another space."""
    return json.dumps({p.name: _without_defaults(p) for p in space}, sort_keys=True)


def _without_defaults(p: Param) -> dict:
    kept = {k: v for k, v in asdict(p).items() if k != "name" and v not in (None, False)}
    if "choices" in kept:
        kept["choices"] = list(kept["choices"])
    return kept
