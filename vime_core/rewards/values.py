"""What a reward is, in one place: `as_reward(v)` = float(v) for a finite real number (int, float, bool,
any numbers.Real, numpy.bool_, a 0-d numpy array or torch tensor); anything else (complex, str, None,
a list, NaN, +-Inf) raises InvalidRewardError naming the type, never the value (it may be private)."""

from __future__ import annotations

import math
import numbers
from typing import Any


class InvalidRewardError(TypeError):
    """A reward function returned something that is not a finite real number. `what` says what
    it returned ("returned str", "returned a non-finite float") without the value."""

    def __init__(
        self, what: str, expected: str = "a finite real number (int, float, bool, a numpy or torch scalar)"
    ) -> None:
        super().__init__(f"the reward function {what}; expected {expected}")
        self.what, self.expected = what, expected

    def __reduce__(self):  # rebuilt from its arguments when it crosses Ray, not from its message
        return type(self), (self.what, self.expected)


def type_name(value: Any) -> str:
    """`value`'s type as a user knows it (numpy.ndarray[complex64], torch.Tensor[shape (1,)]),
    never its value."""
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and tuple(shape) != ():
        return f"{name}[shape {tuple(shape)}]"
    return f"{name}[{dtype}]" if dtype is not None and not isinstance(value, numbers.Number) else name


def as_reward(value: Any) -> float:
    """The reward `value` stands for, as a float (module docstring); InvalidRewardError else."""
    item = value
    zero_dim = getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None))
    if zero_dim and not isinstance(value, numbers.Number):
        item = value.item()  # numpy.bool_, a 0-d numpy array or torch tensor
    if not isinstance(item, numbers.Real):  # bool is an int, hence Real; complex is not
        raise InvalidRewardError(f"returned {type_name(value)}")
    try:
        reward = float(item)
    except OverflowError:
        raise InvalidRewardError(f"returned {type_name(value)} beyond a float's range") from None
    if not math.isfinite(reward):
        raise InvalidRewardError(f"returned a non-finite {type_name(value)} (NaN or Inf)")
    return reward
