"""The one type check of the config dataclasses (model, attention, optimiser, sampling): a value
of the wrong type, such as `optim.lr=abc` from the shell, is a one-line error naming the key,
before any range check compares it with a number."""

import dataclasses
import types
from typing import Union, get_args, get_origin

NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _fits(value: object, expected: object) -> bool:
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected in (str, bool):
        return isinstance(value, expected)
    if dataclasses.is_dataclass(expected):
        return isinstance(value, expected | dict)  # a nested config, or its dict from Hydra
    return True  # containers and the like: the config's own checks look inside


def check_field_types(config: object, prefix: str) -> None:
    """Raise a ValueError for the first field of the dataclass `config` whose value is not of
    its annotated type (an int passes for a float; a bool is never a number)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        union = get_origin(field.type) in (Union, types.UnionType)
        expected = get_args(field.type) if union else (field.type,)
        if not any(_fits(value, kind) for kind in expected):
            kinds = " or ".join(
                NAMES.get(k, "null" if k is type(None) else str(k)) for k in expected
            )
            raise ValueError(f"{prefix}{field.name} must be {kinds}, got {value!r}")
