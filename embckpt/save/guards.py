"""Holding weight updates back while a snapshot copy runs in the background.

With full pipelining the rows of a checkpoint are copied while the next iteration already runs.
Reads are harmless; writes are not. Weights change in exactly three places: the fused embedding
kernels' backward (weights and their optimizer state, in place), the forward of a kernel whose
optimizer rewrites every row (FBGEMM's EMA in place) and the dense optimizer's step.
A forward hook on every embedding kernel attaches a gradient hook to its output that waits for
the copy (gradient hooks run before the kernel's backward consumes the gradient), a forward
pre-hook on each kernel that rewrites every row waits before its forward, and the ``step`` of
every dense optimizer part waits too (each part of a ``CombinedOptimizer``, so a step through
the combined optimizer or through the part itself is held alike).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from embckpt import dense
from embckpt.sharding import batched_embedding_modules


class UpdateGuard:
    """``hold()`` before a background copy starts, ``release()`` when it ends (or fails).

    Args:
        model: the DMP model whose embedding kernels are hooked.
        optimizer: the optimizer passed to the ``Checkpointer``, or None.
        rewriters: the kernels whose forward rewrites every row (``FusedKernel.every_row``).
    """

    def __init__(self, model: nn.Module, optimizer: Any | None, rewriters: list[nn.Module]) -> None:
        self._released = threading.Event()
        self._released.set()
        self._hooks = [
            batched.emb_module.register_forward_hook(self._guard_output)
            for batched in batched_embedding_modules(model)
        ]
        self._hooks += [
            kernel.register_forward_pre_hook(self._wait_before_forward) for kernel in rewriters
        ]
        # Step pre-hooks do not fire for torchrec's KeyedOptimizerWrapper, which delegates
        # step() to an inner optimizer: wrap each part's own step instead.
        self._wrapped: list[tuple[Any, Any]] = []  # (part, its own instance step or None)
        for _, part in dense.optimizer_parts(optimizer, model):
            self._wrapped.append((part, vars(part).get("step")))
            part.step = self._wrap(part.step)

    def _wrap(self, step: Any) -> Any:
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            self._released.wait()
            return step(*args, **kwargs)

        return guarded_step

    def hold(self) -> None:
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def _guard_output(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._released.is_set() or not isinstance(output, torch.Tensor):
            return
        if output.requires_grad:
            output.register_hook(self._wait_then_pass)
        else:
            self._released.wait()

    def _wait_before_forward(self, _module: nn.Module, _args: Any) -> None:
        self._released.wait()  # returns None: a pre-hook's result would replace the inputs

    def _wait_then_pass(self, grad: torch.Tensor) -> torch.Tensor:
        self._released.wait()
        return grad

    def close(self) -> None:
        """Removes every hook and restores the optimizer's own ``step``."""
        self.release()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for part, own in self._wrapped:
            if own is None:
                del part.step  # the class's step shows through again
            else:
                part.step = own
        self._wrapped = []
