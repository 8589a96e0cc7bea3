"""The state dict the memory tier copies after every step, taken once and handed again while
it holds the live tensors: DCP's `get_state_dict` walks every module and parameter name (2 ms a
call on the debug preset, on the loop's path between two steps), yet its tensors share the live
ones' storage, which does not move from step to step. A load that replaces tensors (a resume, a
rollback), a parameter swapped or a storage moved changes the signature, and the state dict is
taken afresh. What is not a tensor (the optimizer's param groups: the learning rate changes
every step) is read afresh every time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

_GROUPS = "param_groups"


class StateView:
    """`get()`: {"model": ..., "optim": ...} as `get_state_dict` gives it, its tensor
    containers the same objects while they hold the live tensors (the copy's plan keys on
    them), its param groups fresh."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._state: dict[str, Any] | None = None
        self._signature: tuple | None = None
        self._fqns: list[list[str]] = []
        self._values_only_in_groups = False
        self.taken = 0  # how many times the state dict was taken (for the tests)

    def get(self) -> dict[str, Any]:
        signature = self.signature()
        if self._state is None or signature != self._signature or not self._reusable():
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            self.taken += 1
            self._state = {"model": model_sd, "optim": optim_sd}
            self._signature = signature
            self._fqns = [list(g["params"]) for g in optim_sd.get(_GROUPS, [])]
            rest = {k: v for k, v in optim_sd.items() if k != _GROUPS}
            self._values_only_in_groups = _tensors_only(model_sd) and _tensors_only(rest)
            return self._state
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)}
            for group, fqns in zip(self.optimizer.param_groups, self._fqns, strict=True)
        ]
        return {"model": self._state["model"], "optim": {**self._state["optim"], _GROUPS: groups}}

    def signature(self) -> tuple:
        """What the cached state dict's tensors depend on: every parameter and buffer (object
        and storage), the optimizer's state (its dict, each parameter's entry and tensors) and
        its param groups (the list, each group and its parameters)."""
        opt = self.optimizer
        live = [*self.model.parameters(), *self.model.buffers()]
        state = [
            (id(entry), *((id(v), _ptr(v)) for v in entry.values()))
            for group in opt.param_groups
            for p in group["params"]
            if (entry := opt.state.get(p)) is not None
        ]
        groups = [(id(g), *map(id, g["params"])) for g in opt.param_groups]
        return (
            tuple((id(t), _ptr(t)) for t in live),
            id(opt.state),
            len(opt.state),
            id(opt.param_groups),
            tuple(groups),
            tuple(state),
        )

    def _reusable(self) -> bool:
        """The cached dict may be handed again only when all it holds besides tensors is the
        param groups (refreshed here) and no hook reshapes the optimizer's state dict."""
        opt = self.optimizer
        hooks = getattr(opt, "_optimizer_state_dict_pre_hooks", None) or getattr(
            opt, "_optimizer_state_dict_post_hooks", None
        )
        return self._values_only_in_groups and not hooks


def _ptr(t: Any) -> int:
    if isinstance(t, DTensor):
        return t._local_tensor.data_ptr()
    return t.data_ptr() if isinstance(t, torch.Tensor) else id(t)


def _tensors_only(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    if isinstance(tree, dict):
        return all(_tensors_only(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_tensors_only(v) for v in tree)
    return False
