"""Leaves of a train step's inputs and outputs that are not arrays are static, as
`eqx.filter_jit` treats them.

An equinox module is a pytree whose leaves include its activation functions; a state
may carry strings, flags or other Python objects. Traced are arrays (`jax.Array`,
`np.ndarray`, NumPy scalars, and `jax.ShapeDtypeStruct` when planning on abstract values)
and Python `int`, `float` and `complex` numbers (weakly typed scalars, as `jax.jit` traces
them: a new learning rate does not plan again), except numbers held by an equinox
`Module`: equinox code tells parameters from settings with `eqx.is_array` inside the step
(`eqx.nn.Dropout.p` would get a gradient that an optimizer state built outside has no
slot for), so those stay Python numbers, as under `eqx.filter_jit`. Every other leaf is
static: functions, strings, other objects, and Python `bool`s everywhere (models branch on
them: `eqx.nn.Dropout.inference`, a `train` flag). A static leaf is

- closed over while the step is traced, so the step sees the object itself;
- part of the input signature and of the plan cache's key: a call with another static
  leaf (another activation function) plans again, and a saved plan made for another one
  is refused; it must therefore be hashable;
- never passed to the planned programs: the arguments they take are the step's arguments
  with every static leaf replaced by None (the same positions, so `batch_argnums` and
  `donate_argnums` keep their meaning).

The step's outputs are split the same way while it is traced: their static leaves (the
activation functions of the returned model) are recorded then and put back into the
outputs of every call.
"""
from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_TRACED_NUMBERS = (int, float, complex)


def is_traced(leaf: Any, in_module: bool = False) -> bool:
    """Whether a pytree leaf is traced (an array, or a Python number outside an equinox
    module) rather than static."""
    if isinstance(leaf, _ARRAYS):
        return True
    return type(leaf) in _TRACED_NUMBERS and not in_module


def traced_mask(tree: Any) -> list[bool]:
    """`is_traced` of each leaf of `tree`, in flattening order."""
    module = getattr(sys.modules.get("equinox"), "Module", None)   # no equinox loaded: no module
    if module is None:
        return [is_traced(leaf) for leaf in jax.tree_util.tree_leaves(tree)]
    mask = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, module)):
        if isinstance(node, module):
            mask.extend(is_traced(leaf, in_module=True) for leaf in jax.tree_util.tree_leaves(node))
        else:
            mask.append(is_traced(node))
    return mask


def describe_static(leaf: Any) -> str:
    """A description of a static leaf that is the same in every process (saved plans
    compare it): the qualified name of a function or class, else its repr without
    memory addresses."""
    module, name = getattr(leaf, "__module__", None), getattr(leaf, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}.{name}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(leaf))


@dataclass(frozen=True)
class StaticLeaves:
    """The static leaves of one pytree: its whole structure, and which flattened
    positions hold which static leaf."""

    tree: Any                      # jax PyTreeDef of the whole pytree
    positions: tuple[int, ...]
    leaves: tuple[Any, ...]

    def insert(self, traced_part: Any) -> Any:
        """The whole pytree from its traced part (static leaves None there)."""
        arrays = jax.tree_util.tree_leaves(traced_part)
        if len(arrays) + len(self.positions) != self.tree.num_leaves:
            raise ValueError(f"autopar: {len(arrays)} array leaves given where {self.tree.num_leaves - len(self.positions)} "
                             f"were split off (structure {self.tree})")
        static = dict(zip(self.positions, self.leaves))
        it = iter(arrays)
        return self.tree.unflatten([static[i] if i in static else next(it) for i in range(self.tree.num_leaves)])


def split_static(tree: Any) -> tuple[Any, StaticLeaves | None]:
    """(`tree` with its static leaves replaced by None, those leaves); `tree` itself and
    None when it has no static leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    positions = tuple(i for i, traced in enumerate(traced_mask(tree)) if not traced)
    if not positions:
        return tree, None
    skip = set(positions)
    traced = treedef.unflatten([None if i in skip else leaf for i, leaf in enumerate(leaves)])
    return traced, StaticLeaves(treedef, positions, tuple(leaves[i] for i in positions))


@dataclass(frozen=True)
class SplitCall:
    """One call's arguments split into what the planned programs take (`args`, `kwargs`:
    static leaves replaced by None) and the static leaves of each argument."""

    args: tuple
    kwargs: dict
    arg_statics: tuple[StaticLeaves | None, ...]
    kwarg_statics: dict[str, StaticLeaves]

    @property
    def cache_key(self) -> tuple:
        """The static leaves by position: equal keys (hash and ==) may share a plan."""
        return (tuple((i, s.positions, s.leaves) for i, s in enumerate(self.arg_statics) if s is not None),
                tuple((k, s.positions, s.leaves) for k, s in sorted(self.kwarg_statics.items())))

    def merge(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The step's whole arguments from their traced parts (arguments without static
        leaves are passed on as the same objects)."""
        args = tuple(a if s is None else s.insert(a) for a, s in zip(args, self.arg_statics))
        kwargs = {k: self.kwarg_statics[k].insert(v) if k in self.kwarg_statics else v for k, v in kwargs.items()}
        return args, kwargs


def split_call(args: tuple, kwargs: dict) -> SplitCall:
    """Split a call's arguments; a static leaf that is not hashable is refused, naming it."""
    parts = [split_static(a) for a in args]
    kparts = {k: split_static(v) for k, v in kwargs.items()}
    call = SplitCall(tuple(p for p, _ in parts), {k: p for k, (p, _) in kparts.items()},
                     tuple(s for _, s in parts), {k: s for k, (_, s) in kparts.items() if s is not None})
    try:
        hash(call.cache_key)
    except TypeError:
        _refuse_unhashable(args, kwargs)
    return call


def _refuse_unhashable(args: tuple, kwargs: dict) -> None:
    for (path, leaf), traced in zip(jax.tree_util.tree_flatten_with_path((args, kwargs))[0],
                                    traced_mask((args, kwargs))):
        if traced:
            continue
        try:
            hash(leaf)
        except TypeError:
            where = (f"args[{path[1].idx}]" if path[0].idx == 0 else f"kwargs[{path[1].key!r}]") \
                + jax.tree_util.keystr(path[2:])
            raise TypeError(
                f"autopar: {where} is a {type(leaf).__name__}, which is neither an array nor hashable. Like "
                f"eqx.filter_jit, autopar treats a leaf that is not an array as static: the step is compiled with it "
                f"as a constant and planned again when it changes, so it must be hashable. Pass it as an array, as "
                f"a hashable value, or as a static field of its module (eqx.field(static=True))") from None


class StaticStep:
    """The step as a function of the traced parts of its arguments: the static leaves of
    `call` are put back before `fun` runs, and the static leaves of its outputs are
    replaced by None and kept (from the latest trace) for `outputs`."""

    def __init__(self, fun: Callable[..., Any], call: SplitCall):
        functools.update_wrapper(self, fun)
        self.fun, self.call = fun, call
        self.out_statics: StaticLeaves | None = None
        self.traced = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.call.merge(args, kwargs)
        out, self.out_statics = split_static(self.fun(*args, **kwargs))
        self.traced = True
        return out

    def outputs(self, out: Any) -> Any:
        """A call's whole outputs from what the planned programs returned."""
        if not self.traced:
            raise RuntimeError("autopar: the step was never traced, so its static outputs are unknown")
        return out if self.out_statics is None else self.out_statics.insert(out)
