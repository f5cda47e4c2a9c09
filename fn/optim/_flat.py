"""Contiguous flat storage for one param group of the ``torch.optim`` adapter (``fn.optim``;
its "Flat buffers" and "Mixed precision" policies say what users see).

The group's params are copied, in order, into one 1-D buffer and each param's ``.data`` becomes an
alias of its slice (made by copying and assigning ``.data``; storages are never swapped with
``set_``). Each alias has a storage of its own covering exactly its param's bytes (a DLPack
round trip of the slice: about a microsecond per param at construction, nothing per step, no
extra memory), so ``safetensors`` and ``accelerate`` see ordinary, separate params; a device
without DLPack support gets plain views of the buffer (only those libraries then see one shared
storage). PyTorch's version counters are not used to find writes to the params, since writes
through ``.data`` do not bump them: :meth:`FlatGroup.sync_master` compares instead.
"""

from __future__ import annotations

import torch
from torch.utils import dlpack

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class FlatGroup:
    """The flat buffers of one param group.

    Attributes:
        params: the group's params (their ``.data`` alias slices of ``model``).
        shapes: the params' shapes.
        numel: total elements ``n``.
        model: ``[n]`` in the params' dtype: the params' storage.
        master: ``[n]``, fp32 for fp16/bf16 params (a separate copy), else ``model`` itself.

    Args:
        params: the params (all of one dtype and device, floating point, dense).

    Raises:
        ValueError: mixed dtypes or devices, or a non floating-point or sparse param.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if not p.is_floating_point() or p.is_sparse:
                raise ValueError(
                    f"fn.optim needs dense floating-point params, got {p.dtype} ({p.layout})"
                )
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(
                "all params of a group must share dtype and device (put them in separate param "
                f"groups); got {sorted(str(k) for k in kinds)}"
            )
        dtype, device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self._numels = [p.numel() for p in params]
        self._offsets = [sum(self._numels[:i]) for i in range(len(params))]
        self.numel = sum(self._numels)
        self.model = torch.empty(self.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, view in zip(params, self.views(self.model), strict=True):
                view.copy_(p.detach())
                p.data = _alias(view)
        self.master = self.model.float() if dtype in _LOW_PRECISION else self.model
        # [n] in the master's dtype: the gradient buffer of gather_grads (None before its call)
        self.grads: torch.Tensor | None = None
        # why the last gather_grads could not take this rank's gradients (a sparse one), or None
        self.unusable: str | None = None
        self._grad_views: list[torch.Tensor] | None = None
        self._ptrs = [p.data_ptr() for p in params]

    @property
    def has_master_copy(self) -> bool:
        """True if ``master`` is an fp32 copy of lower-precision params."""
        return self.master is not self.model

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-param views (with the params' shapes) of a ``[n]`` tensor."""
        return [
            flat[o : o + n].view(s)
            for o, n, s in zip(self._offsets, self._numels, self.shapes, strict=True)
        ]

    def tree(self, flat: torch.Tensor, flatten: bool) -> torch.Tensor | list[torch.Tensor]:
        """What the functional transform sees: ``flat`` itself, or the per-param views of it."""
        return flat if flatten else self.views(flat)

    @torch.no_grad()
    def gather_grads(self) -> torch.Tensor:
        """The params' gradients as one ``[n]`` tensor in the master's dtype: the group's
        gradient buffer, allocated once and rewritten by every call (the optimizer donates it
        to the update as the updates' buffer; see :meth:`release_grads`).

        A param whose ``.grad`` is ``None`` contributes zeros, and so does one whose gradient is
        not dense: :attr:`unusable` then says why (a check on this rank alone, which the adapter
        agrees on with the other ranks before it raises, so that no rank waits in a collective).
        """
        if self.grads is None:
            self.grads = torch.empty(self.numel, dtype=self.master.dtype, device=self.master.device)
            self._grad_views = self.views(self.grads)
        self.unusable = None
        for index, (p, view) in enumerate(zip(self.params, self._grad_views, strict=True)):
            g = p.grad
            if g is None:
                view.zero_()
            elif g.layout != torch.strided:
                view.zero_()
                self.unusable = self.unusable or (
                    f"param {index} of shape {tuple(p.shape)} has a {g.layout} gradient; "
                    "fn.optim takes dense gradients only (e.g. nn.Embedding(sparse=False))"
                )
            else:
                view.copy_(g)
        return self.grads

    def release_grads(self) -> None:
        """Lets the next :meth:`gather_grads` allocate a new buffer (for when something kept
        the current one, e.g. a transform that keeps its gradient in its state)."""
        self.grads = self._grad_views = None

    @torch.no_grad()
    def adopt(self) -> None:
        """Takes back every param whose ``.data`` was replaced since the optimizer was built
        (``model.to(<same device>)``, ``p.data = t``): its current values are copied into its
        slice of the buffer and its ``.data`` aliases that slice again.

        Raises:
            RuntimeError: such a param has another device, dtype or shape than its slice (the
                buffer cannot follow it); nothing is changed then.
        """
        moved = [i for i, p in enumerate(self.params) if p.data_ptr() != self._ptrs[i]]
        for i in moved:
            p = self.params[i]
            if p.device != self.model.device or p.dtype != self.model.dtype:
                raise RuntimeError(
                    f"param {i} of shape {self.shapes[i]} was moved to {p.device}, "
                    f"{p.dtype} after the optimizer was built (its buffer and state are on "
                    f"{self.model.device}, {self.model.dtype}): move or cast the model before "
                    "building the optimizer, or build a new one (state_dict()/"
                    "load_state_dict() carries the state over)"
                )
            if tuple(p.shape) != self.shapes[i]:
                raise RuntimeError(
                    f"param {i} changed shape from {self.shapes[i]} to {tuple(p.shape)} after "
                    "the optimizer was built: build the optimizer for the new model"
                )
        views = self.views(self.model)
        for i in moved:
            p = self.params[i]
            views[i].copy_(p.data)
            p.data = _alias(views[i])
            self._ptrs[i] = p.data_ptr()

    @torch.no_grad()
    def sync_master(self) -> None:
        """Takes into the fp32 master every param element written since the last step.

        Elementwise: ``master[i] <- model[i]`` where the bits of ``model[i]`` differ from those
        of ``dtype(master[i])``, so any write is seen (through ``.data`` too) and an element
        that still equals its master cast to the params' dtype keeps its exact fp32 master. One
        comparison pass over the group's buffer (and one more only if something was written);
        nothing to do without a separate master copy. Params whose storage was replaced are
        re-adopted first (:meth:`adopt`).
        """
        self.adopt()
        if not self.has_master_copy:
            return
        # fp16/bf16 compared as their 16-bit patterns: bit-exact and much faster than float ne
        cast = self.master.to(self.model.dtype).view(torch.int16)
        written = torch.ne(cast, self.model.view(torch.int16))  # [n] bool
        if written.any():
            torch.where(written, self.model, self.master, out=self.master)

    check_params = sync_master  # before a step (raises as :meth:`adopt`)

    @torch.no_grad()
    def add(self, updates: torch.Tensor | list[torch.Tensor | None] | None) -> None:
        """``master += updates`` in place (a ``[n]`` tensor or per-param tensors; ``None`` leaves
        nothing to add), the same sums as ``fn.apply_updates``, then casts into the params."""
        if isinstance(updates, torch.Tensor):
            self.master.add_(updates)
        elif updates is not None:
            pairs = [
                (view, u)
                for view, u in zip(self.views(self.master), updates, strict=True)
                if u is not None
            ]
            if pairs:
                torch._foreach_add_([view for view, _ in pairs], [u for _, u in pairs])
        if self.has_master_copy:
            self.model.copy_(self.master)

    @torch.no_grad()
    def load_master(self, master: torch.Tensor | None) -> None:
        """Sets the master copy from a checkpoint (``None``: from the params' current values)
        and the params from it. Without a separate master copy this does nothing: the params are
        their own master and come from the model's checkpoint. Params whose storage was replaced
        are re-adopted first (:meth:`adopt`)."""
        self.adopt()
        if not self.has_master_copy:
            return
        if master is None:
            self.master.copy_(self.model)
        else:  # of the checked shape (fn.optim._checkpoint.check_master)
            self.master.copy_(master)
            self.model.copy_(self.master)


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on the memory of ``view`` whose storage covers exactly that memory (a DLPack
    round trip, which keeps ``view``'s storage alive); ``view`` itself where the device has no
    DLPack support."""
    try:
        return dlpack.from_dlpack(dlpack.to_dlpack(view))
    except (BufferError, RuntimeError, TypeError):
        return view
