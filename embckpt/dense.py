"""Dense modules, the dense optimizer, RNG and data-iterator state: capture, encode, apply.

Everything that is not an embedding table is small next to the tables and is saved whole at
every checkpoint. Nested state (optimizer state dicts, RNG tuples, iterator dicts) is flattened
into a safetensors file: tensors as tensors, the structure as tagged JSON in the file's header.
Loading never unpickles anything, so a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import safetensors.torch
import torch
from torch import nn

_STRUCT_KEY = "embckpt.structure"


class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (data iterators, LR schedulers)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def encode_tree(tree: Any) -> bytes:
    """Serialises nested dicts / lists / tuples of tensors, numpy arrays and JSON scalars."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = node.detach().cpu().contiguous()
            return {"__tensor__": name}
        if isinstance(node, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = torch.from_numpy(np.ascontiguousarray(node))
            return {"__ndarray__": name}
        if isinstance(node, Mapping):
            return {"__dict__": [[walk(k), walk(v)] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {"__tuple__": [walk(v) for v in node]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, np.generic):
            return node.item()
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot save a {type(node).__name__} in a checkpoint")

    structure = walk(tree)
    return safetensors.torch.save(tensors, metadata={_STRUCT_KEY: json.dumps(structure)})


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
    and the fused optimizer's per-table scalars (e.g. Adam's step)."""
    return {
        "model": {k: v for k, v in model.state_dict().items() if k not in skip_keys},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "fused_scalars": dict(scalar_states),
    }


def rank_state(statefuls: Mapping[str, Stateful]) -> dict[str, Any]:
    """This rank's own state: RNG streams and each stateful object (data iterator, ...)."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"rng": rng, "statefuls": {name: obj.state_dict() for name, obj in statefuls.items()}}


@torch.no_grad()
def apply_dense_state(
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: Any | None,
    scalar_states: Mapping[str, torch.Tensor],
) -> None:
    """Loads a :func:`dense_state` into the live model and optimizer, in place."""
    live = model.state_dict()
    for key, value in state["model"].items():
        live[key].copy_(value)
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    for key, value in state["fused_scalars"].items():
        scalar_states[key].copy_(value)


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
