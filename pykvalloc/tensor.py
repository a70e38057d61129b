"""``Tensor``: a typed, strided view of pool memory that any array library can take, zero-copy.

An ``Allocation`` gives one with ``allocation.tensor(dtype, shape)``, a ``KVCache`` gives its KV
memory in the layouts attention kernels read with ``cache.kv_tensor(...)``. A ``Tensor`` speaks
every exchange protocol its memory allows:

* DLPack (``__dlpack__`` / ``__dlpack_device__``): ``numpy.from_dlpack``, ``torch.from_dlpack``,
  cupy, JAX. The device is ``(kDLCPU, 0)`` for host pools, ``(kDLCUDAHost, 0)`` for pinned ones
  (``Pool(pin=True)``: registered portable, so every GPU's context may copy from it; a consumer
  asking for ``dl_device=(kDLCPU, 0)`` gets it as CPU memory, which it is) and ``(kDLCUDA, device)``
  for CUDA pools. ``max_version=(1, x)`` gets a DLPack 1.x versioned capsule, anything older the
  unversioned one.
* ``__cuda_array_interface__`` (version 3) on CUDA pools, ``__array_interface__`` on host pools
  (what ``numpy.asarray`` reads; ``tensor.numpy()`` does it).

Streams. pykvalloc itself never queues work on the memory: what the memory holds was written by
the engine, on the engine's streams. So an export has nothing of its own to order: the
``stream`` a consumer passes is checked (the protocol's values: on a CUDA pool ``None``, ``-1``,
``1``, ``2`` or a stream handle above 2, never the ambiguous ``0``; on host and pinned pools only
``None``, as the protocol says for devices without streams) and no synchronization is done; the
CUDA array interface says ``"stream": None`` for the same reason. An engine that hands memory its
kernels are still writing to a consumer on another stream orders the two itself (an event, or a
synchronize), as it would between two of its own streams.

Lifetime. A ``Tensor`` is a user of what its memory belongs to, the way a numpy view is (pool.py):
while a tensor, anything exported from it (a capsule not yet released, the consumer's array) or
anything derived from that is alive, its allocation cannot be freed (``AllocationInUseError``)
and its pool stays mapped after ``close()``; a KV tensor keeps its cache's memory alive the same
way. Freeing an allocation never waits on a consumer: delete the consumer's arrays first.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, SupportsIndex

import numpy as np

from . import _dlpack
from ._owner import refuse_copy
from .errors import InvalidArgument, KvallocError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["Tensor", "TensorDType", "ExportError", "tensor_dtype", "DEVICE_CPU", "DEVICE_CUDA",
           "DEVICE_CUDA_HOST"]

DEVICE_CPU = _dlpack.CPU
DEVICE_CUDA = _dlpack.CUDA
DEVICE_CUDA_HOST = _dlpack.CUDA_HOST
_DEVICE_NAMES = {DEVICE_CPU: "cpu", DEVICE_CUDA: "cuda", DEVICE_CUDA_HOST: "cuda_host"}

_TENSOR_KEY = object()  # proves to Tensor.__init__ that pykvalloc is calling


class ExportError(KvallocError, BufferError):
    """An export the memory cannot give as asked: to another device, or a copy (pykvalloc exports
    its own memory, never a copy of it), or a dtype the protocol cannot name. DLPack consumers
    expect a ``BufferError``; this is one."""


class TensorDType(NamedTuple):
    """An element type as DLPack names it (``code``, ``bits``) and as numpy does (``typestr``,
    None for types numpy has not: bfloat16, float8)."""

    name: str
    code: int
    bits: int
    typestr: str | None

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def dlpack_minor(self) -> int:
        """The DLPack 1.x minor version that names this type (float8 codes came with 1.1)."""
        return 1 if self.code >= 7 else 0


_INT, _UINT, _FLOAT, _BFLOAT, _BOOL, _E4M3FN, _E5M2 = 0, 1, 2, 4, 6, 10, 12

_DTYPES = {dtype.name: dtype for dtype in (
    TensorDType("float64", _FLOAT, 64, "<f8"),
    TensorDType("float32", _FLOAT, 32, "<f4"),
    TensorDType("float16", _FLOAT, 16, "<f2"),
    TensorDType("bfloat16", _BFLOAT, 16, None),
    TensorDType("float8_e4m3fn", _E4M3FN, 8, None),
    TensorDType("float8_e5m2", _E5M2, 8, None),
    TensorDType("int64", _INT, 64, "<i8"),
    TensorDType("int32", _INT, 32, "<i4"),
    TensorDType("int16", _INT, 16, "<i2"),
    TensorDType("int8", _INT, 8, "|i1"),
    TensorDType("uint64", _UINT, 64, "<u8"),
    TensorDType("uint32", _UINT, 32, "<u4"),
    TensorDType("uint16", _UINT, 16, "<u2"),
    TensorDType("uint8", _UINT, 8, "|u1"),
    TensorDType("bool", _BOOL, 8, "|b1"),
)}
# Other spellings, as engines (vLLM's cache_dtype "fp8" is e4m3fn), torch and C name them.
_ALIASES = {
    "double": "float64", "fp64": "float64", "float": "float32", "fp32": "float32",
    "half": "float16", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
    "float8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "long": "int64", "int": "int32", "short": "int16",
    "byte": "uint8", "bool_": "bool",
}


def tensor_dtype(dtype: object) -> TensorDType:
    """The element type of ``dtype``: a name (``"float16"``, ``"bf16"``, ``"fp8"``), a numpy dtype
    or type, a torch dtype, or a ``TensorDType``. InvalidArgument for anything else."""
    if isinstance(dtype, TensorDType):
        return dtype
    known = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if known is not None:
        return known
    if dtype is None:
        raise InvalidArgument("dtype must be given (a name such as 'float16', or a numpy or "
                              "torch dtype)")
    name = str(dtype).lower().removeprefix("torch.")
    if not isinstance(dtype, str) and name not in _DTYPES and name not in _ALIASES:
        try:
            numpy_dtype = np.dtype(dtype)  # type: ignore[call-overload]  # any object is tried
        except TypeError:
            numpy_dtype = None
        if numpy_dtype is not None:
            name = numpy_dtype.name
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise InvalidArgument(f"unknown tensor dtype {dtype!r}; use one of "
                              f"{', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the first element to one past the last (0 for an empty tensor)."""
    if any(dim == 0 for dim in shape):
        return 0
    return (sum((dim - 1) * stride for dim, stride in zip(shape, strides)) + 1) * itemsize


