"""Dense modules, the dense optimizer, RNG and data-iterator state: capture, encode, apply.

Everything that is not an embedding table is small next to the tables and is saved whole at
every checkpoint. The optimizer a user passes may be a torch optimizer, a TorchRec
``KeyedOptimizer`` or a ``CombinedOptimizer`` that also holds the DMP's fused embedding
optimizer: :func:`optimizer_parts` keeps only the dense parts (the fused state is saved row by
row with the tables). Nested state (optimizer state dicts, RNG tuples, iterator dicts) is flattened
into a safetensors file: tensors as tensors, the structure as tagged JSON in the file's header.
Loading never unpickles anything, so a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import safetensors.torch
import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from embckpt import mch
from embckpt.errors import ConfigError

_STRUCT_KEY = "embckpt.structure"


class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (data iterators, LR schedulers)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


_HOLDS = (
    "dicts, lists, tuples, dense tensors, numpy arrays of numbers, str, int, float, bool and None"
)
_HINTS: dict[type, str] = {
    set: "a sorted list",
    frozenset: "a sorted list",
    bytes: "a uint8 numpy array (np.frombuffer(value, np.uint8))",
    bytearray: "a uint8 numpy array (np.frombuffer(value, np.uint8))",
}


def encode_tree(tree: Any, root: str = "state", metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialises nested dicts / lists / tuples of tensors, numpy arrays and JSON scalars;
    ``metadata`` goes into the header beside the structure (a rank file's index of its rows
    files, ``storage/rank_parts.py``).

    Raises:
        TypeError: a value the format cannot hold, named by its key path from ``root``.
    """
    tensors: dict[str, torch.Tensor] = {}

    def leaf(tag: str, value: torch.Tensor) -> dict[str, str]:
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {tag: name}

    structure = _walk(tree, root, leaf)
    header = {**(metadata or {}), _STRUCT_KEY: json.dumps(structure)}
    return safetensors.torch.save(tensors, metadata=header)


def check_tree(tree: Any, root: str) -> None:
    """Raises the ``TypeError`` :func:`encode_tree` would, without encoding anything: state
    is refused when it is taken, not when its file is written."""
    _walk(tree, root, lambda tag, value: None)


