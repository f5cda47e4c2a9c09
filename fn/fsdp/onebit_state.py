"""The DCP state format of the 1-bit optimizers on FSDP2: one layout at every update (DCP
loads in place into a layout fixed before it reads), a header of the format, world size, update
count and checksums of the model's layout and the settings, checked before anything changes;
loaded on the same mesh shape bit for bit, on another with the momentum laid out anew and the
error feedback reset (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2")."""

from __future__ import annotations

import sys
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fn.collectives import PackedSigns, init_error_feedback
from fn.fsdp.onebit_layout import (
    ModuleLayout,
    layout_at,
    momentum_from_signs,
    shard_of,
    to_local,
)
from fn.fsdp.onebit_masks import relaid_mask

__all__ = ["OnebitStateFormat", "auto_scalars", "not_torch_format"]

_FORMAT = 1  # the layout of ShardedOnebitOptimizer.state_dict()
_TORCH_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"
_AUTO_MASK_KEYS = ("always_zero", "exp_avg_mask")  # and with exp_avg_mask="auto"


class OnebitStateFormat:
    """The state dict of a :class:`~fn.fsdp.ShardedOnebitOptimizer` (a part of it: it reads
    the optimizer's layouts, state, compressed modules, masks and settings)."""

    @property
    def state(self) -> Any:
        """``torch.optim``'s per-param state, which stays empty (the state is in the rule's
        fields and the compressed modules: :meth:`state_dict`).

        Raises:
            NotImplementedError: read by ``torch.distributed.checkpoint.state_dict``
                (``get_state_dict``, ``get_optimizer_state_dict``, ``set_state_dict``,
                ``set_optimizer_state_dict``, each of which reads it before anything else of
                the optimizer), which keeps only ``torch.optim``'s per-param form; nothing was
                changed.
        """
        # torch's API reads this first, then takes the optimizer for one of torch.optim's form
        if sys._getframe(1).f_globals.get("__name__") == _TORCH_STATE_DICT_API:
            raise NotImplementedError(not_torch_format(self.name))
        return self._per_param_state

    @state.setter
    def state(self, value: Any) -> None:
        self._per_param_state = value

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as a ``torch.distributed.checkpoint`` (DCP) state dict, in one
        layout at every update (DCP loads in place into a layout fixed before it reads).

        ``{"header", "lr", "signed", "exp_avg", "exp_avg_sq", "momentum", "rank<r>"}``:
        ``header`` (int64: format, world size, updates made, checksums of the model's layout
        and of the settings); ``lr`` (``param_groups[0]["lr"]``); ``signed`` (int8 per module:
        whether its momentum is kept as packed signs); ``exp_avg`` and ``exp_avg_sq`` by param
        FQN, DTensors of the shards (``exp_avg``: zeros where the momentum is packed);
        ``momentum`` by module, the packed signs and scales of its full momentum (zeros before
        the freeze; the same on every rank, so DCP saves them once); and under ``rank<r>``, a
        name of this rank's own, by module its worker and server errors (zeros before the
        first compressed update; DCP would keep one rank's copy of a name every rank saves).
        With ``freeze_step="auto"``, ``auto`` holds the decision and its statistics (0-dim,
        the same on every rank). With ``exp_avg_mask="auto"``, by module and as bits in the
        layout of ``X``, ``always_zero`` holds the warmup's records of zero gradients (a
        DTensor of the ranks' rows, each rank's its own; zeros after the freeze) and
        ``exp_avg_mask`` the mask (the same on every rank; zeros before the freeze). A
        subclass's further per-param fields come by field name: its ``scalar_fields`` (0-dim,
        the same on every rank) and its ``optional_fields`` (DTensors of the shards, zeros
        where ``None``, with ``"<field>_held"``: int8 per param, whether it holds a tensor).
        :class:`~fn.fsdp.TrainingCheckpoint` saves it, and loads it on any mesh shape, checked
        before anything changes; ``dcp.load`` straight into it works on the same mesh shape.
        On HSDP (``replicate=``) the world size is the shard group's, ``header`` ends with
        ``N``, ``momentum`` holds this rank's row (a DTensor over the shard mesh, the same on
        the ``N`` peers), and ``rank<r>`` is named by the rank in ``world`` (the default group
        unless the optimizer was given another).

        Returns:
            A dict of tensors, the state's own where it holds them, zeros where it does not.

        Raises:
            RuntimeError: called between a backward and its ``step()`` (the gradient
                accumulated since the last ``step()`` is not part of a checkpoint); nothing was
                changed.
        """
        if any(module.received for module in self._modules.values()):
            raise RuntimeError(
                f"{self.name}: state_dict() between a backward and its step(): the gradient "
                "accumulated since the last step() is not part of a checkpoint, and a resumed "
                "run would lose it; save after step() (or after zero_grad())"
            )
        signed = [self._modules[x.name].signs is not None for x in self._layouts]
        mine: dict[str, dict[str, torch.Tensor]] = {}
        state: dict[str, Any] = {
            "header": self._header(),
            "lr": torch.tensor(float(self.param_groups[0]["lr"]), dtype=torch.float64),
            "signed": torch.tensor(signed, dtype=torch.int8),
            "exp_avg": {},
            "exp_avg_sq": {},
            "momentum": {},
            self._own_key(): mine,
        }
        for layout in self._layouts:
            for slot in layout.slots:
                m = self._state.exp_avg[slot.name]
                m = m if isinstance(m, torch.Tensor) else torch.zeros(0)
                state["exp_avg"][slot.name] = shard_of(m, slot.param)
                v = self._state.exp_avg_sq[slot.name]
                state["exp_avg_sq"][slot.name] = shard_of(v, slot.param)
            module = self._modules[layout.name]
            state["momentum"][layout.name] = self._momentum_state(layout, module.signs)
            errors = module.errors or self._zero_errors(layout)
            mine[layout.name] = {"worker": errors[0], "server": errors[1]}
        slots = [slot for layout in self._layouts for slot in layout.slots]
        if self._automatic:
            state["auto"] = auto_scalars(self._state.auto)
        if self._auto_mask:
            state.update(self._auto_mask_state())
        for field in self.scalar_fields:
            state[field] = {slot.name: getattr(self._state, field)[slot.name] for slot in slots}
        for field in self.optional_fields:
            values = [getattr(self._state, field)[slot.name] for slot in slots]
            state[f"{field}_held"] = torch.tensor([x is not None for x in values], dtype=torch.int8)
            state[field] = {
                slot.name: shard_of(torch.zeros(0) if x is None else x, slot.param)
                for slot, x in zip(slots, values, strict=True)
            }
        return state

    def checkpoint_template(
        self, header: torch.Tensor, saved: dict[str, torch.Size]
    ) -> dict[str, Any]:
        """The state dict that DCP loads a checkpoint of :meth:`state_dict` into: new tensors
        laid out as saved (this rank's errors only if the mesh shape is the same).

        Args:
            header: the checkpoint's ``header`` (loaded first).
            saved: the checkpoint's optimizer keys, flat (``"exp_avg.block.weight"``), and
                their sizes (from the checkpoint's metadata).

        Returns:
            A dict of the form of :meth:`state_dict`, to pass to ``dcp.load``.

        Raises:
            ValueError: the header does not match this model or these settings, or a key is
                missing (nothing was loaded).
        """
        auto_saved = any(key.startswith("always_zero.") for key in saved)
        same = self._same_mesh(*self._checked_header(header, auto_saved)[:2])
        own = self._own_key()
        needed = ["lr", "signed"]
        for layout in self._layouts:
            needed += [f"momentum.{layout.name}.{k}" for k in ("packed", "scales")]
            if same:
                needed += [f"{own}.{layout.name}.{k}" for k in ("worker", "server")]
            fields = ("exp_avg", "exp_avg_sq", *self.scalar_fields, *self.optional_fields)
            needed += [f"{f}.{s.name}" for s in layout.slots for f in fields]
        needed += [f"{field}_held" for field in self.optional_fields]
        if self._automatic:
            needed += [f"auto.{k}" for k in auto_scalars(self._state.auto)]
        if self._auto_mask:
            needed += [f"{f}.{x.name}" for f in _AUTO_MASK_KEYS for x in self._layouts]
        missing = [key for key in needed if key not in saved]
        if missing:
            raise ValueError(
                f"{self.name}: the checkpoint has no {missing[:4]}; nothing was loaded"
            )

        def new(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(saved[key], dtype=dtype)

        template: dict[str, Any] = {
            "header": header.clone(),
            "lr": new("lr", torch.float64),
            "signed": new("signed", torch.int8),
            "exp_avg": {},
            "exp_avg_sq": {},
            "momentum": {},
        }
        for layout in self._layouts:
            if same and self._replicas is not None:  # this rank's row, as saved
                template["momentum"][layout.name] = self._momentum_state(layout, None)
            else:  # all of it: saved whole on every rank, or the rows of another mesh
                template["momentum"][layout.name] = {
                    k: new(f"momentum.{layout.name}.{k}", dtype)
                    for k, dtype in (("packed", torch.uint8), ("scales", torch.float32))
                }
            for slot in layout.slots:
                for field in ("exp_avg", "exp_avg_sq", *self.optional_fields):
                    shard = shard_of(torch.zeros(0), slot.param)
                    template.setdefault(field, {})[slot.name] = shard
                for field in self.scalar_fields:
                    key = f"{field}.{slot.name}"
                    template.setdefault(field, {})[slot.name] = new(key, torch.float32)
        for field in self.optional_fields:
            template[f"{field}_held"] = new(f"{field}_held", torch.int8)
        if self._automatic:
            template["auto"] = {k: v.clone() for k, v in auto_scalars(self._state.auto).items()}
        if self._auto_mask:  # the records as a whole (on another mesh too)
            for f in _AUTO_MASK_KEYS:
                template[f] = {x.name: new(f"{f}.{x.name}", torch.uint8) for x in self._layouts}
        if same:
            template[own] = {
                x.name: {
                    k: new(f"{own}.{x.name}.{k}", self.error_dtype) for k in ("worker", "server")
                }
                for x in self._layouts
            }
        return template

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (as :meth:`state_dict` or :meth:`checkpoint_template`
        lays it out).

        Saved on this mesh shape (the world size of a 1-D mesh; on HSDP ``N`` x ``L``), the
        state continues bit for bit. Saved on another one (another world size, HSDP to a 1-D
        mesh or back, another ``N`` x ``L``), ``v`` and the shards' momentum are read back
        exactly into this mesh's layout, and the error feedback (which compensated the old
        layout's compression) restarts from zero with a warning.

        Raises:
            ValueError: the checkpoint is of another model or other settings; nothing was
                changed.
            NotImplementedError: ``state_dict`` is in ``torch.optim``'s per-param form (as
                ``torch.distributed.checkpoint.state_dict.set_state_dict`` passes it); nothing
                was changed.
        """
        if "header" not in state_dict:
            raise NotImplementedError(not_torch_format(self.name))
        auto_saved = "always_zero" in state_dict
        world_size, replicas, count = self._checked_header(state_dict["header"], auto_saved)
        same = self._same_mesh(world_size, replicas)
        signed = [bool(x) for x in state_dict["signed"].tolist()]
        if len(signed) != len(self._layouts):
            raise ValueError(f"{self.name}: corrupt checkpoint: signed = {signed}")
        auto = self._state.auto
        if self._automatic:
            loaded = {k: state_dict["auto"][k].clone() for k in auto_scalars(auto)}
            auto = auto._replace(**loaded)
        masks, records = self._masks, self._zero_records
        if self._auto_mask:
            frozen = self._rule.is_compressed(count, self._state._replace(auto=auto))
            saved = [layout_at(x, world_size, replicas) for x in self._layouts]
            masks, records = self._loaded_auto_masks(state_dict, saved, frozen)
        own = state_dict.get(self._own_key(), {}) if same else {}
        exp_avg, exp_avg_sq, compressed = {}, {}, {}
        for layout, packed in zip(self._layouts, signed, strict=True):
            signs, errors = None, None
            for slot in layout.slots:
                exp_avg_sq[slot.name] = to_local(state_dict["exp_avg_sq"][slot.name]).clone()
                m = to_local(state_dict["exp_avg"][slot.name]).clone()
                exp_avg[slot.name] = None if packed and not self.keeps_momentum_shards else m
            if packed:
                signs = self._loaded_signs(state_dict["momentum"][layout.name])
                if same:
                    saved = own[layout.name]
                    errors = (saved["worker"].clone(), saved["server"].clone())
                else:  # the shards' momentum, in this mesh's layout
                    if not self.keeps_momentum_shards:  # (else DCP resharded exp_avg)
                        old = layout_at(layout, world_size, replicas)
                        world, rank = self.comm.world_size, self.rank
                        shards = momentum_from_signs(old, signs, world, rank)
                        exp_avg.update(self._masked_shards(layout, shards, masks[layout.name]))
                    signs = None
            compressed[layout.name] = signs, errors
        if not same and any(signed):
            here = (self.comm.world_size, self._replicas.world_size if self._replicas else 1)
            warnings.warn(
                f"{self.name}: checkpoint saved on {_mesh(world_size, replicas)}, loaded on "
                f"{_mesh(*here)}: the error feedback restarts from zero (the momentum is kept)",
                stacklevel=2,
            )
        extra = self._loaded_fields(state_dict)
        if self._automatic:
            extra["auto"] = auto
        self.param_groups[0]["lr"] = float(state_dict["lr"])
        self._freeze_due = False
        self._state = self._state._replace(
            count=torch.tensor(count, dtype=torch.int64),
            lr=torch.tensor(float(state_dict["lr"]), dtype=torch.float32),
            exp_avg=exp_avg,
            exp_avg_sq=exp_avg_sq,
            **extra,
        )
        for name, (signs, errors) in compressed.items():
            module = self._modules[name]
            module.discard()
            module.signs, module.errors = signs, errors
        self._set_masks(masks, records)

    def load_adam_state(
        self,
        count: int,
        exp_avg: Mapping[torch.Tensor, torch.Tensor],
        exp_avg_sq: Mapping[torch.Tensor, torch.Tensor],
    ) -> None:
        """Starts from the state of Adam or AdamW (``torch.optim``'s ``exp_avg`` and
        ``exp_avg_sq`` of every param, and its step count), so that a job trained with AdamW
        switches to 1-bit Adam: ``m`` and ``v`` carry over and the update count becomes
        ``count``. The next update is a warmup one for ``count + 1 < freeze_step``, otherwise
        the freeze (its momentum all-gathered from the carried ``m``), also past
        ``freeze_step``: it reports the frozen variance (the warning where training is at risk)
        and logs that the compressed updates start. The error feedback of the
        1-bit allreduce starts at zero, with a warning. ``param_groups[0]["lr"]`` is left as it
        is (an LR scheduler sets it).

        Args:
            count: the updates Adam made (``state["step"]``).
            exp_avg: Adam's ``exp_avg``, by param (the model's DTensor params), each a DTensor
                sharded as its param or this rank's shard of it.
            exp_avg_sq: Adam's ``exp_avg_sq``, likewise.

        Raises:
            ValueError: a param missing from ``exp_avg`` or ``exp_avg_sq``, a shard of another
                shape, a value not finite, a negative ``exp_avg_sq`` or ``count``; nothing was
                changed.
            NotImplementedError: ``exp_avg_mask="auto"`` (its mask is the record of the
                warmup's zero gradients, which Adam did not keep), or 1-bit LAMB (its frozen
                trust ratios average its own warmup updates); nothing was changed.

        Example:
            >>> import torch, torch.distributed as dist
            >>> from torch.distributed.device_mesh import init_device_mesh
            >>> from torch.distributed.fsdp import fully_shard
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
            >>> adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> adamw.step()
            >>> opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
            >>> params = list(model.parameters())
            >>> import warnings
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     warnings.simplefilter("always")
            ...     opt.load_adam_state(
            ...         1,
            ...         {p: adamw.state[p]["exp_avg"] for p in params},
            ...         {p: adamw.state[p]["exp_avg_sq"] for p in params},
            ...     )
            >>> opt.count, len(caught)
            (1, 1)
            >>> dist.destroy_process_group()
        """
        if self._auto_mask:
            raise NotImplementedError(
                f'{self.name}: a start from Adam\'s state with exp_avg_mask="auto" is not '
                "built: the mask is decided from the warmup's zero gradients, which Adam did "
                "not record; pass the mask by hand, or none; nothing was changed"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{self.name}: count must be an int >= 0, got {count!r}")
        moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        for field, given in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            current = getattr(self._state, field)
            for layout in self._layouts:
                for slot in layout.slots:
                    value = given.get(slot.param)
                    if value is None:
                        raise ValueError(
                            f"{self.name}: no {field} for param {slot.name}; nothing was changed"
                        )
                    local = to_local(value)
                    shard = to_local(slot.param)
                    if local.shape != shard.shape:
                        raise ValueError(
                            f"{self.name}: {field} of {slot.name} has the shard shape "
                            f"{tuple(local.shape)}, the param's is {tuple(shard.shape)}; "
                            "nothing was changed"
                        )
                    if not bool(local.isfinite().all()) or (
                        field == "exp_avg_sq" and bool((local < 0).any())
                    ):
                        bad = "negative or non-finite" if field == "exp_avg_sq" else "non-finite"
                        raise ValueError(
                            f"{self.name}: {bad} values in {field} of {slot.name}; nothing "
                            "was changed"
                        )
                    dtype = current[slot.name].dtype
                    moments[field][slot.name] = local.to(dtype=dtype, copy=True)
        self._state = self._state._replace(count=torch.tensor(count, dtype=torch.int64), **moments)
        self._freeze_due = count > 0 and self._rule.is_compressed(count, self._state)
        for module in self._modules.values():
            module.discard()
            module.signs, module.errors = None, None
        warnings.warn(
            f"{self.name}: started from Adam's state at update {count} (m and v carried over); "
            "the error feedback of the 1-bit allreduce starts at zero",
            stacklevel=2,
        )

    def _loaded_fields(self, state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """A subclass's further per-param fields from a :meth:`state_dict`, by field and FQN
        (its ``scalar_fields``, and its ``optional_fields`` with ``None`` where not held)."""
        names = [slot.name for layout in self._layouts for slot in layout.slots]
        extra = {
            field: {k: state_dict[field][k].clone() for k in names} for field in self.scalar_fields
        }
        for field in self.optional_fields:
            held_by = [bool(x) for x in state_dict[f"{field}_held"].tolist()]
            values = [to_local(state_dict[field][k]).clone() for k in names]
            extra[field] = {
                k: x if kept else None for k, x, kept in zip(names, values, held_by, strict=True)
            }
        return extra

    def _own_key(self) -> str:
        """The name of this rank's own entries (its errors): ``rank<r>``, ``r`` its rank in
        the shard group, or on HSDP in the group the optimizer spans (``world``)."""
        return f"rank{self.rank if self._replicas is None else dist.get_rank(self._world)}"

    def _zero_errors(self, layout: ModuleLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """A module's errors before its first compressed update: zeros, worker and server (for
        ``X`` over the shard group, or on HSDP this rank's row over the replicate group)."""
        if self._replicas is None:
            numel, comm = self.comm.world_size * layout.padded_row, self.comm
        else:
            numel, comm = layout.padded_row, self._replicas
        return tuple(init_error_feedback(numel, comm=comm, dtype=self.error_dtype))

    def _momentum_state(
        self, layout: ModuleLayout, signs: PackedSigns | None
    ) -> dict[str, torch.Tensor]:
        """A module's packed momentum in :meth:`state_dict` (zeros for ``None``): all of it,
        the same on every rank, on a 1-D mesh; on HSDP this rank's row (its ``N`` chunks), a
        DTensor over the shard mesh (the same on the ``N`` peers: DCP keeps one copy)."""
        if self._replicas is None:
            world_size = self.comm.world_size
            signs = signs or PackedSigns(
                torch.zeros(world_size, layout.padded_row // 8, dtype=torch.uint8),
                torch.zeros(world_size),
            )
            return {"packed": signs.packed, "scales": signs.scales}
        param = layout.slots[0].param
        packed = torch.zeros(layout.padded_row // 8, dtype=torch.uint8, device=param.device)
        scales = torch.zeros(self._replicas.world_size, device=param.device)
        if signs is not None:
            packed, scales = signs.packed.reshape(-1), signs.scales.reshape(-1)
        return {
            key: DTensor.from_local(
                x, param.device_mesh, [Shard(0)], shape=(self.comm.world_size * x.numel(),),
                stride=(1,),
            )
            for key, x in (("packed", packed), ("scales", scales))
        }  # fmt: skip

    def _loaded_signs(self, saved: dict[str, torch.Tensor]) -> PackedSigns:
        """A module's packed momentum from :meth:`_momentum_state`'s form (or, from another
        mesh, all of it: one chunk per scale)."""
        packed, scales = to_local(saved["packed"]).clone(), to_local(saved["scales"]).clone()
        return PackedSigns(packed.view(scales.numel(), -1), scales)

    def _auto_mask_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``exp_avg_mask="auto"``'s part of :meth:`state_dict`, by module: ``always_zero``,
        the records (a DTensor of the ranks' rows: each rank saves its own; zeros after the
        freeze), and ``exp_avg_mask``, the masks (the same on every rank; zeros before the
        freeze), both bits in the layout of ``X``."""
        world_size = self.comm.world_size
        records, masks = {}, {}
        for layout in self._layouts:
            param = layout.slots[0].param
            size = layout.padded_row // 8
            record = torch.zeros(size, dtype=torch.uint8, device=param.device)
            if self._zero_records is not None:
                record = self._zero_records[layout.name]
            records[layout.name] = DTensor.from_local(
                record, param.device_mesh, [Shard(0)], shape=(world_size * size,), stride=(1,)
            )
            mask = self._masks[layout.name]
            if mask is None:
                mask = torch.zeros(world_size * size, dtype=torch.uint8, device=param.device)
            masks[layout.name] = mask
        return {"always_zero": records, "exp_avg_mask": masks}

    def _loaded_auto_masks(
        self, state_dict: dict[str, Any], saved_layouts: list[ModuleLayout], frozen: bool
    ) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor] | None]:
        """``exp_avg_mask="auto"``'s masks and records (the optimizer's ``_masks`` and
        ``_zero_records``) from a :meth:`state_dict` saved in ``saved_layouts`` (the modules'
        layouts on the mesh it was saved on), in this mesh's layout: after the freeze
        (``frozen``) the masks, before it the records."""
        masks: dict[str, torch.Tensor | None] = {x.name: None for x in self._layouts}
        records = {}
        for layout, old in zip(self._layouts, saved_layouts, strict=True):
            if frozen:
                masks[layout.name] = relaid_mask(layout, state_dict["exp_avg_mask"][old.name], old)
                continue
            saved = state_dict["always_zero"][layout.name]
            if isinstance(saved, DTensor):  # dcp.load into state_dict(): this rank's own row
                records[layout.name] = saved.to_local().clone()
                continue
            seen = relaid_mask(layout, saved.bitwise_not(), old)
            size = layout.padded_row // 8
            records[layout.name] = seen[self.rank * size : (self.rank + 1) * size].bitwise_not()
        return masks, None if frozen else records

    def _header(self) -> torch.Tensor:
        """``[format, world size, updates made, crc of the layout, crc of the settings]``, the
        world size that of the shard group; on HSDP followed by ``N``, the replicas."""
        hsdp = [] if self._replicas is None else [self._replicas.world_size]
        return torch.tensor(
            [_FORMAT, self.comm.world_size, self.count, *self._fingerprints(), *hsdp],
            dtype=torch.int64,
        )

    def _fingerprints(self) -> tuple[int, int]:
        layout = repr(
            [(x.name, [(s.name, tuple(s.param.shape)) for s in x.slots]) for x in self._layouts]
        )
        group = self.param_groups[0]  # the rule's settings (not lr, nor a scheduler's keys)
        fixed = {k: group[k] for k in self._setting_names}
        masks = (self._mask_setting,) if self._mask_setting else ()  # (older ones had none)
        settings = repr((fixed, str(self.error_dtype), *masks))
        return zlib.crc32(layout.encode()), zlib.crc32(settings.encode())

    def _same_mesh(self, world_size: int, replicas: int) -> bool:
        """Whether a checkpoint saved on ``replicas`` x ``world_size`` ranks (replicate x
        shard; ``1`` x ``W`` for a 1-D mesh) was saved on this optimizer's mesh shape."""
        here = 1 if self._replicas is None else self._replicas.world_size
        return (world_size, replicas) == (self.comm.world_size, here)

    def _checked_header(self, header: torch.Tensor, auto_saved: bool) -> tuple[int, int, int]:
        """The checkpoint's shard world size, replicas (``N``; ``1`` for a 1-D mesh) and update
        count, or ``ValueError`` if it is not a checkpoint of this model and these settings
        (``auto_saved``: whether it holds ``exp_avg_mask="auto"``'s records)."""
        values = header.tolist()
        if len(values) not in (5, 6) or values[0] != _FORMAT:
            raise ValueError(
                f"{self.name}: not a checkpoint of this format (header {values}); "
                "nothing was loaded"
            )
        _, world_size, count, layout, settings, *hsdp = values
        replicas = hsdp[0] if hsdp else 1
        layout_now, settings_now = self._fingerprints()
        if layout != layout_now:
            raise ValueError(
                f"{self.name}: the checkpoint is of another model (its FSDP2 modules, "
                "params or shapes differ); nothing was loaded"
            )
        if auto_saved != self._auto_mask:
            made, here = ("", "not ") if auto_saved else ("not ", "")
            raise ValueError(
                f'{self.name}: the checkpoint was saved with exp_avg_mask {made}"auto", this '
                f"optimizer's is {here}\"auto\" (the records of the warmup's zero gradients "
                "are in the state); build the optimizer as the checkpoint's was; nothing was "
                "loaded"
            )
        if settings != settings_now:
            raise ValueError(
                f"{self.name}: the checkpoint was saved with other settings (its "
                "hyperparameters, exp_avg_mask or error_dtype); nothing was loaded"
            )
        if world_size < 1 or replicas < 1 or count < 0:
            raise ValueError(f"{self.name}: corrupt checkpoint header {values}")
        return world_size, replicas, count


def _mesh(world_size: int, replicas: int) -> str:
    if replicas == 1:
        return f"world size {world_size}"
    return f"an HSDP mesh of {replicas} x {world_size} ranks (replicate x shard)"


def not_torch_format(name: str) -> str:
    return (
        f"{name}: its state is not torch.optim's per-param form (the packed momentum and "
        "the error feedback belong to FSDP2 modules and ranks, not params), so "
        "torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict (and "
        "get_/set_optimizer_state_dict) cannot carry it; nothing was changed. Save and load "
        "with fn.fsdp.TrainingCheckpoint(model, optimizer).save(path) / .load(path), or "
        "dcp.save({'optim': optimizer.state_dict()}) and fn.fsdp.read_onebit_state"
    )


def auto_scalars(auto: Any) -> dict[str, torch.Tensor]:
    """The 0-dim fields of a state's ``auto`` (``freeze_step="auto"``'s decision and
    statistics, the same on every rank), by name."""
    return {k: v for k, v in auto._asdict().items() if isinstance(v, torch.Tensor)}
