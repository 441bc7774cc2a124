"""The unpickler for CIFAR's python batches: dicts, lists, bytes and numpy arrays, nothing else.

A pickle can run arbitrary code when loaded, and torchvision unpickles CIFAR batches with no
restriction; raysim reads them with `RestrictedUnpickler` instead, which also refuses a pickle
that builds far more than its file holds (a pickle bomb) before building it.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np

from raysim.errors import DataError

# batch builds each array once, from bytes the file holds (twice with Python 3's protocol-2
# round trip through latin1 text). More means the pickle multiplies what it holds - e.g.
# `_codecs.encode(..., 'hex')` nested doubles its input each time: 1.6 KB -> 3.6 GB.
_CIFAR_BUILD_RATIO = 4
_CIFAR_BUILD_SLACK = 1 << 20
_LATIN1_NAMES = {"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "iso8859_1", "l1"}


class _NdarrayClass:
    """Stands for numpy.ndarray in a pickle, where it is only ever the first argument of
    `_reconstruct`: the class itself is not handed out, so no opcode can call it or its
    __new__ with a shape of the pickle's choosing."""


_NDARRAY = _NdarrayClass()


def _simple_dtype(dtype: Any) -> bool:
    """A plain numeric dtype (no objects, fields or sub-arrays): all a CIFAR batch has, and the
    only kind whose arrays numpy builds from raw bytes alone (object arrays can crash it)."""
    return (
        isinstance(dtype, np.dtype)
        and dtype.kind in "biufc"
        and not dtype.hasobject
        and dtype.fields is None
        and dtype.subdtype is None
    )


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickler that can build dicts, lists, bytes and numpy arrays - and nothing else - and no
    more of them than the file holds.

    A pickle can run arbitrary code when loaded; a CIFAR batch only needs a few globals, so
    anything else (e.g. os.system) means the file is not what it claims and is refused. The
    globals it may use are not the real ones but checked stand-ins that charge what they build
    to a budget derived from the file size, and the BUILD opcode (which sets an object's state)
    accepts only what numpy pickles write for a plain array or dtype. It is the pure-Python
    unpickler because only that one lets BUILD be checked; a batch has few opcodes (its pixels
    are one string), so it is as fast here.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, path: str, file_size: int) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path
        self.budget = _CIFAR_BUILD_RATIO * file_size + _CIFAR_BUILD_SLACK
        self.file_size = file_size
        self.built = 0
        self.safe_globals: dict[tuple[str, str], Any] = {
            ("_codecs", "encode"): self._encode,
            ("numpy", "ndarray"): _NDARRAY,
            ("numpy", "dtype"): self._dtype,
        }
        for module in ("builtins", "__builtin__"):  # Python 2 names appear in the originals
            self.safe_globals.update(
                {
                    (module, "bytes"): self._bytes,
                    (module, "str"): self._str,
                    (module, "list"): self._list,
                    (module, "dict"): self._dict,
                }
            )
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            self.safe_globals[(module, "_reconstruct")] = self._reconstruct
            self.safe_globals[(module, "scalar")] = self._scalar

    def find_class(self, module: str, name: str) -> Any:
        found = self.safe_globals.get((module, name))
        if found is None:
            raise DataError(
                f"refusing to load {self.path}: it references {str(module)[:80]}."
                f"{str(name)[:80]}, which a CIFAR batch never contains (only dict, list, bytes, "
                f"str and numpy arrays are allowed)"
            )
        return found

    def _refuse(self, what: str) -> DataError:
        return DataError(
            f"refusing to load {self.path}: it calls {what}, which a CIFAR batch never does"
        )

    def _charge(self, nbytes: int) -> None:
        """Count `nbytes` about to be built; refuse before building past the budget."""
        self.built += nbytes
        if self.built > self.budget:
            raise DataError(
                f"refusing to load {self.path}: it builds more than {self.budget:,} bytes of "
                f"objects from {self.file_size:,} bytes of file (a CIFAR batch holds its arrays "
                f"in the file; this one multiplies them: a pickle bomb?)"
            )

    # -- the stand-ins for the allowed globals ---------------------------------------------

    def _encode(self, text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        # Python 3 pickles bytes for protocol < 3 as _codecs.encode(latin1 text, 'latin1'):
        # one byte per character. Other codecs grow their input (hex doubles it) or do more.
        if not (
            isinstance(text, str)
            and isinstance(encoding, str)
            and encoding.lower() in _LATIN1_NAMES
            and isinstance(errors, str)
        ):
            shown = encoding[:40] if isinstance(encoding, str) else type(encoding).__name__
            raise self._refuse(
                f"_codecs.encode({type(text).__name__}, {shown!r}) (only latin1 text to bytes)"
            )
        self._charge(len(text))
        return text.encode("latin-1", errors)

    def _bytes(self, *args: Any) -> bytes:
        if not args:  # how protocol < 3 pickles b''
            return b""
        if len(args) == 1 and isinstance(args[0], bytes | bytearray):
            self._charge(len(args[0]))
            return bytes(args[0])
        raise self._refuse(f"bytes({', '.join(type(a).__name__ for a in args[:3])})")

    def _str(self, *args: Any) -> str:
        if not args:
            return ""
        if len(args) == 1 and isinstance(args[0], str):
            return args[0]
        raise self._refuse(f"str({', '.join(type(a).__name__ for a in args[:3])})")

    def _list(self, *args: Any) -> list:
        if not args:
            return []
        if len(args) == 1 and isinstance(args[0], list | tuple):
            self._charge(8 * len(args[0]))
            return list(args[0])
        raise self._refuse(f"list({', '.join(type(a).__name__ for a in args[:3])})")

    def _dict(self, *args: Any) -> dict:
        if not args:
            return {}
        if len(args) == 1 and isinstance(args[0], dict | list | tuple):
            self._charge(64 * len(args[0]))
            return dict(args[0])
        raise self._refuse(f"dict({', '.join(type(a).__name__ for a in args[:3])})")

    def _checked_dtype(self, spec: Any, *args: Any) -> np.dtype:
        if not isinstance(spec, str | bytes | np.dtype):
            raise self._refuse(f"numpy.dtype({type(spec).__name__})")
        dtype = np.dtype(spec, *args)
        if not _simple_dtype(dtype):
            raise self._refuse(f"numpy.dtype({str(dtype)[:40]!r}) (only plain numeric dtypes)")
        return dtype

    def _dtype(self, spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
        return self._checked_dtype(spec, bool(align), bool(copy))

    def _shape(self, shape: Any) -> tuple[int, ...]:
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, tuple | list) or len(shape) > 32:
            raise self._refuse(f"an array of shape {type(shape).__name__}")
        for size in shape:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise self._refuse(f"an array of shape {str(shape)[:60]}")
        return tuple(shape)

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        if subtype is not _NDARRAY:
            raise self._refuse(f"_reconstruct({type(subtype).__name__}, ...)")
        shape = self._shape(shape)
        dtype = self._checked_dtype(dtype)
        self._charge(math.prod(shape) * dtype.itemsize)  # exact: before numpy allocates
        return np.empty(shape, dtype=dtype)

    def _scalar(self, dtype: Any, data: Any = None) -> Any:
        if not (_simple_dtype(dtype) and isinstance(data, bytes) and len(data) == dtype.itemsize):
            raise self._refuse("numpy scalar() with anything but a plain dtype and its bytes")
        self._charge(len(data))
        return np.frombuffer(data, dtype=dtype)[0]

    # -- BUILD: only the state numpy pickles write for a plain array or dtype --------------

    def _load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if isinstance(target, np.ndarray) and type(target) is np.ndarray:
            self._build_array(target, state)
        elif isinstance(target, np.dtype) and _simple_dtype(target):
            # (version, byte order, subarray, names, fields, itemsize, alignment, flags[, meta])
            if (
                not isinstance(state, tuple)
                or len(state) not in (8, 9)
                or any(part is not None for part in state[2:5])
            ):
                raise self._refuse("numpy.dtype.__setstate__ with fields or sub-arrays")
            target.__setstate__(state)
        else:
            raise self._refuse(f"the BUILD of a {type(target).__name__}")

    def _build_array(self, array: np.ndarray, state: Any) -> None:
        # (version, shape, dtype, is_fortran, raw bytes); version is absent in old pickles
        if isinstance(state, tuple) and len(state) == 5:
            parts = state[1:]
        elif isinstance(state, tuple) and len(state) == 4:
            parts = state
        else:
            raise self._refuse("numpy.ndarray.__setstate__ with a state numpy never writes")
        shape, dtype, _, raw = parts
        shape = self._shape(shape)
        if not _simple_dtype(dtype):
            raise self._refuse(f"numpy.ndarray.__setstate__ with dtype {str(dtype)[:40]!r}")
        if not isinstance(raw, bytes) or len(raw) != math.prod(shape) * dtype.itemsize:
            raise DataError(
                f"{self.path}: an array's data does not match its shape {shape[:8]} and dtype "
                f"{dtype} (truncated or corrupted?)"
            )
        self._charge(len(raw))  # numpy may copy it (unaligned or byte-swapped data)
        array.__setstate__(state)

    def _load_by_class(self) -> None:
        # Instances made by calling a class (NEWOBJ and kin) never occur in a batch: arrays,
        # dtypes and scalars come from the functions above, containers from their opcodes.
        raise self._refuse("a class to make an object (pickle opcode NEWOBJ, OBJ or INST)")

    dispatch[pickle.BUILD[0]] = _load_build
    dispatch.update(
        dict.fromkeys(
            (pickle.NEWOBJ[0], pickle.NEWOBJ_EX[0], pickle.OBJ[0], pickle.INST[0]), _load_by_class
        )
    )
