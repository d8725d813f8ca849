"""The type values and gradients cross the wire and shared memory in (``runtime.wire_dtype``): float32, or a
half-precision type that halves the bytes of every push and reply. The PS keeps float32 master values and
optimizer state; a payload is widened as it is copied in, a reply narrowed once per version.

bfloat16 has no NumPy dtype (``ml_dtypes`` has one, but the PS must not depend on it): its values are
carried as the upper 16 bits of the float32 (``uint16``), rounded to nearest even as torch and TensorFlow
round; a NaN stays a NaN (a quiet one), an infinity stays infinite. float16 is NumPy's own (values beyond
±65504 become infinite, and the PS refuses such a push as not finite). Conversions go block by block
(``BLOCK``) through one small scratch array, so no full-size temporary is made.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

WireDtype = Literal["float32", "bfloat16", "float16"]
NAMES: tuple[WireDtype, ...] = ("float32", "bfloat16", "float16")
STORAGE: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16)}
"""The NumPy dtype a wire value is stored in (bfloat16: its bits)."""
BLOCK = 1 << 16
"""Elements per block of a bfloat16 conversion (256 KiB of uint32 scratch: stays in cache)."""
_QUIET = np.uint32(0x0040)  # the quiet bit of a bfloat16 NaN


def itemsize(wire: str) -> int:
    """Bytes per value on the wire."""
    return STORAGE[wire].itemsize


def wire_nbytes(size: int, wire: str) -> int:
    """Bytes of ``size`` values on the wire."""
    return size * itemsize(wire)


def empty(size: int, wire: str) -> np.ndarray:
    """An uninitialized vector of ``size`` wire values."""
    return np.empty(size, STORAGE[wire])


def view(raw: np.ndarray | bytes | memoryview, wire: str) -> np.ndarray:
    """Bytes (whole values) seen as wire values, without a copy."""
    return np.frombuffer(raw, STORAGE[wire])


def narrow(x: np.ndarray, out: np.ndarray) -> None:
    """float32 ``x`` into the wire values ``out`` (its dtype says which wire type: see ``STORAGE``); ``x``
    already of that type is copied."""
    if x.dtype == out.dtype:
        np.copyto(out, x)
    elif out.dtype == np.uint16:
        _to_bfloat16(x, out)
    else:
        with np.errstate(over="ignore"):  # beyond float16's range: inf, which the PS refuses as not finite
            np.copyto(out, x, casting="same_kind")


def widen(w: np.ndarray, out: np.ndarray) -> None:
    """Wire values ``w`` into float32 ``out`` (exact: every bfloat16 and float16 value is a float32)."""
    if w.dtype == np.uint16:
        bits = out.view(np.uint32)
        np.copyto(bits, w)
        np.left_shift(bits, 16, out=bits)
    else:
        np.copyto(out, w)


def narrowed(x: np.ndarray, wire: str) -> np.ndarray:
    """float32 ``x`` as a new vector of wire values (``x`` itself for float32)."""
    if wire == "float32":
        return x
    out = empty(x.size, wire)
    narrow(x, out)
    return out


def _to_bfloat16(x: np.ndarray, out: np.ndarray) -> None:
    """Round to nearest even: add 0x7FFF plus the lowest kept bit, keep the upper half. A NaN is kept from
    the addition (which can carry it into an infinity or past the sign) and made quiet."""
    bits = x.view(np.uint32)
    t = np.empty(min(x.size, BLOCK), np.uint32)
    for lo in range(0, x.size, BLOCK):
        b, o = bits[lo : lo + BLOCK], out[lo : lo + BLOCK]
        s = t[: b.size]
        np.right_shift(b, 16, out=s)
        np.bitwise_and(s, 1, out=s)
        np.add(s, 0x7FFF, out=s)
        np.add(s, b, out=s)
        np.right_shift(s, 16, out=s)
        np.copyto(o, s, casting="unsafe")
        nan = np.isnan(x[lo : lo + BLOCK])
        if nan.any():
            o[nan] = (b[nan] >> 16) | _QUIET
