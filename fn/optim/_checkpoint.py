"""The checkpoint of the ``torch.optim`` adapter: a :class:`GroupRecord` per param group, as a
plain dict (its layout: ``FunctionalOptimizer.state_dict``), written by :func:`save_state` and
checked, all groups before any is loaded, by :func:`plan_load`.

The functional state is stored flat, keyed by pytree key path (:func:`state_to_dict`), and
rebuilt against the structure of a freshly initialized state. Its error feedback, found by type
(``fn.collectives.error_feedback_leaves``), is sized by the world size and ``local_world_size``,
so a checkpoint of another layout gets it freshly initialized. It is also the only per-rank part
of the state: a rank that loads another rank's record takes its own from
``error_feedback_by_rank`` when the record holds every rank's (:func:`gather_error_feedback`),
else starts from zero (:func:`own_error_feedback`), never from another rank's.
:class:`PerRankState` saves each rank's with ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fn.base import PerRank, SecondMoment, marked_fields
from fn.collectives import ErrorFeedback, PackedSigns, error_feedback_leaves
from fn.collectives.dcp import PER_RANK, rank_key
from fn.optim._step import lr_value, read_lr

_REQUIRED = ("step", "world_size", "shapes", "functional")
_OPTIONAL = ("master", "rank", "error_feedback_by_rank", "local_world_size")


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """The checkpoint of one param group.

    Attributes:
        step: the group's update count ``t`` (skipped steps do not count).
        world_size: the world size it was saved with (error feedback is sized by it).
        shapes: the group's param shapes, in order.
        functional: the functional state flattened by pytree key path (:func:`state_to_dict`).
        master: fp32[n], the master copy of fp16/bf16 params; ``None`` for fp32/fp64 params
            (their own master, saved with the model).
        rank: the rank it was saved on (``None``: not recorded).
        error_feedback_by_rank: the error-feedback entries of ``functional`` of every rank,
            indexed by rank, when they were gathered (:func:`gather_error_feedback`).
        local_world_size: the ranks per node of the transform's hierarchical collectives
            (``None``: flat; then the key is left out).
    """

    step: int
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    functional: dict[str, Any]
    master: torch.Tensor | None = None
    rank: int | None = None
    error_feedback_by_rank: tuple[dict[str, torch.Tensor], ...] | None = None
    local_world_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as stored in ``state_dict()["state"]`` (no key for a ``None`` field)."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        record.update(shapes=[list(s) for s in self.shapes], functional=dict(self.functional))
        if self.error_feedback_by_rank is not None:
            record["error_feedback_by_rank"] = [dict(e) for e in self.error_feedback_by_rank]
        return {k: v for k, v in record.items() if v is not None}

    @classmethod
    def from_dict(cls, record: Any, group: int) -> GroupRecord:
        """Reads a stored record, checking its keys and types.

        Args:
            record: an entry of ``state_dict()["state"]``.
            group: the param group's index (for the messages).

        Returns:
            The record.

        Raises:
            ValueError: the record lacks a key, has an unknown one, or holds a value of the wrong
                type (a checkpoint of something else than ``fn.optim``).
        """
        where = f"param group {group}: the checkpoint's record"
        if not isinstance(record, Mapping):
            raise ValueError(f"{where} is a {type(record).__name__}, not a dict")
        missing = [k for k in _REQUIRED if k not in record]
        unknown = sorted(str(k) for k in record if k not in _REQUIRED + _OPTIONAL)
        problems = [f"lacks {missing}"] if missing else []
        problems += [f"has unknown keys {unknown}"] if unknown else []
        if problems:
            raise ValueError(
                f"{where} {' and '.join(problems)}; an fn.optim record has {list(_REQUIRED)} "
                "and, for fp16/bf16 params, 'master'"
            )
        functional = record["functional"]
        if not isinstance(functional, Mapping) or not all(isinstance(k, str) for k in functional):
            raise ValueError(f"{where}: 'functional' must be a dict keyed by key path strings")
        master = record.get("master")
        if master is not None and not isinstance(master, torch.Tensor):
            raise ValueError(f"{where}: 'master' must be a tensor, got {type(master).__name__}")
        world_size = _integer(record["world_size"], f"{where}: 'world_size'", minimum=1)
        rank = record.get("rank")
        if rank is not None:
            rank = _integer(rank, f"{where}: 'rank'", minimum=0)
            if rank >= world_size:
                raise ValueError(f"{where}: 'rank' {rank} is not below its world_size {world_size}")
        level = record.get("local_world_size")
        if level is not None:
            level = _integer(level, f"{where}: 'local_world_size'", minimum=1)
            if world_size % level:
                raise ValueError(
                    f"{where}: 'local_world_size' {level} does not divide its world_size "
                    f"{world_size}"
                )
        return cls(
            step=_integer(record["step"], f"{where}: 'step'", minimum=0),
            world_size=world_size,
            shapes=_shapes(record["shapes"], f"{where}: 'shapes'"),
            functional=dict(functional),
            master=master,
            rank=rank,
            error_feedback_by_rank=_by_rank(
                record.get("error_feedback_by_rank"), world_size, where
            ),
            local_world_size=level,
        )

    def check_shapes(self, group: int, shapes: Sequence[tuple[int, ...]]) -> None:
        """Raises ``ValueError`` unless the record's param shapes are ``shapes``."""
        if len(self.shapes) != len(shapes):
            raise ValueError(
                f"the checkpoint does not match this model: param group {group} has "
                f"{len(self.shapes)} params in the checkpoint, {len(shapes)} here"
            )
        for i, (saved, current) in enumerate(zip(self.shapes, shapes, strict=True)):
            if saved != tuple(current):
                raise ValueError(
                    f"the checkpoint does not match this model: param group {group}, param {i} "
                    f"has shape {saved} in the checkpoint, {tuple(current)} here"
                )


