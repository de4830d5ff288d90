"""Hadamard rotations (QuIP#, QuaRot, SpinQuant): the matrices and how they act on weights and activations.

A rotation ``R = H / sqrt(b)`` (``H`` a b x b Hadamard matrix, entries +-1) acts on a width ``n = k * b`` as
the block-diagonal matrix ``diag(R, ..., R)`` (``transform_block_size`` / compressed-tensors' ``head_dim``).
The conventions are compressed-tensors' (``compressed_tensors.transform``), so that the matrices written to a
checkpoint are the ones its factories build, and a Linear ``y = x W^T`` keeps its function when

    input side:   x' = x R,   W' = W R          (QuIP's v, SpinQuant's R1 on q/k/v, gate/up, lm_head)
    output side:  W' = R^T W, b' = R^T b,  y = y' R^T  (QuIP's u, R1 on o/down, R2 on v_proj)

Pure tensor functions: no modules, no hooks.

Example:
    >>> h = hadamard_matrix(4, "hadamard")
    >>> torch.allclose(h @ h.T, 4 * torch.eye(4, dtype=h.dtype))
    True
"""

from __future__ import annotations

import torch
from compressed_tensors.transform.utils.hadamard import (
    REPO_PATH,
    deterministic_hadamard_matrix,
    is_pow2,
    random_hadamard_matrix,
)
from safetensors import safe_open

TRANSFORM_TYPES = ("hadamard", "random-hadamard")


def _known_divisor(size: int) -> int | None:
    """The largest order ``k`` of a Hadamard matrix compressed-tensors ships with ``size / k`` a power of two."""
    with safe_open(str(REPO_PATH), framework="pt") as f:
        orders = sorted((int(k) for k in f.keys()), reverse=True)
    return next((k for k in orders if size % k == 0 and is_pow2(size // k)), None)


def supported(size: int, kind: str, kronecker: bool = False) -> bool:
    """Whether a ``kind`` Hadamard matrix of order ``size`` can be built.

    ``hadamard`` (Sylvester's construction, what compressed-tensors' loader rebuilds) needs a power of two;
    with ``kronecker`` (rotations fused into weights, never rebuilt by a loader) also a known order times a
    power of two (576 = 36 x 16). ``random-hadamard`` takes the latter always.

    Example:
        >>> supported(576, "hadamard"), supported(576, "hadamard", kronecker=True), supported(70, "random-hadamard")
        (False, True, False)
    """
    if size <= 0 or kind not in TRANSFORM_TYPES:
        return False
    if is_pow2(size):
        return True
    return (kind == "random-hadamard" or kronecker) and _known_divisor(size) is not None


def hadamard_matrix(size: int, kind: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """A ``size x size`` Hadamard matrix (entries +-1, float64), as compressed-tensors' factories build it.

    Args:
        size: the order (see ``supported``).
        kind: ``hadamard`` (deterministic) or ``random-hadamard`` (random signs, ``generator``).
        generator: the random source of ``random-hadamard``.

    Returns:
        H [size, size] with ``H H^T = size I``.

    Raises:
        ValueError: no Hadamard matrix of that order and kind.
    """
    if not supported(size, kind, kronecker=True):
        raise ValueError(f"no {kind} matrix of order {size}: the order must be a power of two, or one of "
                         "compressed-tensors' known orders times a power of two")  # fmt: skip
    if kind == "random-hadamard":
        return random_hadamard_matrix(size, torch.float64, gen=generator)
    if is_pow2(size):
        return deterministic_hadamard_matrix(size, torch.float64)
    k = _known_divisor(size)
    with safe_open(str(REPO_PATH), framework="pt") as f:
        known = f.get_tensor(str(k)).to(torch.float64)  # [k, k]
    return torch.kron(deterministic_hadamard_matrix(size // k, torch.float64), known)  # [size, size]


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x diag(R, ..., R)`` along the last dimension, ``R = h / sqrt(b)`` (``b = len(h)``), computed in h's dtype.

    Args:
        x: [..., n] with ``n`` a multiple of ``b``.
        h: [b, b] Hadamard matrix (or its transpose, for the inverse).

    Returns:
        [..., n] in x's dtype.

    Example:
        >>> x = torch.randn(3, 8)
        >>> h = hadamard_matrix(4, "hadamard")
        >>> torch.allclose(rotate(rotate(x, h), h.T), x, atol=1e-6)
        True
    """
    b = h.shape[0]
    blocks = x.to(h.dtype).unflatten(-1, (-1, b))  # [..., n / b, b]
    return ((blocks @ h) / b**0.5).flatten(-2).to(x.dtype)


def rotate_weight_input(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``W R`` for a Linear weight [out, in]: its input rotated by ``R`` (the activation becomes ``x R``)."""
    return rotate(w, h)


def rotate_weight_output(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``R^T W`` for a Linear weight [out, in] (or a bias [out]): its output rotated by ``R``."""
    if w.dim() == 1:
        return rotate(w, h)  # (R^T b) as a row: b R
    return rotate(w.T, h).T.contiguous()
