"""The embedded engine's inference copy of the policy: building it, checking its layout still matches the trained
model, and copying the trained weights into it after an optimizer step (ZeRO-3 partitions gathered)."""

from __future__ import annotations

import copy
import functools
import types

import torch


# The module the engine generates with


def _inference_module(model: torch.nn.Module, inference_copy: bool) -> torch.nn.Module:
    """A module of its own to generate with, in eval mode: its own submodules, so its own `training` flags (the model's
    are never touched). With `inference_copy`, new (uninitialised) tensors for the parameters that train or are
    partitioned and for the buffers, filled by `_copy_weights`; otherwise the model's own tensors (a view, no memory).
    Frozen parameters are shared either way: nothing updates them (a LoRA model's base weights cost nothing twice)."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if inference_copy and _copied(p):
            memo[id(p)] = torch.nn.Parameter(
                torch.empty(_full_shape(p), dtype=p.dtype, device=p.device), requires_grad=False
            )
        else:
            memo[id(p)] = p
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b) if inference_copy else b
    # Hooks are shared, not copied: a hook registered on the model (before or after) fires for the engine's forwards
    # as it did when the engine generated with the model itself, and one holding a lock or an event (unpicklable)
    # used to fail every request with "cannot pickle '_thread.lock' object".
    for m in model.modules():
        for name, value in vars(m).items():
            if "hook" in name and isinstance(value, (dict, set)):
                memo[id(value)] = value
    return copy_model(model, memo).eval()


def copy_model(model: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
    """`copy.deepcopy(model, memo)` that runs on its own weights: instance-level `forward` overrides are rebound to the
    copy's parts.

    A wrapper installed on a model's instance keeps what it wraps in its closure, and `copy.deepcopy` copies functions by
    reference: the copy's `forward` still called the source's. TRL's `GRPOTrainer` installs one on the policy (its
    fused LM head, `trl.trainer.utils.add_fused_lm_head`, holding the original bound `forward`), so every copy of a
    trained model generated with the trainer's live weights and training flag: the serving versions of online training
    all served the latest weights (issue 43), and the engine's inference copy ran the trainer's module. Here a
    closure's references to the model's parts (modules, bound methods of them) point at the copy's.

    Example:

    ```python
    >>> serving = copy_model(policy).eval()  # generates with these weights, whatever training does to `policy`
    ```
    """
    memo = {} if memo is None else memo
    clone = copy.deepcopy(model, memo)
    for module in clone.modules():
        forward = vars(module).get("forward")
        if forward is not None:
            module.forward = _rebound(forward, memo, set())
    return clone


def _rebound(value, memo: dict, seen: set):
    """`value` with its references to copied objects (`memo`: id of the original -> the copy) replaced by the copies,
    through bound methods, `functools.partial` and function closures; `value` itself when it holds none."""
    if id(value) in memo and not isinstance(value, types.FunctionType):
        return memo[id(value)]
    if isinstance(value, types.MethodType):
        func, owner = _rebound(value.__func__, memo, seen), memo.get(id(value.__self__), value.__self__)
        return value if func is value.__func__ and owner is value.__self__ else types.MethodType(func, owner)
    if isinstance(value, functools.partial):
        func = _rebound(value.func, memo, seen)
        args = [_rebound(a, memo, seen) for a in value.args]
        keywords = {k: _rebound(v, memo, seen) for k, v in value.keywords.items()}
        unchanged = func is value.func and all(a is b for a, b in zip(args, value.args, strict=True))
        if unchanged and all(keywords[k] is v for k, v in value.keywords.items()):
            return value
        return functools.partial(func, *args, **keywords)
    if not isinstance(value, types.FunctionType) or not value.__closure__ or id(value) in seen:
        return value
    seen.add(id(value))
    contents = []
    for cell in value.__closure__:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            contents.append(cell)
    rebound = [c if isinstance(c, types.CellType) else _rebound(c, memo, seen) for c in contents]
    if all(a is b for a, b in zip(rebound, contents, strict=True)):
        return value
    cells = tuple(c if isinstance(c, types.CellType) else types.CellType(c) for c in rebound)
    function = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
    function.__kwdefaults__ = value.__kwdefaults__
    function.__dict__.update(value.__dict__)  # `functools.wraps`' `__wrapped__`, and the like
    for name in ("__qualname__", "__doc__", "__module__", "__annotations__"):
        setattr(function, name, getattr(value, name))
    return function


def _same_layout(module: torch.nn.Module | None, model: torch.nn.Module, inference_copy: bool) -> bool:
    """Whether `module`, built by `_inference_module` from `model`, still mirrors it: the same names, the model's own
    tensors where they are shared, tensors of the same shape, dtype and device where they are copied (parameters
    replaced by `load_state_dict(assign=True)` or unfrozen need a new module)."""
    if module is None:
        return False
    for mine, theirs, copied in (
        (dict(module.named_parameters()), model.named_parameters(), _copied),
        (dict(module.named_buffers()), model.named_buffers(), lambda b: True),
    ):
        count = 0
        for name, tensor in theirs:
            count += 1
            own = mine.get(name)
            if not (inference_copy and copied(tensor)):
                if own is not tensor:
                    return False
            elif (
                own is None
                or own is tensor
                or own.shape != _full_shape(tensor)
                or own.dtype != tensor.dtype
                or own.device != tensor.device
            ):
                return False
        if count != len(mine):
            return False
    return True


def _copy_weights(model: torch.nn.Module, module: torch.nn.Module) -> None:
    """Copy the model's copied parameters and its buffers into `module`'s, in place, by name."""
    mine = dict(module.named_parameters())
    for name, p in model.named_parameters():
        if mine[name] is not p:
            mine[name].copy_(p.data)
    mine = dict(module.named_buffers())
    for name, b in model.named_buffers():
        mine[name].copy_(b)


def _copied(p: torch.Tensor) -> bool:
    """Whether an inference copy holds a parameter of its own: it trains, or ZeRO-3 partitions it (outside the
    trainer's gathered rollout)."""
    return p.requires_grad or hasattr(p, "ds_shape")


def _partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter whose full tensor is not gathered here."""
    return hasattr(p, "ds_shape") and tuple(p.shape) != tuple(p.ds_shape)


def _full_shape(p: torch.Tensor) -> torch.Size:
    return torch.Size(p.ds_shape) if hasattr(p, "ds_shape") else p.shape


_INTEGERS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _weights_checksum(model: torch.nn.Module) -> list[int]:
    """Per parameter, the sum of its elements' bit patterns read as integers, wrapping: exact, so an edit of any one
    element changes it (a float sum can round it away); one read of the weights (0.3 ms for 1.4M fp32 parameters on
    one CPU thread)."""
    sums = []
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        if (
            flat.element_size() < 4
            and (flat.numel() * flat.element_size()) % 4 == 0 == (flat.storage_offset() * flat.element_size()) % 4
        ):
            flat = flat.view(torch.int32)  # bf16 pairs: int32 sums are as exact and faster
        else:
            flat = flat.view(_INTEGERS_OF_SIZE[flat.element_size()])
        sums.append(flat.sum(dtype=flat.dtype).to(device=sums[0].device if sums else flat.device, dtype=torch.int64))
    return torch.stack(sums).tolist() if sums else []
