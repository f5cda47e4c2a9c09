"""The public kernels, each declared once (``fn.kernels._spec``): its op's schema, shape rule,
vmap rule and reference, and its public function from the checks under ``@declare``
(:func:`fn.kernels._spec.declare`).
``sign_compress`` and ``loco_quantize`` pick one of two ops (without / with the error, a fresh /
a given output); ``adam_apply`` and ``adamw_step`` are eager kernels without an op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fn.kernels import _reference
from fn.kernels._spec import ELEMENTWISE, Op, declare, eager, kernel


def _check_1d(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D tensor, got {shape}")


@declare(
    "packbits(Tensor x) -> Tensor",
    fake=lambda x: x.new_empty((x.numel() + 7) // 8, dtype=torch.uint8),
    reference=_reference.packbits,
)
def packbits(x: torch.Tensor) -> torch.Tensor:
    """Packs the signs of ``x`` (bit 1 for ``x >= 0``, ``-0.0`` included), MSB first.

    Args:
        x: 1-D tensor of ``n`` elements.

    Returns:
        uint8 tensor of ``ceil(n / 8)`` bytes, equal to ``numpy.packbits(x >= 0)``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> K.packbits(torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, 5.0, -4.0])).tolist()
        [187, 0]
    """
    _check_1d(x, "x")


@declare(
    "unpackbits(Tensor bits, int n, ScalarType dtype) -> Tensor",
    fake=lambda bits, n, dtype: bits.new_empty(n, dtype=dtype),
    reference=_reference.unpackbits,
)
def unpackbits(bits: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpacks the first ``n`` signs packed by :func:`packbits`.

    Args:
        bits: 1-D uint8 tensor of at least ``ceil(n / 8)`` bytes.
        n: number of values.
        dtype: output dtype.

    Returns:
        1-D tensor of ``n`` values, ``+1`` where the bit is set and ``-1`` elsewhere.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> K.unpackbits(torch.tensor([187], dtype=torch.uint8), 5).tolist()
        [1.0, -1.0, 1.0, 1.0, 1.0]
    """
    _check_1d(bits, "bits")
    if bits.dtype != torch.uint8:
        raise ValueError(f"bits must be uint8, got {bits.dtype}")
    if n < 0 or bits.shape[0] * 8 < n:
        raise ValueError(f"{bits.shape[0]} bytes cannot hold n={n} signs")