def _integer(value: Any, what: str, minimum: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return number


def _shapes(value: Any, what: str) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        try:
            return tuple(tuple(_integer(d, what, 0) for d in s) for s in value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{what} must be a list of shapes (lists of ints >= 0), got {value!r}")


def state_to_dict(state: Any) -> dict[str, Any]:
    """The leaves of a functional state keyed by their pytree key path (``".exp_avg"``)."""
    leaves, _ = pytree.tree_flatten_with_path(state)
    return {pytree.keystr(path): leaf for path, leaf in leaves}


def state_from_dict(
    group: int, saved: Mapping[str, Any], template: Any, reset: bool, forms: bool = False
) -> Any:
    """A state of ``template``'s structure with the leaves of ``saved``.

    Args:
        group: the param group's index (for the messages).
        saved: a :func:`state_to_dict` of a state of the same structure.
        template: a state of the structure wanted, on the device and in the dtypes wanted.
        reset: take the error-feedback leaves from ``template`` (a checkpoint of another world
            size), not from ``saved``.
        forms: the optimizer keeps some fields in a form that depends on its phase (a buffer
            ``None`` until it is needed, a momentum as ``fn.collectives.PackedSigns``; the
            transform's ``check_state`` checks them): a field saved in another form than
            ``template``'s is taken in the checkpoint's form, on ``template``'s device.

    Returns:
        The state, with tensors copied from ``saved`` (never aliased to the checkpoint).

    Raises:
        ValueError: ``saved`` has other keys than ``template`` (in a form it does not take) or
            a tensor of another shape.
    """
    leaves, spec = pytree.tree_flatten_with_path(template)
    keys = [pytree.keystr(path) for path, _ in leaves]
    marks = error_feedback_leaves(template)
    device = next((x.device for _, x in leaves if isinstance(x, torch.Tensor)), None)
    if forms and set(keys) != set(saved):
        return _in_saved_forms(group, saved, template, reset, device)
    if set(keys) != set(saved):
        raise _structure_error(group, set(keys), set(saved), flat=False)
    out = []
    for (_, leaf), key, error in zip(leaves, keys, marks, strict=True):
        value = saved[key]
        if reset and error:
            out.append(leaf)
        elif not forms or isinstance(leaf, torch.Tensor) and isinstance(value, torch.Tensor):
            out.append(_copied(group, key, value, leaf))
        else:  # a buffer one of the two does not hold (yet): the checkpoint's
            out.append(_copied(group, key, value, None, device))
    return pytree.tree_unflatten(out, spec)


def _copied(group: int, key: str, value: Any, like: Any, device: torch.device | None = None) -> Any:
    """``value`` copied to ``like``'s device and dtype, checked to have its shape (to
    ``device``, unchecked, where ``like`` is not a tensor)."""
    if isinstance(value, PackedSigns):
        return PackedSigns(*(t.to(device=device, copy=True) for t in value))
    if not isinstance(value, torch.Tensor):
        if isinstance(like, torch.Tensor):
            raise ValueError(
                f"param group {group}: state entry {key!r} is a {type(value).__name__} in the "
                f"checkpoint, a tensor of shape {tuple(like.shape)} here"
            )
        return value
    if not isinstance(like, torch.Tensor):
        return value.to(device=device, copy=True)
    if value.shape != like.shape:
        raise ValueError(
            f"param group {group}: state entry {key!r} has shape {tuple(value.shape)} in the "
            f"checkpoint, {tuple(like.shape)} here"
        )
    return value.to(device=like.device, dtype=like.dtype, copy=True)


def _in_saved_forms(
    group: int, saved: Mapping[str, Any], template: Any, reset: bool, device: Any
) -> Any:
    """:func:`state_from_dict` of a state whose fields may be saved in another form than the
    template's. Each field is read in the first layout that holds every entry the checkpoint
    has under it: the template field's own (a ``PackedSigns`` counting as one leaf), the field
    as one leaf (a momentum of all leaves fused; a second moment is one leaf only where the
    whole state is, a flat buffer's: ``flatten=True``), or the layout of another field of the state
    (per leaf, like the params); at each leaf, a tensor, ``None`` or a ``PackedSigns``. A field
    that the template leaves ``None`` and the checkpoint lacks (one saved before fn added the
    field) stays ``None``."""
    used, fields = set(), {}
    errors = marked_fields(type(template), ErrorFeedback)
    second_moments = marked_fields(type(template), SecondMoment)
    for field, mine in zip(template._fields, template, strict=True):
        prefix = f".{field}"
        theirs = {k for k in saved if _under(k, prefix)}
        used.update(theirs)
        if reset and field in errors or not theirs and mine is None:
            fields[field] = mine
            continue
        layouts = [mine, None, *(other for other in template if other is not mine)]
        if field in second_moments:  # one leaf only where all is (a flat buffer's state)
            layouts = [x for x in layouts if x is mine or not _is_one_leaf(x)]
        for layout in layouts:
            leaves, spec = pytree.tree_flatten_with_path(layout, is_leaf=_is_form)
            read = [_read_form(saved, prefix + pytree.keystr(path)) for path, _ in leaves]
            taken = {k for _, keys in read for k in keys}
            if all(value is not _MISSING for value, _ in read) and taken == theirs:
                break
        else:
            leaves = pytree.tree_flatten_with_path(mine, is_leaf=_is_form)[0]
            flat = field in second_moments and prefix in theirs  # saved by flatten=True
            mine_keys = {prefix + pytree.keystr(p) for p, _ in leaves}
            raise _structure_error(group, mine_keys, theirs, flat=flat)
        values = []
        for (value, keys), (_, like) in zip(read, leaves, strict=True):
            same_form = isinstance(like, torch.Tensor) and isinstance(value, torch.Tensor)
            values.append(_copied(group, keys[0], value, like if same_form else None, device))
        fields[field] = pytree.tree_unflatten(values, spec)
    extra = sorted(set(saved) - used)
    if extra:
        raise ValueError(
            f"param group {group}: the checkpoint's optimizer state has entries {extra[:4]} "
            "that this optimizer does not keep; was it saved by another optimizer?"
        )
    return type(template)(**fields)


def _structure_error(group: int, mine: set[str], saved: set[str], *, flat: bool) -> ValueError:
    """The error for a checkpoint whose entries ``saved`` of a field are not ``mine``
    (``flat``: one tensor, as the state of a flat buffer, ``flatten=True``, has it)."""
    missing, extra = sorted(mine - saved), sorted(saved - mine)
    hint = ", or one built with flatten=True (a flat buffer's state)" if flat else ""
    return ValueError(
        f"param group {group}: the checkpoint's optimizer state has another structure "
        f"(missing {missing[:4]}, unexpected {extra[:4]}); was it saved by another optimizer"
        f"{hint}?"
    )


_MISSING = object()


def _is_one_leaf(tree: Any) -> bool:
    return isinstance(tree, torch.Tensor) or _is_form(tree)


def _is_form(x: Any) -> bool:
    return x is None or isinstance(x, PackedSigns)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith((prefix + ".", prefix + "["))


def _read_form(saved: Mapping[str, Any], key: str) -> tuple[Any, tuple[str, ...]]:
    """The checkpoint's value at ``key`` (a leaf, or a ``PackedSigns`` saved as its two
    fields) and the keys it was read from; ``_MISSING`` where there is neither."""
    if key in saved:
        return saved[key], (key,)
    parts = (f"{key}.packed", f"{key}.scales")
    if all(k in saved for k in parts):
        return PackedSigns(saved[parts[0]], saved[parts[1]]), parts
    return _MISSING, ()


def checkpoint_parts(
    state_dict: Any, num_groups: int
) -> tuple[list[Mapping[str, Any]], Mapping[Any, Any]]:
    """The saved param groups and the records of an optimizer ``state_dict``, checked for the
    layout of ``torch.optim`` (``{"state": {...}, "param_groups": [{"params": [...]}, ...]}``).

    Args:
        state_dict: what ``load_state_dict`` was given.
        num_groups: the number of param groups of the optimizer loading it.

    Returns:
        The saved groups (one per group here) and the ``"state"`` mapping.

    Raises:
        ValueError: a missing key or a value of the wrong kind (naming it), or another number of
            param groups.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"an optimizer state_dict is a dict, got {type(state_dict).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(
            f"the optimizer state_dict lacks {missing}; it has {sorted(map(str, state_dict))}"
        )
    records, groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(records, Mapping):
        raise ValueError(f"the checkpoint's 'state' is a {type(records).__name__}, not a dict")
    if not isinstance(groups, Sequence) or isinstance(groups, str):
        raise ValueError(
            f"the checkpoint's 'param_groups' is a {type(groups).__name__}, not a list"
        )
    groups = list(groups)
    if len(groups) != num_groups:
        raise ValueError(
            f"the checkpoint has {len(groups)} param groups, this optimizer {num_groups}"
        )
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), Sequence):
            raise ValueError(
                f"the checkpoint's param group {index} must be a dict with a 'params' list, got "
                f"{group!r:.100}"
            )
    return groups, records


def check_state_values(group: int, state: Any) -> None:
    """Raises ``ValueError`` unless every floating-point value of ``state`` is finite, every
    second moment (a state field annotated ``fn.base.SecondMomentField``) is >= 0 and every
    update count (a field ``count``) an integer >= 0.

    A loaded NaN or negative variance would otherwise turn the params into NaN at the next
    step, with no error.

    Args:
        group: the param group's index (for the messages).
        state: a functional state read from a checkpoint.
    """
    leaves = pytree.tree_flatten_with_path(state)[0]
    second_moments = _marked_leaves(state, SecondMoment)
    for (path, leaf), second_moment in zip(leaves, second_moments, strict=True):
        key = pytree.keystr(path)
        if key.endswith("count") and not _is_count(leaf):
            raise ValueError(
                f"param group {group}: state entry {key!r} in the checkpoint is {leaf!r:.60}, not "
                "an update count (an integer >= 0); nothing was loaded"
            )
        if isinstance(leaf, float) or (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
            values = torch.as_tensor(leaf)
            bad = int((~torch.isfinite(values)).sum())
            if bad:
                raise ValueError(
                    f"param group {group}: state entry {key!r} in the checkpoint has {bad} "
                    "non-finite values (NaN or Inf); nothing was loaded"
                )
            if second_moment and bool((values < 0).any()):
                raise ValueError(
                    f"param group {group}: state entry {key!r} in the checkpoint has negative "
                    f"values (min {values.min().item():.3g}), but a second moment is >= 0; "
                    "nothing was loaded"
                )


def _is_count(leaf: Any) -> bool:
    """Whether ``leaf`` holds update counts: integers (a tensor or an int, not a bool) >= 0."""
    if isinstance(leaf, torch.Tensor):
        integral = not leaf.is_floating_point() and not leaf.is_complex()
        return integral and leaf.dtype != torch.bool and not bool((leaf < 0).any())
    return isinstance(leaf, int) and not isinstance(leaf, bool) and leaf >= 0


def _marked_leaves(state: Any, mark: Any) -> list[bool]:
    """Which leaves of ``state`` lie in a field annotated with ``mark`` (e.g.
    ``SecondMomentField``), in pytree leaf order."""
    marks = []
    for path, _ in pytree.tree_flatten_with_path(state)[0]:
        node, inside = state, False
        for entry in path:
            if isinstance(entry, pytree.GetAttrKey):
                inside = inside or entry.name in marked_fields(type(node), mark)
            node = entry.get(node)
        marks.append(inside)
    return marks


def per_rank_keys(state: Any) -> list[str]:
    """The key paths (as in :func:`state_to_dict`) of the leaves of ``state`` that may differ
    between ranks: its error feedback and the fields annotated ``fn.base.PerRankField``."""
    marks = zip(error_feedback_leaves(state), _marked_leaves(state, PerRank), strict=True)
    return _keys_where(state, map(any, marks))


def _keys_where(state: Any, marks: Iterable[bool]) -> list[str]:
    """The key paths of the leaves of ``state`` whose mark is true, in pytree leaf order."""
    leaves = pytree.tree_flatten_with_path(state)[0]
    return [pytree.keystr(path) for (path, _), m in zip(leaves, marks, strict=True) if m]


def check_master(group: int, master: torch.Tensor | None, numel: int) -> None:
    """Raises ``ValueError`` unless a checkpoint's fp32 master copy (if any) has ``numel``
    elements in one dimension and is finite."""
    if master is None:
        return
    if tuple(master.shape) != (numel,):
        raise ValueError(
            f"param group {group}: the checkpoint's master copy has shape "
            f"{tuple(master.shape)}, expected ({numel},); nothing was loaded"
        )
    if not master.is_floating_point() or not bool(torch.isfinite(master).all()):
        raise ValueError(
            f"param group {group}: the checkpoint's master copy is not a finite floating-point "
            "tensor; nothing was loaded"
        )


def packed_param_groups(param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The param groups as ``torch.optim`` saves them: each group's entries with its params
    replaced by their indices, counted across the groups."""
    packed, start = [], 0
    for group in param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        packed.append(entry)
    return packed


def save_state(optimizer: Any, gathered: GatheredErrorFeedback | None) -> dict[str, Any]:
    """``FunctionalOptimizer.state_dict()``: every group's stored record (``GroupRecord.to_dict``,
    its tensors never donated: ``GroupRuntime.export``) and the param groups
    (:func:`packed_param_groups`).

    Args:
        optimizer: the ``FunctionalOptimizer``.
        gathered: every rank's error feedback, gathered from the groups' live states, or
            ``None``.
    """
    state, comm = {}, optimizer.comm
    for index, runtime in enumerate(optimizer.group_runtimes):
        runtime.flat.sync_master()
        master = runtime.flat.master.clone() if runtime.flat.has_master_copy else None
        state[index] = GroupRecord(
            step=runtime.step,
            world_size=comm.world_size,
            shapes=tuple(runtime.flat.shapes),
            functional=state_to_dict(runtime.state),
            master=master,
            rank=getattr(comm, "rank", 0),
            error_feedback_by_rank=None if gathered is None else gathered.by_rank[index],
            local_world_size=optimizer.local_world_size,
        ).to_dict()
        runtime.export(state[index])
    return {"state": state, "param_groups": packed_param_groups(optimizer.param_groups)}


class LoadPlan(NamedTuple):
    """What ``load_state_dict`` sets in one param group once every group's record is checked."""

    saved: Mapping[str, Any]  # the checkpoint's param group: its hyperparameters
    transform: Any  # the group's transform with them
    hyper: dict[str, Any]
    state: Any  # the restored functional state
    record: GroupRecord


def plan_load(
    state_dict: Any,
    optimizer: Any,
    hyperparameters: Callable[[dict[str, Any]], dict[str, Any]],
    make_transform: Callable[[int, dict[str, Any]], Any],
) -> list[LoadPlan]:
    """Reads and checks every group's record of an optimizer ``state_dict`` (all before any is
    loaded) and warns (at ``load_state_dict``'s caller) of the error feedback it resets.

    Args:
        state_dict: what ``load_state_dict`` was given.
        optimizer: the ``FunctionalOptimizer`` loading it.
        hyperparameters: a param group's hyperparameters, from the group's dict.
        make_transform: group ``index``'s transform built from hyperparameters.

    Returns:
        One plan per group.

    Raises:
        ValueError: a checkpoint that does not fit (see ``FunctionalOptimizer.load_state_dict``).
    """
    comm, local_world_size = optimizer.comm, optimizer.local_world_size
    saved_groups, records = checkpoint_parts(state_dict, len(optimizer.param_groups))
    plans = []
    worlds, foreign = set(), set()
    for index, (group, saved, runtime) in enumerate(
        zip(optimizer.param_groups, saved_groups, optimizer.group_runtimes, strict=True)
    ):
        record = _read_record(index, records, saved, group, runtime)
        if "lr" in saved:
            lr_value(index, saved["lr"], "in the checkpoint")
        hyper = read_lr({k: saved.get(k, v) for k, v in hyperparameters(group).items()})
        try:
            transform = make_transform(index, hyper)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"param group {index}: the checkpoint's hyperparameters are invalid: {err}"
            ) from err
        state, reset = _restored_state(index, record, runtime, transform, optimizer)
        if (record.world_size, record.local_world_size) != (comm.world_size, local_world_size):
            worlds.add(_layout_text(record.world_size, record.local_world_size))
        elif reset:
            foreign.add(record.rank)
        plans.append(LoadPlan(saved, transform, hyper, state, record))
    if worlds:
        warnings.warn(
            f"fn.optim: the checkpoint was saved with {' or '.join(sorted(worlds))}, this run "
            f"has {_layout_text(comm.world_size, local_world_size)}: the error-feedback "
            "buffers are reset to zero for the new layout",
            stacklevel=3,
        )
    if foreign:
        warnings.warn(
            f"fn.optim: rank {comm.rank} loads the optimizer state of rank "
            f"{sorted(foreign)}, which holds only that rank's error feedback: this rank's is "
            "reset to zero (call opt.gather_error_feedback() on every rank before rank 0 "
            "saves, or use fn.integrations, to resume bit for bit)",
            stacklevel=3,
        )
    return plans


def _layout_text(world_size: int, local_world_size: int | None) -> str:
    """How the error feedback was laid out, for the messages: ``world_size [W]``, with the
    ranks per node of hierarchical collectives."""
    level = "" if local_world_size is None else f" and local_world_size {local_world_size}"
    return f"world_size [{world_size}]{level}"


def _read_record(
    index: int, records: Mapping[Any, Any], saved: Mapping[str, Any], group: Mapping, runtime: Any
) -> GroupRecord:
    """Group ``index``'s record in a checkpoint's ``records``, checked against the group (its
    saved param group ``saved``, its param group ``group`` and runtime here)."""
    if index not in records:
        raise ValueError(
            f"the checkpoint has no state for param group {index} (its 'state' is keyed "
            f"by {sorted(map(repr, records))[:4]}; fn.optim keys it by group index)"
        )
    record = GroupRecord.from_dict(records[index], index)
    record.check_shapes(index, runtime.flat.shapes)
    if len(saved["params"]) != len(group["params"]):
        raise ValueError(
            f"param group {index}: {len(saved['params'])} params in the checkpoint, "
            f"{len(group['params'])} here"
        )
    return record


def _restored_state(
    index: int, record: GroupRecord, runtime: Any, transform: Any, optimizer: Any
) -> tuple[Any, bool]:
    """The checked functional state that ``optimizer``'s rank loads from group ``index``'s
    record, and whether its error feedback was reset (:func:`own_error_feedback`): then it
    starts from the ``transform``'s initial error feedback."""
    comm, keys = optimizer.comm, error_feedback_keys(runtime.state)
    rank, local_world_size = getattr(comm, "rank", 0), optimizer.local_world_size
    functional, reset = own_error_feedback(record, rank, comm.world_size, local_world_size, keys)
    template = runtime.initial_state(transform) if reset else runtime.state
    check_state = getattr(transform, "check_state", None)
    state = state_from_dict(index, functional, template, reset, forms=check_state is not None)
    if check_state is not None:
        try:
            state = check_state(state)
        except ValueError as err:
            raise ValueError(f"param group {index}: the checkpoint's state: {err}") from err
    check_state_values(index, state)
    if runtime.flat.has_master_copy:
        check_master(index, record.master, runtime.flat.numel)
    return state, reset


def load(plans: Sequence[LoadPlan], optimizer: Any) -> None:
    """Sets every group's hyperparameters, transform, state, step count and master from its
    plan (:func:`plan_load`)."""
    for plan, group, runtime in zip(
        plans, optimizer.param_groups, optimizer.group_runtimes, strict=True
    ):
        group.update({k: v for k, v in plan.saved.items() if k != "params"})
        runtime.transform, runtime.hyper = plan.transform, plan.hyper
        runtime.restore(plan.state, plan.record.step, group)
        runtime.flat.load_master(plan.record.master)


# ---------------------------------------------------------------- per-rank error feedback


def _by_rank(value: Any, world_size: int, where: str) -> tuple[dict[str, torch.Tensor], ...] | None:
    if value is None:
        return None
    if (
        not isinstance(value, Sequence)
        or len(value) != world_size
        or not all(isinstance(e, Mapping) for e in value)
    ):
        raise ValueError(
            f"{where}: 'error_feedback_by_rank' must be a list of {world_size} dicts (one per "
            f"rank), got {type(value).__name__}"
        )
    return tuple(dict(e) for e in value)


def error_feedback_keys(state: Any) -> list[str]:
    """The key paths (as in :func:`state_to_dict`) of the error-feedback leaves of ``state``."""
    return _keys_where(state, error_feedback_leaves(state))


def gather_error_feedback(comm: Any, state: Any) -> tuple[dict[str, torch.Tensor], ...] | None:
    """Every rank's error-feedback entries of ``state`` (:func:`error_feedback_keys`): on rank 0
    one ``{key: tensor}`` per rank, indexed by rank; ``None`` elsewhere (a collective call on
    ``comm``, a ``fn.collectives.ProcessGroup``: a rank that does not join raises its
    ``CollectiveTimeoutError`` within its timeout). A buffer not allocated yet (``None``: the
    1-bit family before its freeze) is ``None`` on every rank alike (when it is allocated
    depends on the update count alone): it is recorded as ``None`` for every rank, with nothing
    sent."""
    functional = state_to_dict(state)
    gathered: list[dict[str, torch.Tensor | None]] = [{} for _ in range(comm.world_size)]
    for key in error_feedback_keys(state):
        pieces = [None] * comm.world_size
        if functional[key] is not None:
            pieces = comm.gather_to_first(functional[key])
        if pieces is not None:  # rank 0's, or a buffer not allocated yet (on no rank)
            for entries, piece in zip(gathered, pieces, strict=True):
                entries[key] = piece
    return tuple(gathered) if comm.rank == 0 else None


class GatheredErrorFeedback(NamedTuple):
    """Every rank's error feedback of every group, held on rank 0 while the states it was
    gathered from are live (``FunctionalOptimizer.gather_error_feedback``)."""

    states: list[Any]  # the groups' states it was taken from
    by_rank: list[tuple[dict[str, torch.Tensor], ...]]  # per group, indexed by rank

    @classmethod
    def gather(cls, comm: Any, groups: Sequence[Any]) -> GatheredErrorFeedback | None:
        """Gathers it from every rank (a collective): on rank 0 the result, elsewhere (and with
        one rank, where nothing happens) ``None``."""
        if comm.world_size == 1:
            return None
        states = [runtime.state for runtime in groups]
        by_rank = [gather_error_feedback(comm, s) for s in states]
        return cls(states, by_rank) if comm.rank == 0 else None

    def current(self, groups: Sequence[Any]) -> bool:
        """Whether it was gathered from the groups' live states (else it is stale)."""
        return all(s is r.state for s, r in zip(self.states, groups, strict=True))


def own_error_feedback(
    record: GroupRecord, rank: int, world_size: int, local_world_size: int | None, keys: list[str]
) -> tuple[dict[str, Any], bool]:
    """The functional state a rank loads from ``record``, and whether its error feedback must be
    reset (a checkpoint of another world size or local_world_size, or another rank's without
    every rank's).

    Args:
        record: the loaded record.
        rank: the loading rank.
        world_size: the loading world size.
        local_world_size: the loading ranks per node (``None``: flat).
        keys: the error-feedback entries (:func:`error_feedback_keys`).

    Returns:
        ``(functional, reset)``: ``functional`` with this rank's gathered error feedback put in
        where the record has it.
    """
    if (record.world_size, record.local_world_size) != (world_size, local_world_size):
        return record.functional, True
    if record.error_feedback_by_rank is not None:
        mine = record.error_feedback_by_rank[rank]
        # A field may be saved in another form than this state's (one None for a buffer not
        # allocated yet, or per-leaf tensors): an entry covers the entries under it or above it.
        uncovered = [k for k in keys if not any(_under(k, g) or _under(g, k) for g in mine)]
        if uncovered or not set(mine) <= set(record.functional):
            raise ValueError(
                f"the checkpoint's error_feedback_by_rank has entries {sorted(mine)} for rank "
                f"{rank}, this optimizer's error feedback is {keys}"
            )
        return {**record.functional, **mine}, False
    foreign = world_size > 1 and record.rank is not None and record.rank != rank
    return record.functional, foreign


class PerRankState:
    """An ``fn.optim`` optimizer as a ``torch.distributed.checkpoint`` (DCP) ``Stateful`` that
    keeps every rank's own state: its error feedback and the fields that differ between ranks.

    DCP saves a tensor that every rank holds under the same name once (it assumes replicas), so
    it would keep one rank's error feedback and ``fn.base.PerRankField`` fields (0/1 Adam's
    momentum and accumulator) for all: here each rank's share gets a name of its own
    (``per_rank.rank<r>`` in each record, ``r`` the rank in the optimizer's comm; fn's
    convention, fn/collectives/dcp.py). DCP checkpoints load at the world size they were saved
    with (to change it, go through ``state_dict()``), in place into a fixed layout, so a state
    that changes form with its phase is saved in its full layout
    (``CompressedOptimizer.full_state``).

    Args:
        optimizer: an ``fn.optim`` optimizer.

    Example:
        Under ``torchrun`` every rank runs the same lines; one process shows them here:

        >>> import tempfile, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> model = torch.nn.Linear(2, 1)
        >>> comm = fn.collectives.Local()
        >>> opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2, comm=comm)
        >>> path = tempfile.mkdtemp()
        >>> with warnings.catch_warnings():  # DCP warns that it runs without torch.distributed
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"optim": fn.optim.PerRankState(opt)}, checkpoint_id=path)
        ...     dcp.load({"optim": fn.optim.PerRankState(opt)}, checkpoint_id=path)
        >>> opt.state_dict()["state"][0]["rank"]
        0
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` with its tensors copied (DCP loads in place into the
        dict this returns; the master is a copy already) and each record's per-rank entries
        (its error feedback and the fields that differ between ranks) under this rank's own
        name."""
        saved = self.optimizer.state_dict()
        rank = getattr(self.optimizer.comm, "rank", 0)
        groups = self.optimizer.group_runtimes
        state = {}
        for index, record in saved["state"].items():
            record.pop("rank", None)
            record.pop("error_feedback_by_rank", None)
            functional_state = groups[index].state
            full = getattr(groups[index].transform, "full_state", None)
            if full is not None:  # one layout at every count: DCP loads in place into it
                functional_state = full(functional_state)
                record["functional"] = state_to_dict(functional_state)
            functional = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in record["functional"].items()
            }
            mine = {k: functional.pop(k) for k in per_rank_keys(functional_state)}
            record["functional"] = functional
            record[PER_RANK] = {rank_key(rank): mine}
            state[str(index)] = record  # DCP keys are strings
        return {**saved, "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what DCP read into :meth:`state_dict`'s layout (this rank's own entries)."""
        rank = getattr(self.optimizer.comm, "rank", 0)
        state = {}
        for index, record in state_dict["state"].items():
            record = dict(record)
            mine = record.pop(PER_RANK)[rank_key(rank)]
            record["functional"] = {**record["functional"], **mine}
            record["rank"] = rank
            state[int(index)] = record
        self.optimizer.load_state_dict({**state_dict, "state": state})