class Tensor:
    """A view of pool memory with a dtype, a shape and strides (in elements); see the module
    docstring. Made by ``Allocation.tensor`` and ``KVCache.kv_tensor``, never by hand."""

    __slots__ = ("_address", "_shape", "_strides", "_dtype", "_device", "_keep", "__weakref__")

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dtype: TensorDType, device: tuple[int, int], keep: object,
                 _key: object = None) -> None:
        if _key is not _TENSOR_KEY:
            raise TypeError("Tensor objects come from Allocation.tensor or KVCache.kv_tensor, "
                            "not from a constructor")
        self._address = address
        self._shape = shape
        self._strides = strides
        self._dtype = dtype
        self._device = device
        self._keep = keep  # what must outlive the tensor (its parent tensor), or None

    @classmethod
    def _new(cls, address: int, shape: tuple[int, ...], strides: tuple[int, ...],
             dtype: TensorDType, device: tuple[int, int],
             add_user: Callable[[], None], user_gone: Callable[[], None]) -> Tensor:
        """A tensor that is a user of its memory's owner from now until it is garbage. The
        caller holds the owner's lock and has found it open (``add_user`` may not fail)."""
        tensor = cls(address, shape, strides, dtype, device, None, _TENSOR_KEY)
        add_user()
        released = weakref.finalize(tensor, user_gone)
        released.atexit = False  # at exit the memory goes with the process, not before it
        return tensor

    # -- what it is ---------------------------------------------------------------------------

    @property
    def address(self) -> int:
        """The address of element 0 (a device address on a CUDA pool)."""
        return self._address

    def data_ptr(self) -> int:
        """The address of element 0, as torch spells it."""
        return self._address

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Steps between neighbours of each dimension, in elements (torch's convention; numpy's
        ``strides`` are these times ``dtype.itemsize``)."""
        return self._strides

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> TensorDType:
        return self._dtype

    @property
    def device(self) -> tuple[int, int]:
        """The DLPack device: (1, 0) CPU, (3, 0) CUDA host (pinned), (2, ordinal) CUDA."""
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes of the memory the tensor spans, first element to last."""
        return extent(self._shape, self._strides, self._dtype.itemsize)

    @property
    def is_contiguous(self) -> bool:
        """Row-major with no gaps: what a kernel that takes only a pointer needs."""
        return all(dim == 1 or stride == expected for dim, stride, expected in
                   zip(self._shape, self._strides, contiguous_strides(self._shape)))

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __getitem__(self, index: SupportsIndex) -> Tensor:
        """The sub-tensor at ``index`` of the first dimension (``kv[layer]`` of an all-layer KV
        tensor); it keeps this one alive. Other indexing: convert first (numpy, torch)."""
        if not self._shape:
            raise IndexError("a 0-d tensor has no first dimension")
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError("a Tensor takes one integer index; convert it (numpy.from_dlpack, "
                            "torch.from_dlpack) for anything else") from None
        if position < 0:
            position += self._shape[0]
        if not 0 <= position < self._shape[0]:
            raise IndexError(f"index {index} is out of range for dimension 0 of size "
                             f"{self._shape[0]}")
        address = self._address + position * self._strides[0] * self._dtype.itemsize
        return Tensor(address, self._shape[1:], self._strides[1:], self._dtype, self._device,
                      self, _TENSOR_KEY)

    def __repr__(self) -> str:
        device = _DEVICE_NAMES.get(self._device[0], str(self._device[0]))
        if self._device[0] == DEVICE_CUDA:
            device += f":{self._device[1]}"
        return (f"<pykvalloc.Tensor {self._dtype.name}{list(self._shape)} strides "
                f"{list(self._strides)} at {self._address:#x} on {device}>")

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)

    # -- exchange -----------------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device

    def __dlpack__(self, *, stream: object = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> object:
        """A DLPack capsule over this tensor's memory (see the module docstring for ``stream``).
        ``dl_device`` may name the tensor's own device (or the CPU, for pinned memory);
        ``copy=True`` is met only on the host with a numpy copy, which is then no longer pool
        memory. ExportError (a BufferError) for what cannot be given without a copy."""
        self._check_stream(stream)
        version = _version_arg(max_version, self._dtype)
        device = self._device
        if dl_device is not None:
            device = self._target_device(dl_device)
        if copy:
            return self._copy_capsule(max_version)
        return _dlpack.capsule(self._address, device, self._dtype.code, self._dtype.bits,
                               self._shape, self._strides, self, version)

    def _check_stream(self, stream: object) -> None:
        if self._device[0] != DEVICE_CUDA:
            if stream is not None:
                raise InvalidArgument(
                    f"stream {stream!r} given for {_DEVICE_NAMES[self._device[0]]} memory: the "
                    "DLPack protocol takes only stream=None for devices without streams")
            return
        if stream is None:
            return
        if isinstance(stream, bool) or not isinstance(stream, int):
            raise TypeError(f"stream must be an integer (a CUDA stream handle) or None, not "
                            f"{type(stream).__name__}")
        if stream == 0 or stream < -1:
            raise InvalidArgument(f"stream {stream} is not a DLPack CUDA stream: give None or 1 "
                                  "(legacy default), 2 (per-thread default), a handle above 2, "
                                  "or -1 (no synchronization); 0 is ambiguous")

    def _target_device(self, dl_device: tuple[int, int]) -> tuple[int, int]:
        try:
            wanted = (operator.index(dl_device[0]), operator.index(dl_device[1]))
        except (TypeError, IndexError):
            raise InvalidArgument(f"dl_device must be a (device type, id) pair, not "
                                  f"{dl_device!r}") from None
        if wanted == self._device:
            return wanted
        if self._device[0] == DEVICE_CUDA_HOST and wanted == (DEVICE_CPU, 0):
            return wanted  # pinned memory is host memory
        raise ExportError(f"{self!r} is on device {self._device}; it cannot be exported to "
                          f"{wanted} without a copy")

    def _copy_capsule(self, max_version: tuple[int, int] | None) -> object:
        if self._device[0] == DEVICE_CUDA or self._dtype.typestr is None:
            raise ExportError(f"copy=True: pykvalloc exports its own memory, never a copy, and "
                              f"{self!r} has no numpy copy to offer; copy the consumer's array")
        copied = np.array(self.numpy(), copy=True)
        return copied.__dlpack__(max_version=max_version)

    def _byte_strides(self) -> tuple[int, ...] | None:
        if self.is_contiguous:
            return None
        return tuple(stride * self._dtype.itemsize for stride in self._strides)

    def _typestr(self, protocol: str) -> str:
        if self._dtype.typestr is None:
            raise ExportError(f"{protocol} has no type for {self._dtype.name}; export it "
                              "through DLPack, or as uint8/int16")
        return self._dtype.typestr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3, on CUDA pools; ``"stream": None`` (see the module docstring)."""
        if self._device[0] != DEVICE_CUDA:
            raise AttributeError("__cuda_array_interface__ describes GPU memory; this tensor is "
                                 "host memory (use numpy() or DLPack)")
        return {"version": 3, "shape": self._shape,
                "typestr": self._typestr("the CUDA array interface"),
                "data": (self._address, False), "strides": self._byte_strides(), "stream": None}

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """Version 3, on host and pinned pools: what ``numpy.asarray`` reads."""
        if self._device[0] == DEVICE_CUDA:
            raise TypeError(f"{self!r} is GPU memory, which the CPU cannot access: take it "
                            "with torch.from_dlpack or cupy (__cuda_array_interface__)")
        return {"version": 3, "shape": self._shape,
                "typestr": self._typestr("the numpy array interface"),
                "data": (self._address, False), "strides": self._byte_strides()}

    def numpy(self) -> npt.NDArray[Any]:
        """A writable numpy array over the same memory (host pools); it keeps this tensor, and
        so the memory, alive."""
        return np.asarray(self)


def _version_arg(max_version: object, dtype: TensorDType) -> tuple[int, int] | None:
    """The capsule version for a consumer's ``max_version``: None (unversioned) when it gives
    none or knows only 0.x, else (1, the minor the dtype needs)."""
    if max_version is None:
        return None
    try:
        major, minor = (operator.index(part) for part in max_version)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise InvalidArgument(f"max_version must be a (major, minor) pair, not "
                              f"{max_version!r}") from None
    if major < 1:
        return None
    # Consumers check the major version only; one that does not know a float8 code refuses
    # the dtype itself.
    del minor
    return (1, dtype.dlpack_minor)


def shape_arg(shape: object) -> tuple[int, ...]:
    """A shape from an int or a sequence of ints, none negative."""
    try:
        dims: tuple[int, ...]
        if isinstance(shape, (list, tuple)):
            dims = tuple(operator.index(dim) for dim in shape)
        else:
            dims = (operator.index(shape),)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(dim < 0 for dim in dims):
        raise InvalidArgument(f"shape {dims} has a negative dimension")
    return dims