def _signs_and_scale(error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        error.new_empty((error.numel() + 7) // 8, dtype=torch.uint8),
        error.new_empty((), dtype=torch.float32),
    )


def _codes_like(
    x: torch.Tensor, numel: int, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        x.new_empty(numel * bits // 8, dtype=torch.uint8),
        x.new_empty(numel // group_size, dtype=torch.float32),
    )


_SIGN_COMPRESS = Op(
    "sign_compress(Tensor m) -> (Tensor, Tensor)",
    fake=_signs_and_scale,
    reference=_reference.sign_compress,
    call=lambda impl, m: impl(m)[:2],
    finite=1,
)
_SIGN_COMPRESS_EF = Op(
    "sign_compress_ef(Tensor m, Tensor error) -> (Tensor, Tensor, Tensor)",
    fake=lambda m, error: (*_signs_and_scale(m), m.new_empty(m.numel(), dtype=torch.float32)),
    reference=_reference.sign_compress,
    finite=1,
)


def sign_compress(
    m: torch.Tensor, error: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Error-compensated 1-bit compression (Seide et al. 2014; 1-bit Adam, Tang et al. 2021).

    .. math::
        v = m + e, \\quad a = \\lVert v \\rVert_2 / \\sqrt{n}, \\quad
        e' = v - a\\,\\mathrm{sign}(v), \\quad \\mathrm{sign}(0) = +1

    Args:
        m: 1-D tensor of ``n`` elements (computed in fp32).
        error: the error to compensate with (same shape), or ``None`` for plain compression.

    Returns:
        ``(packed, scale, new_error)``, the packed signs of ``v`` (uint8, ``ceil(n / 8)``), ``a``
        as a 0-dim fp32 tensor (0 for ``n == 0``), and ``e'`` (fp32) or ``None`` without error.

    Raises:
        ValueError: when the scale is non-finite (NaN/Inf in ``m`` or ``error``).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m = torch.tensor([1.0, 7.0, -7.0, -1.0])
        >>> packed, scale, error = K.sign_compress(m, torch.zeros(4))
        >>> packed.tolist(), scale.item(), error.tolist()
        ([192], 5.0, [-4.0, 2.0, -2.0, 4.0])
    """
    _check_1d(m, "m")
    if error is None:
        packed, scale = _SIGN_COMPRESS(m)
        return packed, scale, None
    _check_1d(error, "error")
    if error.shape != m.shape:
        raise ValueError(f"error shape {tuple(error.shape)} != m shape {tuple(m.shape)}")
    return _SIGN_COMPRESS_EF(m, error)


# The dtypes an error of the feedback ops may be stored in (read as fp32, written rounded once).
_ERROR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_error_buffer(t: torch.Tensor, name: str, numel: int | None = None) -> None:
    _check_1d(t, name)
    if t.dtype not in _ERROR_DTYPES or (numel is not None and t.numel() != numel):
        length = "" if numel is None else f" of {numel} elements"
        raise ValueError(
            f"{name} must be a 1-D fp32, bf16 or fp16 tensor{length}, got {t.dtype} "
            f"{tuple(t.shape)}"
        )


def _check_feedback_input(
    x: torch.Tensor | None,
    error: torch.Tensor,
    grad: torch.Tensor | None,
    signs: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, torch.Tensor | None]:
    """Raises for a bad source of the feedback ops; returns the op's ``packed`` and ``scales``
    arguments (``None`` without ``signs``)."""
    _check_error_buffer(error, "error")
    if signs is None:
        if x is None:
            raise ValueError("x is required unless the momentum is given as signs")
        _check_1d(x, "x")
        if grad is not None and grad.shape != x.shape:
            raise ValueError(f"grad shape {tuple(grad.shape)} != x shape {tuple(x.shape)}")
        source, name = x, "x"
    else:
        if x is not None:
            raise ValueError("give the previous momentum as x or as signs, not both (x=None)")
        if grad is None:
            raise ValueError("signs need grad: the momentum is beta * m + (1 - beta) * grad")
        _check_1d(grad, "grad")
        if not isinstance(signs, tuple) or len(signs) != 2:
            raise ValueError("signs must be a (packed, scales) tuple")
        _check_scaled_signs(*signs, grad.numel(), "grad's")
        source, name = grad, "grad"
    if source.numel() > error.numel():
        raise ValueError(f"{name} has {source.numel()} elements, more than error's {error.numel()}")
    packed, scales = (None, None) if signs is None else signs
    return {"packed": packed, "scales": scales}


def _check_scaled_signs(packed: torch.Tensor, scales: torch.Tensor, n: int, what: str) -> None:
    """Raises unless ``(packed, scales)`` are :func:`unpack_scaled`'s rows holding the ``n``
    values named ``what``."""
    _check_sign_rows(packed, scales)
    if scales.dtype != torch.float32:
        raise ValueError(f"scales must be fp32, got {scales.dtype}")
    if packed.numel() * 8 < n:
        raise ValueError(f"signs must hold {what} {n} values, got {packed.numel() * 8}")


def _signs(
    packed: torch.Tensor | None, scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernels' ``signs`` argument from the feedback ops' ``packed`` and ``scales``."""
    return None if packed is None else (packed, scales)


@declare(
    "feedback_sign_compress(Tensor? x, Tensor error, Tensor? grad, float beta, Tensor? packed, "
    "Tensor? scales) -> (Tensor, Tensor)",
    fake=lambda x, error, grad, beta, packed, scales: _signs_and_scale(error),
    reference=_reference.feedback_sign_compress,
    call=lambda impl, x, error, grad, beta, packed, scales: impl(
        x, error, grad, beta, _signs(packed, scales)
    ),
)
def feedback_sign_compress(
    x: torch.Tensor | None,
    error: torch.Tensor,
    *,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of error-compensated sign compression, without a padded or summed copy.

    .. math::
        v = \\mathrm{pad}_N(x) + e \\quad\\text{or}\\quad
        v = \\mathrm{pad}_N(\\beta x + (1 - \\beta) g) + e, \\qquad
        a = \\lVert v \\rVert_2 / \\sqrt{N}

    The signs and the scale are those of :func:`sign_compress` of the zero-padded input, bit
    for bit; with ``grad`` the momentum is rounded as ``(beta * x) + ((1 - beta) * grad)``.
    The previous momentum may come as the packed signs of a 1-bit allreduce instead (``signs``,
    ``x=None``): the results are those of ``x = unpack_scaled(*signs, torch.empty(n))``, and
    no fp32 copy of it is made on the CPU.
    Nothing is checked or written: the caller checks the scale (on every rank), then calls
    :func:`feedback_apply_error` to write the new error.

    Args:
        x: 1-D fp32 tensor of ``n <= N`` elements (the momentum ``m`` when ``grad`` is given),
            or ``None`` with ``signs``.
        error: 1-D tensor of ``N`` elements, the error to compensate with: fp32, or bf16 or fp16
            (read as fp32; the C kernels read fp32 and bf16, the reference any of them).
        grad: optional gradient, ``x``'s shape: compress ``beta * x + (1 - beta) * grad``
            (required with ``signs``, where it gives ``n``).
        beta: the momentum coefficient (with ``grad``).
        signs: ``(packed, scales)`` as for :func:`unpack_scaled` (uint8 ``[R, chunk / 8]``,
            fp32 ``[R]``, ``R * chunk >= n``): the previous momentum ``m``, value ``i`` being
            ``scales[i // chunk]`` signed by bit ``i``; ``None``: ``x``.

    Returns:
        ``(packed, scale)``, the packed signs of ``v`` (``ceil(N / 8)`` bytes) and ``a`` (0-dim
        fp32; NaN or Inf when ``v`` is not finite).

    Raises:
        ValueError: for shapes that do not fit, ``x`` and ``signs`` both given (or neither),
            ``signs`` without ``grad``, or ``signs`` that are not uint8 rows and fp32 scales.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> x, error = torch.tensor([6.0, -8.0]), torch.zeros(4)
        >>> packed, scale = K.feedback_sign_compress(x, error)
        >>> packed.tolist(), scale.item()  # the padding is zeros: their signs are +1
        ([176], 5.0)
        >>> K.feedback_apply_error(x, error, scale, error).tolist()  # in place
        [1.0, -3.0, -5.0, -5.0]
        >>> signs = (torch.tensor([[0b01000000]], dtype=torch.uint8), torch.tensor([2.0]))
        >>> g = torch.tensor([4.0, 4.0])  # m = [-2, 2]: v = 0.5 * m + 0.5 * g = [1, 3, 0, 0]
        >>> K.feedback_sign_compress(None, torch.zeros(4), grad=g, beta=0.5, signs=signs)[1]
        tensor(1.5811)
    """
    return {"beta": float(beta), **_check_feedback_input(x, error, grad, signs)}


@declare(
    "feedback_apply_error(Tensor? x, Tensor error, Tensor scale, Tensor(a!) out, Tensor? grad, "
    "float beta, Tensor? packed, Tensor? scales) -> ()",
    reference=_reference.feedback_apply_error,
    call=lambda impl, x, error, scale, out, grad, beta, packed, scales: impl(
        x, error, scale, out, grad, beta, _signs(packed, scales)
    ),
    returns="out",
)
def feedback_apply_error(
    x: torch.Tensor | None,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    *,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Phase 2 of :func:`feedback_sign_compress`: writes ``e' = v - a s(v)`` into ``out``.

    ``v`` is recomputed from the same ``x`` (or ``signs``), ``error``, ``grad`` and ``beta``;
    ``out`` may be ``error`` itself (each element is read before it is written).

    Args:
        x, error, grad, beta, signs: as given to :func:`feedback_sign_compress`.
        scale: the scale it returned.
        out: 1-D tensor of ``error``'s length, fp32, bf16 or fp16: ``e'`` is computed in fp32
            and rounded once to ``out``'s dtype.

    Returns:
        ``out``.

    Raises:
        ValueError: as :func:`feedback_sign_compress`, or for an ``out`` of another length.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m, g = torch.tensor([2.0, -6.0]), torch.tensor([4.0, -2.0])
        >>> error = torch.zeros(4)
        >>> packed, scale = K.feedback_sign_compress(m, error, grad=g, beta=0.5)
        >>> scale.item()  # v = 0.5 * m + 0.5 * g, padded: [3, -4, 0, 0]
        2.5
        >>> K.feedback_apply_error(m, error, scale, torch.empty(4), grad=g, beta=0.5).tolist()
        [0.5, -1.5, -2.5, -2.5]
    """
    arguments = _check_feedback_input(x, error, grad, signs)
    _check_error_buffer(out, "out", error.numel())
    return {"beta": float(beta), **arguments}


def _check_sign_rows(signs: torch.Tensor, weights: torch.Tensor) -> None:
    if signs.dim() != 2 or signs.dtype != torch.uint8:
        raise ValueError(
            f"signs must be a 2-D uint8 tensor [W, chunk / 8], got {signs.dtype} "
            f"{tuple(signs.shape)}"
        )
    if weights.shape != (signs.shape[0],):
        raise ValueError(f"weights must have shape ({signs.shape[0]},), got {tuple(weights.shape)}")


@declare(
    "sign_sum_compress(Tensor signs, Tensor weights, Tensor error) -> (Tensor, Tensor)",
    fake=lambda signs, weights, error: _signs_and_scale(error),
    reference=_reference.sign_sum_compress,
)
def sign_sum_compress(
    signs: torch.Tensor, weights: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of the 1-bit allreduce's server compression, without unpacked signs.

    .. math::
        v_k = \\textstyle\\sum_i w_i\\, s_i[k] + e_k, \\quad a = \\lVert v \\rVert_2 / \\sqrt{n}

    The ``[W, chunk]`` rows of ``+-w_i`` are added in rank order (:func:`sum_ranks`), so the
    bits are those of the reference path.

    Args:
        signs: uint8 ``[W, chunk / 8]``, row ``i`` the packed signs ``s_i``.
        weights: fp32 ``[W]``.
        error: 1-D tensor of ``chunk`` elements: fp32, bf16 or fp16, read as fp32 (as
            :func:`feedback_sign_compress`'s).

    Returns:
        ``(packed signs of v, a)`` as :func:`feedback_sign_compress`.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> signs = torch.tensor([[0b11000000], [0b10100000]], dtype=torch.uint8)
        >>> error = torch.zeros(8)
        >>> packed, scale = K.sign_sum_compress(signs, torch.tensor([1.0, 3.0]), error)
        >>> packed.tolist(), round(scale.item() ** 2, 4)  # v = [4, -2, 2, -4, -4, -4, -4, -4]
        ([160], 13.0)
    """
    _check_sign_rows(signs, weights)
    _check_error_buffer(error, "error", signs.shape[1] * 8)


@declare(
    "sign_sum_apply_error(Tensor signs, Tensor weights, Tensor error, Tensor scale, "
    "Tensor(a!) out) -> ()",
    reference=_reference.sign_sum_apply_error,
    returns="out",
)
def sign_sum_apply_error(
    signs: torch.Tensor,
    weights: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Phase 2 of :func:`sign_sum_compress`: writes ``e' = v - a s(v)`` into ``out`` (which
    may be ``error``) and returns it; ``out`` is fp32, bf16 or fp16, ``e'`` computed in fp32 and
    rounded once to its dtype.

    Args:
        signs: uint8 ``[W, chunk / 8]``, as given to :func:`sign_sum_compress`.
        weights: fp32 ``[W]``, as given to it.
        error: the error it was given (``chunk`` elements).
        scale: ``a``, the scale it returned.
        out: 1-D tensor of ``chunk`` elements, the new error's buffer (may be ``error``).

    Returns:
        ``out``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> signs, weights = torch.tensor([[0b11000000]], dtype=torch.uint8), torch.ones(1)
        >>> error = torch.zeros(8)
        >>> _, scale = K.sign_sum_compress(signs, weights, error)
        >>> K.sign_sum_apply_error(signs, weights, error, scale, error).tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    _check_sign_rows(signs, weights)
    _check_error_buffer(error, "error", signs.shape[1] * 8)
    _check_error_buffer(out, "out", signs.shape[1] * 8)


@declare(
    "unpack_scaled(Tensor packed, Tensor scales, Tensor(a!) out) -> ()",
    reference=_reference.unpack_scaled,
    returns="out",
)
def unpack_scaled(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes ``scales[r] * s(packed[r])`` of the rows ``r``, concatenated, into ``out`` (its
    first ``out.numel()`` values), without unpacked signs.

    Args:
        packed: uint8 ``[W, chunk / 8]``.
        scales: fp32 ``[W]``.
        out: 1-D fp32 tensor of at most ``W * chunk`` elements.

    Returns:
        ``out``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> packed = torch.tensor([[0b10000000], [0b01000000]], dtype=torch.uint8)
        >>> K.unpack_scaled(packed, torch.tensor([1.0, 2.0]), torch.empty(10)).tolist()
        [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -2.0, 2.0]
    """
    _check_sign_rows(packed, scales)
    _check_1d(out, "out")
    if out.dtype != torch.float32 or out.numel() > packed.numel() * 8:
        raise ValueError(f"out must be fp32 with at most {packed.numel() * 8} elements")


@declare(
    "adam_direction(Tensor m, Tensor v, Tensor? p, Tensor eta, Tensor(a!) out, float eps, "
    "float? bound, float weight_decay) -> ()",
    reference=_reference.adam_direction,
    returns="out",
)
def adam_direction(
    m: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float,
    bound: float | None = None,
    weight_decay: float = 0.0,
    p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The update of a compressed Adam step of the 1-bit family, written into ``out``.

    .. math::
        u = -\\eta\\,\\big(\\mathrm{clamp}(m / (\\sqrt{v} + \\epsilon), -B, B) + \\lambda p\\big)

    rounded as ``fn.onebit_adam`` computes it (no clamp when ``bound`` is ``None``; the decay
    term only with ``p``; ``sqrt`` correctly rounded, :func:`sqrt_rn`).

    Args:
        m, v: fp32 momentum and variance (same shape as ``out``).
        eta: the learning rate, a 0-dim fp32 tensor.
        out: fp32 tensor to write (it may be ``m``).
        eps, bound, weight_decay, p: as above.

    Returns:
        ``out``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m, v = torch.tensor([1.0, -8.0]), torch.tensor([4.0, 1.0])
        >>> K.adam_direction(m, v, torch.tensor(0.5), torch.empty(2), eps=0.0, bound=4.0).tolist()
        [-0.25, 2.0]
    """
    for name, t in (("m", m), ("v", v), ("out", out)) + ((("p", p),) if p is not None else ()):
        if t.shape != out.shape or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 of out's shape {tuple(out.shape)}")
    return {
        "p": p if weight_decay else None,
        "eps": float(eps),
        "bound": None if bound is None else float(bound),
        "weight_decay": float(weight_decay),
    }


_ADAM_APPLY = eager(_reference.adam_apply)


def adam_apply(
    m: torch.Tensor | None,
    v: torch.Tensor,
    eta: torch.Tensor,
    params: torch.Tensor,
    *,
    eps: float,
    bound: float | None = None,
    weight_decay: float = 0.0,
    root: torch.Tensor | None = None,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The update of :func:`adam_direction` added to the params in place, with the values of
    ``params.add_(adam_direction(m, v, eta, out, ..., p=params))``.

    .. math::
        p \\leftarrow p - \\eta\\,\\big(\\mathrm{clamp}(m / (\\sqrt{v} + \\epsilon), -B, B)
            + \\lambda p\\big)

    rounded as ``fn.onebit_adam``'s update followed by ``fn.apply_updates``. On the CPU, for
    contiguous fp32 tensors, a C kernel reads ``m``, ``v`` and the params once and writes the
    params; given the momentum as the signs of a 1-bit allreduce (docs/algorithms.md, "1-bit Adam"),
    it writes ``m`` in that pass, or with ``m=None`` nowhere. Eager tensors only (not a custom op).

    Args:
        m, v: fp32 momentum and variance (the params' shape); ``m`` may be ``None`` with
            ``signs``.
        eta: the learning rate, a 0-dim fp32 tensor.
        params: fp32 params, updated in place.
        eps, bound, weight_decay: as :func:`adam_direction` (the decay term uses ``params``).
        root: fp32 scratch of the params' shape that an implementation may overwrite (the
            reference writes the update there; the C kernel needs none), or ``None``.
        signs: ``(packed, scales)`` as for :func:`unpack_scaled` (uint8 ``[W, chunk / 8]``,
            fp32 ``[W]``, ``chunk`` a multiple of 8 with ``W * chunk`` at least the params'
            size), whose values ``m`` receives first; ``None``: ``m`` is read.

    Returns:
        ``params``.

    Raises:
        ValueError: a tensor that is not fp32 of the params' shape, ``m=None`` without
            ``signs``, or ``signs`` that are not uint8 rows with fp32 scales holding the params'
            size.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m, v, p = torch.tensor([1.0, -8.0]), torch.tensor([4.0, 1.0]), torch.ones(2)
        >>> K.adam_apply(m, v, torch.tensor(0.5), p, eps=0.0, bound=4.0).tolist()
        [0.75, 3.0]
        >>> signs = (torch.tensor([[0b10000000]], dtype=torch.uint8), torch.tensor([2.0]))
        >>> K.adam_apply(None, v, torch.tensor(0.5), p, eps=0.0, signs=signs).tolist()  # m=[2, -2]
        [0.25, 4.0]
    """
    for name, t in (("m", m), ("v", v), ("params", params), ("root", root)):
        if t is not None and (t.shape != params.shape or t.dtype != torch.float32):
            raise ValueError(f"adam_apply: {name} must be fp32 of the params' shape")
    if signs is None and m is None:
        raise ValueError("adam_apply: m is required unless the momentum is given as signs")
    if signs is not None:
        try:
            _check_scaled_signs(*signs, params.numel(), "the params'")
        except ValueError as error:
            raise ValueError(f"adam_apply: {error}") from None
    constants = (float(eps), None if bound is None else float(bound), float(weight_decay))
    kernel(_ADAM_APPLY, params.device)(m, v, eta, params, root, *constants, signs)
    return params


_ADAMW_STEP = eager(_reference.adamw_step)


def adamw_step(
    ps: Sequence[torch.Tensor],
    gs: Sequence[torch.Tensor],
    ms: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    m_outs: Sequence[torch.Tensor] | None = None,
    v_outs: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One AdamW step applied to the params in place, with the values of ``fn.adamw``'s
    update followed by ``fn.apply_updates``.

    For each param ``p`` with gradient ``g`` and moments ``m``, ``v``:

    .. math::
        m_t = \\beta_1 m + (1 - \\beta_1) g, \\quad v_t = \\beta_2 v + (1 - \\beta_2) g^2,
        \\quad p' = (1 - \\eta\\lambda) p - \\frac{\\eta}{1 - \\beta_1^t}\\,
        \\frac{m_t}{\\sqrt{v_t} / \\sqrt{1 - \\beta_2^t} + \\epsilon},
        \\quad p \\leftarrow p + (p' - p)

    where ``p'``, ``m_t`` and ``v_t`` are those of ``torch._fused_adamw_``, the kernel of
    ``torch.optim.AdamW(fused=True)``, which it runs (on the CPU a cache-sized batch of the
    leaves at a time), and ``p + (p' - p)`` is rounded as ``apply_updates`` adds the update
    ``p' - p``. Eager tensors only (not a custom op).

    Reference: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.

    Args:
        ps: the params (updated in place), tensors of one device.
        gs: their gradients (only read).
        ms, vs: the first and second moments (only read, unless they are the outputs).
        step: ``t``, the number of this update (1 for the first).
        lr: the learning rate ``eta``.
        betas: ``(beta1, beta2)``.
        eps: the denominator term ``epsilon``.
        weight_decay: the decoupled decay ``lambda``.
        m_outs, v_outs: where the new moments go (``None``: into ``ms``, ``vs``).

    Returns:
        ``(m_outs, v_outs)`` as lists.

    Raises:
        ValueError: when the lists differ in length, or a tensor differs from its param in
            shape, dtype or device.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> p, g = torch.tensor([1.0, -2.0]), torch.tensor([0.5, -0.25])
        >>> _ = K.adamw_step(
        ...     [p], [g], [torch.zeros(2)], [torch.zeros(2)],
        ...     step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5,
        ... )
        >>> p  # (1 - 0.1 * 0.5) * p - 0.1 * sign(g)
        tensor([ 0.8500, -1.8000])
    """
    m_outs = list(ms if m_outs is None else m_outs)
    v_outs = list(vs if v_outs is None else v_outs)
    lists = {"gs": gs, "ms": ms, "vs": vs, "m_outs": m_outs, "v_outs": v_outs}
    for name, ts in lists.items():
        if len(ts) != len(ps):
            raise ValueError(f"adamw_step: {name} has {len(ts)} tensors for {len(ps)} params")
        for t, p in zip(ts, ps, strict=True):
            if t.shape != p.shape or t.dtype != p.dtype or t.device != ps[0].device:
                raise ValueError(
                    f"adamw_step: a tensor of {name} differs from its param in shape, dtype "
                    "or device (all on one device)"
                )
    if ps:
        beta1, beta2 = betas
        kernel(_ADAMW_STEP, ps[0].device)(
            list(ps), list(gs), list(ms), list(vs), m_outs, v_outs, float(step), float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay),
        )  # fmt: skip
    return m_outs, v_outs


_SQRT_RN = Op(
    "sqrt_rn(Tensor v) -> Tensor",
    fake=torch.empty_like,
    vmap=ELEMENTWISE,
    reference=_reference.sqrt_rn,
)


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    r"""The square root of fp32 ``v`` correctly rounded, as IEEE 754 defines it. It gives the
    same bits on every device and kernel set (where the root is NaN, for negative or NaN ``v``,
    only NaN is promised, not its sign or payload).

    .. math::
        \mathrm{sqrt\_rn}(v) = \mathrm{round}_{\mathrm{fp32}}(\sqrt{v})

    torch's fp32 ``sqrt`` on the CPU is 1 ulp off for about one input in five; the 1-bit Adam
    family divides by this root (docs/algorithms.md, "Conventions"). Other dtypes, and MPS (which
    has no fp64), take torch's ``sqrt``.

    Args:
        v: a tensor (negative values give NaN).

    Returns:
        A new tensor of ``v``'s shape and dtype.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> K.sqrt_rn(torch.tensor([4.0, 2.0, 0.0])).tolist()
        [2.0, 1.4142135381698608, 0.0]
    """
    if v.dtype != torch.float32 or v.device.type == "mps":
        return v.sqrt()
    return _SQRT_RN(v)


@declare(
    "quantize(Tensor x, int bits, int group_size) -> (Tensor, Tensor)",
    fake=lambda x, bits, group_size: _codes_like(
        x, -(-x.numel() // group_size) * group_size, bits, group_size
    ),
    reference=_reference.quantize,
    finite=1,
)
def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric blockwise ``bits``-bit quantization (ZeRO++ qgZ; Wang et al. 2023).

    .. math::
        s_g = \\max_{i \\in g} |x_i| / 2^{b-1}, \\quad
        q_i = \\mathrm{clamp}(\\mathrm{round}(x_i / s_g), -2^{b-1}, 2^{b-1} - 1)

    Args:
        x: 1-D tensor of ``n`` elements (zero-padded to whole groups).
        bits: 4 (two values per byte, first in the high nibble) or 8.
        group_size: elements per scale; even, >= 2.

    Returns:
        ``(q, scales)``, uint8 ``q`` of ``ceil(n / group_size) * group_size * bits / 8`` bytes
        and fp32 ``scales``, one per group.

    Raises:
        ValueError: for bad ``bits``/``group_size`` or a non-finite scale (NaN/Inf input).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=4)
        >>> q.tolist(), scales.tolist()  # 4.0 / scale = 128 is clamped to 127
        ([32, 192, 127, 16], [0.03125])
    """
    _check_1d(x, "x")
    _reference.check_quant_args(bits, group_size)


@declare(
    "dequantize(Tensor q, Tensor scales, int bits, int n) -> Tensor",
    fake=lambda q, scales, bits, n: q.new_empty(n, dtype=torch.float32),
    reference=_reference.dequantize,
)
def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_i = q_i s_g`` for the first ``n`` values, fp32.

    Args:
        q: uint8 codes from :func:`quantize`.
        scales: fp32 scales from :func:`quantize`.
        bits: 4 or 8, as quantized.
        n: number of values to return (at most ``len(q) * 8 / bits``).

    Returns:
        1-D fp32 tensor of ``n`` values.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=4)
        >>> K.dequantize(q, scales, bits=8, n=4).tolist()
        [1.0, -2.0, 3.96875, 0.5]
    """
    values, groups = _code_counts(q, scales, bits)
    if n < 0 or n > values or (groups and values % groups) or (not groups and values):
        raise ValueError(f"{q.shape[0]} bytes / {groups} scales do not fit {bits}-bit n={n}")


def _check_out(out: torch.Tensor, numel: int, what: str) -> None:
    _check_1d(out, "out")
    if out.dtype != torch.float32 or out.shape[0] != numel:
        raise ValueError(
            f"out must be fp32 with {what}={numel} values, got {out.dtype}[{out.shape[0]}]"
        )


def _check_rows(
    rows: tuple[int, int, int] | None, n: int, numel: int, group_size: int
) -> list[int] | None:
    if rows is None:
        return None
    row, padded_row, local = rows
    count = n // row if row > 0 else 0
    if (
        row < 1
        or count * row != n
        or padded_row < row
        or padded_row % group_size
        or local < 1
        or count % local
        or count * padded_row != numel
    ):
        raise ValueError(
            f"rows={rows} does not lay out x's {n} values as rows padded to whole groups of "
            f"{group_size} filling numel={numel} (local dividing the row count)"
        )
    return [row, padded_row, local]


def _rows_tuple(rows: list[int] | None) -> tuple[int, ...] | None:
    return None if rows is None else tuple(rows)


_LOCO_QUANTIZE = Op(
    "loco_quantize(Tensor x, Tensor? error, int bits, int group_size, int numel, int[]? rows) "
    "-> (Tensor, Tensor)",
    fake=lambda x, error, bits, group_size, numel, rows: _codes_like(x, numel, bits, group_size),
    reference=_reference.loco_quantize,
    call=lambda impl, x, error, bits, group_size, numel, rows: impl(
        x, error, bits, group_size, numel, None, _rows_tuple(rows)
    ),
)
_LOCO_QUANTIZE_INTO = Op(
    "loco_quantize_into(Tensor x, Tensor? error, int bits, int group_size, int numel, "
    "int[]? rows, Tensor(a!) q, Tensor(b!) scales) -> ()",
    reference=_reference.loco_quantize,
    call=lambda impl, x, error, bits, group_size, numel, rows, q, scales: impl(
        x, error, bits, group_size, numel, (q, scales), _rows_tuple(rows)
    ),
)


def loco_quantize(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of LoCo's compensated quantization: :func:`quantize` of ``v = pad(x) + e``.

    ``x`` is read as if zero-padded to ``numel`` values (no padded copy is made) and the error
    ``e`` is added in fp32; with ``error=None`` it is plain quantization of the padded ``x``
    (ZeRO++ qgZ). Bit-identical to ``quantize(pad(x, numel) + error, bits, group_size)``. No
    finiteness check: a group with a NaN gets a NaN scale, one with an Inf (and no NaN) an
    infinite one (the caller checks the scales).

    Args:
        x: 1-D tensor of at most ``numel`` elements (computed in fp32).
        error: fp32 error of ``numel`` values, or ``None``.
        bits: 4 or 8.
        group_size: elements per scale; even, >= 2, dividing ``numel``.
        numel: the padded length ``N``.
        out: ``(q, scales)`` buffers to write (contiguous, the shapes below), or ``None``.
        rows: ``(row, padded_row, L)`` for ``x`` made of ``R`` rows of ``row`` values (FSDP's
            reduce-scatter input): ``v``'s row ``j`` is ``x``'s row ``(j % (R / L)) * L + j //
            (R / L)`` zero-padded to ``padded_row`` (a multiple of ``group_size``; ``numel =
            R * padded_row``); ``L = 1`` keeps the order. ``None``: one row, padded to ``numel``.

    Returns:
        ``(q, scales)``, uint8 ``q`` of ``N * bits / 8`` bytes, fp32 ``scales`` of ``N /
        group_size`` (``out``'s tensors when given).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> x, e = torch.tensor([1.0, -2.0, 4.0]), torch.full((4,), 0.5)
        >>> q, scales = K.loco_quantize(x, e, bits=8, group_size=4, numel=4)
        >>> q.tolist(), scales.tolist()  # v = [1.5, -1.5, 4.5, 0.5]
        ([43, 213, 127, 14], [0.03515625])
    """
    _check_1d(x, "x")
    _reference.check_quant_args(bits, group_size)
    if numel < x.shape[0] or numel % group_size:
        raise ValueError(f"numel={numel} must be a multiple of group_size >= x's {x.shape[0]}")
    if error is not None:
        _check_1d(error, "error")
        if error.shape[0] != numel:
            raise ValueError(f"error must have numel={numel} values, got {error.shape[0]}")
    rows_list = _check_rows(rows, x.shape[0], numel, group_size)
    if out is None:
        return _LOCO_QUANTIZE(x, error, bits, group_size, numel, rows_list)
    q, scales = out
    if q.dtype != torch.uint8 or q.shape != (numel * bits // 8,) or not q.is_contiguous():
        raise ValueError(f"out's q must be contiguous uint8[{numel * bits // 8}]")
    if scales.dtype != torch.float32 or scales.shape != (numel // group_size,):
        raise ValueError(f"out's scales must be fp32[{numel // group_size}]")
    _LOCO_QUANTIZE_INTO(x, error, bits, group_size, numel, rows_list, q, scales)
    return q, scales


def _code_counts(q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[int, int]:
    """The values that ``bits``-bit codes ``q`` hold and the groups of ``scales`` (both 1-D)."""
    _check_1d(q, "q")
    _check_1d(scales, "scales")
    _reference.check_bits(bits)
    return q.shape[0] * 8 // bits, scales.shape[0]


def _check_codes(q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[int, int]:
    values, groups = _code_counts(q, scales, bits)
    if not groups or values % groups or (values // groups) % 2:
        raise ValueError(f"{q.shape[0]} bytes / {groups} scales are not whole {bits}-bit groups")
    return values, values // groups


@declare(
    "loco_error(Tensor x, Tensor? error, Tensor q, Tensor scales, int bits, float err_beta, "
    "Tensor(a!) out, int[]? rows) -> ()",
    reference=_reference.loco_error,
    call=lambda impl, x, error, q, scales, bits, err_beta, out, rows: impl(
        x, error, q, scales, bits, err_beta, out, _rows_tuple(rows)
    ),
)
def loco_error(
    x: torch.Tensor,
    error: torch.Tensor | None,
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    err_beta: float,
    out: torch.Tensor,
    rows: tuple[int, int, int] | None = None,
) -> None:
    """Phase 2 of LoCo: the new error, written into ``out`` (which may be ``error`` itself).

    .. math::
        v = \\mathrm{pad}(x) + e, \\quad e' = (v - DQ(q)) (1 - \\beta) + \\beta e

    rounded in fp32 after every operation (``e = 0`` for ``error=None``), as the pure path
    ``residual * (1 - beta) + beta * e`` does.

    Args:
        x, error: as given to :func:`loco_quantize` (``error``: fp32 of ``N`` values or ``None``).
        q, scales: the result of :func:`loco_quantize`.
        bits: 4 or 8, as quantized.
        err_beta: LoCo's ``beta``.
        out: fp32 buffer of ``N`` values, written.
        rows: as given to :func:`loco_quantize`.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> x, e = torch.tensor([1.0, -2.0, 4.0, 0.5]), torch.zeros(4)
        >>> q, scales = K.loco_quantize(x, e, 4, 4, 4)
        >>> K.loco_error(x, e, q, scales, 4, 0.5, e)  # in place
        >>> e.tolist()
        [0.0, 0.0, 0.25, 0.0]
    """
    _check_1d(x, "x")
    values, _ = _check_codes(q, scales, bits)
    _check_out(out, values, "N")
    if x.shape[0] > values:
        raise ValueError(f"x has {x.shape[0]} values, more than the {values} quantized")
    if error is not None and error.shape != out.shape:
        raise ValueError(f"error shape {tuple(error.shape)} != out shape {tuple(out.shape)}")
    rows_list = _check_rows(rows, x.shape[0], values, values // scales.shape[0])
    return {"err_beta": float(err_beta), "rows": rows_list}


@declare(
    "dequantize_sum(Tensor q, Tensor scales, int bits, int pieces, Tensor(a!) out) -> ()",
    reference=_reference.dequantize_sum,
)
def dequantize_sum(
    q: torch.Tensor, scales: torch.Tensor, bits: int, pieces: int, out: torch.Tensor
) -> None:
    """Sums the ``pieces`` dequantized rows held by ``q``/``scales`` into ``out``.

    ``out = sum_ranks(DQ(q).view(pieces, -1))`` bit for bit (the rows added in rank order, see
    :func:`sum_ranks`), without the dequantized rows in memory.

    Args:
        q, scales: codes and scales of ``pieces * k`` values (rows of ``k``, whole groups).
        bits: 4 or 8.
        pieces: number of rows.
        out: fp32 buffer of ``k`` values, written.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=2)
        >>> out = torch.empty(2)
        >>> K.dequantize_sum(q, scales, 8, 2, out)
        >>> out.tolist()  # [1.0, -2.0] + [3.96875, 0.5]
        [4.96875, -1.5]
    """
    values, group_size = _check_codes(q, scales, bits)
    if pieces < 1 or values % pieces or (values // pieces) % group_size:
        raise ValueError(f"{values} values do not split in {pieces} rows of whole groups")
    _check_out(out, values // pieces, "values / pieces")


@declare(
    "dequantize_into(Tensor q, Tensor scales, int bits, Tensor(a!) out, int chunks, "
    "int local_world_size) -> ()",
    reference=_reference.dequantize_into,
)
def dequantize_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    chunks: int = 1,
    local_world_size: int = 1,
) -> None:
    """Dequantizes the first ``out.numel()`` values into ``out``, chunks reordered.

    ``q``/``scales`` hold ``chunks`` equal chunks in rank order ``node * L + local`` (``L =
    local_world_size``); ``out`` receives them in the order ``local * (chunks / L) + node``
    (with ``L = 1``: unchanged), as the two-hop quantized all-gather needs, without a
    transposed copy.

    Args:
        q, scales: codes and scales (whole groups per chunk).
        bits: 4 or 8.
        out: fp32 buffer of at most ``len(q) * 8 / bits`` values, written.
        chunks: number of chunks ``W``.
        local_world_size: ``L``, dividing ``chunks``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=2)
        >>> out = torch.empty(3)
        >>> K.dequantize_into(q, scales, 8, out)
        >>> out.tolist()
        [1.0, -2.0, 3.96875]
    """
    values, group_size = _check_codes(q, scales, bits)
    _check_1d(out, "out")
    if chunks < 1 or local_world_size < 1 or chunks % local_world_size:
        raise ValueError(f"local_world_size={local_world_size} must divide chunks={chunks}")
    if values % chunks or (values // chunks) % group_size:
        raise ValueError(f"{values} values do not split in {chunks} chunks of whole groups")
    if out.dtype != torch.float32 or out.shape[0] > values:
        raise ValueError(f"out must be fp32 with at most {values} values")