def _walk(node: Any, path: str, leaf: Callable[[str, torch.Tensor], Any]) -> Any:
    """The tagged JSON structure of ``node``, ``leaf`` naming each tensor (the one place that
    decides what the format holds)."""
    if isinstance(node, torch.Tensor):
        if node.layout is not torch.strided or node.is_meta:
            kind = "meta" if node.is_meta else str(node.layout).removeprefix("torch.")
            raise _refused(path, f"a {kind} tensor")
        return leaf("__tensor__", node)
    if isinstance(node, np.ndarray):
        try:
            array = torch.from_numpy(np.ascontiguousarray(node))
        except TypeError:
            raise _refused(path, f"a numpy array of dtype {node.dtype}") from None
        return leaf("__ndarray__", array)
    if isinstance(node, Mapping):
        return {
            "__dict__": [
                [_walk(k, f"{path} (key {k!r})", leaf), _walk(v, f"{path}[{k!r}]", leaf)]
                for k, v in node.items()
            ]
        }
    if isinstance(node, tuple):
        return {"__tuple__": [_walk(v, f"{path}[{i}]", leaf) for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_walk(v, f"{path}[{i}]", leaf) for i, v in enumerate(node)]
    if isinstance(node, np.generic):
        return _walk(node.item(), path, leaf)
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise _refused(path, f"a value of type {type(node).__name__}", _HINTS.get(type(node)))


def _refused(path: str, what: str, instead: str | None = None) -> TypeError:
    hint = f"; convert it to {instead}" if instead else ""
    return TypeError(f"{path}: a checkpoint cannot hold {what} (only {_HOLDS}){hint}")


def decode_tree(data: bytes) -> Any:
    """Inverse of :func:`encode_tree`."""
    tensors = safetensors.torch.load(data)
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    structure = json.loads(header["__metadata__"][_STRUCT_KEY])

    def build(node: Any) -> Any:
        if isinstance(node, list):
            return [build(v) for v in node]
        if isinstance(node, dict):
            if "__tensor__" in node:
                return tensors[node["__tensor__"]]
            if "__ndarray__" in node:
                return tensors[node["__ndarray__"]].numpy()
            if "__tuple__" in node:
                return tuple(build(v) for v in node["__tuple__"])
            return {build(k): build(v) for k, v in node["__dict__"]}
        return node

    return build(structure)


def dense_state(
    model: nn.Module,
    optimizer: Any | None,
    skip_keys: set[str],
    scalar_states: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """The replicated dense state: every model entry that is not a table, the dense optimizer,
    and the fused optimizer's per-table scalars (e.g. Adam's step). Sharded entries that are
    not tables (managed-collision buffers) are per-rank state: see :func:`rank_state`."""
    return {
        "model": {
            k: v
            for k, v in model.state_dict().items()
            if k not in skip_keys and not isinstance(v, (ShardedTensor, DTensor))
        },
        "optimizer": optimizer_state(optimizer_parts(optimizer, model)),
        "fused_scalars": dict(scalar_states),
    }


def stateful_states(statefuls: Mapping[str, Stateful]) -> dict[str, Any]:
    """Each stateful object's ``state_dict()``, checked, so that state a checkpoint cannot
    hold is refused when the save is decided rather than when its file is written.

    Raises:
        TypeError: a value the format cannot hold, named by stateful and key path
            (``statefuls['data']['seen']``).
    """
    states = {name: obj.state_dict() for name, obj in statefuls.items()}
    for name, state in states.items():
        check_tree(state, f"statefuls[{name!r}]")
    return states


def rank_state(
    states: Mapping[str, Any], mch_tables: list[mch.MchTable] | None = None
) -> dict[str, Any]:
    """This rank's own state: RNG streams, each stateful object's state (data iterator, ...)
    as :func:`stateful_states` took it and, for a model with managed-collision modules, their
    buffers and eviction state (``mch``)."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"rng": rng, "statefuls": dict(states)}
    if mch_tables:
        state["mch"] = mch.capture(mch_tables)
    return state


def apply_rank_state(state: Mapping[str, Any], statefuls: Mapping[str, Stateful]) -> None:
    """Restores RNG streams and stateful objects saved by :func:`rank_state`."""
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    for name, obj in statefuls.items():
        obj.load_state_dict(state["statefuls"][name])


def detached_copy(tree: Any) -> Any:
    """A copy of every tensor in a state tree, so training may go on changing the originals."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, Mapping):
        return {k: detached_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(detached_copy(v) for v in tree)
    return tree


_WHAT_TO_PASS = (
    "pass the dense optimizer (a torch optimizer or torchrec KeyedOptimizerWrapper over "
    "in_backward_optimizer_filter(dmp.named_parameters())), or "
    "CombinedOptimizer([dmp.fused_optimizer, dense_optimizer])"
)


def optimizer_parts(optimizer: Any | None, model: nn.Module) -> list[tuple[str, Any]]:
    """The parts of ``optimizer`` saved through the dense path, named, in order.

    A ``CombinedOptimizer`` is split (recursively); its fused embedding parts (those of
    ``model.fused_optimizer``, or any part over sharded tensors) are left out, because their
    state is saved row by row with the tables.

    Raises:
        ConfigError: a part is not an optimizer, mixes table and dense parameters, or updates
            parameters that are not the model's; the message says what to pass instead.
    """
    if optimizer is None:
        return []
    fused_ids = {id(leaf) for _, leaf in _leaves(getattr(model, "fused_optimizer", None), "")}
    model_params = {id(p) for p in model.parameters()}
    parts = []
    for name, leaf in _leaves(optimizer, ""):
        where = f"optimizer part {name!r} ({type(leaf).__name__})" if name else "optimizer"
        missing = [
            attr
            for attr in ("state_dict", "load_state_dict", "step")
            if not callable(getattr(leaf, attr, None))
        ]
        if missing or not hasattr(leaf, "param_groups") or not hasattr(leaf, "state"):
            raise ConfigError(
                f"{where}: a {type(leaf).__name__} is not an optimizer (no "
                f"{', '.join(missing) or 'param_groups/state'}); {_WHAT_TO_PASS}"
            )
        if id(leaf) in fused_ids:
            continue
        params = [p for group in leaf.param_groups for p in group["params"]]
        sharded = [isinstance(p, (ShardedTensor, DTensor)) for p in params]
        if params and all(sharded):
            continue  # a fused embedding optimizer built outside this model's DMP
        if any(sharded):
            raise ConfigError(
                f"{where} mixes sharded table parameters with dense ones; {_WHAT_TO_PASS}"
            )
        if any(hasattr(p, "_in_backward_optimizers") for p in params):
            raise ConfigError(
                f"{where} updates embedding tables that their fused optimizer already updates "
                f"in backward; {_WHAT_TO_PASS}"
            )
        if any(id(p) not in model_params for p in params):
            raise ConfigError(
                f"{where} updates parameters that are not the model's (another model's "
                f"optimizer?); {_WHAT_TO_PASS}"
            )
        parts.append((name, leaf))
    return parts


def moving_rows(parts: list[tuple[str, Any]]) -> dict[int, torch.Tensor | None]:
    """The rows a dense optimizer part can change without a gradient, per parameter (keyed by
    storage address): rows whose state (momentum, Adam's moments) is non-zero, or every row
    (None) under weight decay. Parameters with neither are left out.

    A data-parallel table is updated by the dense optimizer, so a row keeps moving after its
    last lookup (momentum) or without one (weight decay): the touched-row bitmaps do not cover
    it, and a diff must write it.
    """
    moving: dict[int, torch.Tensor | None] = {}
    for _, optimizer in parts:
        for group in optimizer.param_groups:
            decays = bool(group.get("weight_decay", 0))
            for param in group["params"]:
                if param.dim() != 2:
                    continue
                if decays:
                    moving[param.data_ptr()] = None
                    continue
                rows = None
                for value in optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == param.shape:
                        nonzero = (value != 0).any(dim=1)
                        rows = nonzero if rows is None else rows | nonzero
                if rows is not None:
                    moving[param.data_ptr()] = rows
    return moving


def _leaves(optimizer: Any | None, prefix: str) -> list[tuple[str, Any]]:
    if optimizer is None:
        return []
    if not isinstance(optimizer, CombinedOptimizer):
        return [(prefix, optimizer)]
    out = []
    for index, (key, inner) in enumerate(optimizer.optimizers):
        name = key or str(index)
        out.extend(_leaves(inner, f"{prefix}.{name}" if prefix else name))
    return out


def optimizer_state(parts: list[tuple[str, Any]]) -> Any:
    """What the dense file holds for the optimizer: None, one part's ``state_dict`` (the same
    whether it was passed alone or inside a ``CombinedOptimizer``), or every part's by name."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0][1].state_dict()
    return {"parts": [[name, opt.state_dict()] for name, opt in parts]}


def split_optimizer_state(parts: list[tuple[str, Any]], saved: Any) -> list[tuple[Any, Any]]:
    """Pairs each live part with its saved state (inverse of :func:`optimizer_state`).

    Raises:
        ConfigError: the saved state holds other parts than the live optimizer.
    """
    if not parts or saved is None:
        return []
    if len(parts) == 1 and "parts" not in saved:
        return [(parts[0][1], saved)]
    saved_parts = saved.get("parts") if isinstance(saved, Mapping) else None
    saved_names = [name for name, _ in saved_parts] if saved_parts is not None else ["(one)"]
    live_names = [name for name, _ in parts]
    if saved_parts is None or saved_names != live_names:
        raise ConfigError(
            f"dense optimizer parts: the checkpoint has {saved_names}, the live optimizer "
            f"{live_names}"
        )
    return [(opt, state) for (_, opt), (_, state) in zip(parts, saved_parts, strict=True)]


def param_keys(optimizer: Any) -> dict[Any, torch.Tensor]:
    """The keys the optimizer's ``state_dict`` uses for its parameters: names for a TorchRec
    ``KeyedOptimizer``, running indices for a torch optimizer."""
    if isinstance(optimizer, KeyedOptimizer):
        return dict(optimizer.params.items())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return dict(enumerate(params))


@torch.no_grad()
def create_missing_state(optimizer: Any, keys: set[Any]) -> None:
    """Gives a ``KeyedOptimizer`` state for exactly the parameters ``keys`` before a load (it
    refuses to load into state that does not exist yet, e.g. Adam's before its first step).

    The state is created by a step on zero gradients, after which every parameter and gradient
    is put back bit for bit: unlike ``KeyedOptimizer.init_state``, nothing the optimizer
    updates (weight decay, momentum) is left changed. Torch optimizers load any state as is.
    """
    if not isinstance(optimizer, KeyedOptimizer):
        return
    by_key = param_keys(optimizer)
    state = optimizer.state
    for key, param in by_key.items():
        if key not in keys and param in state:
            del state[param]  # the writer had no state for it either
    missing = [by_key[k] for k in keys if k in by_key and not state.get(by_key[k])]
    if not missing:
        return
    params = list(by_key.values())
    grads = [p.grad for p in params]
    values = [p.detach().clone() for p in missing]
    try:
        for p in params:
            p.grad = None  # torch optimizers skip parameters without gradients
        for p in missing:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for p, value in zip(missing, values, strict=True):
            p.copy_(value)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
