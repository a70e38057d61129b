"""DLPack capsules built with ctypes: the C structs of dlpack.h and the capsule protocol.

What the protocol asks of a producer, and how it is met here:

* A capsule named ``"dltensor"`` holds a ``DLManagedTensor *`` (``"dltensor_versioned"`` a
  ``DLManagedTensorVersioned *``, DLPack 1.x). A consumer that takes the tensor renames the
  capsule ``"used_dltensor"`` (``"used_dltensor_versioned"``) and calls the tensor's deleter
  when it is done with it. A capsule nobody took must release the tensor itself.
* The structs, the shape and strides arrays of one export live in one ``_Export`` held by
  ``_LIVE`` under the address of its managed tensor (``manager_ctx``), with the object exported
  (which keeps the memory alive); the deleter drops it.
* The deleter is a ctypes callback: a consumer may call it from any thread, and ctypes takes
  the GIL for it. It is a closure over the registry, so that it works while the interpreter
  tears this module down.
* A capsule has no destructor callback. A consumer that refuses a capsule drops it with its
  own exception set, and a ctypes callback run then would replace that exception (CPython
  raises SystemError for a call that returns while an exception is set). Instead ``_LIVE`` keeps
  a reference to each capsule until it is seen taken (then the consumer's deleter releases the
  export) or seen held by nobody else under its first name (then ``sweep`` releases it). Every
  new export, every free refused for live views, every ``close()`` and ``live_exports()``
  sweep first, so an export nobody took never blocks a free or a close.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    addressof,
    c_int,
    c_int32,
    c_int64,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
    py_object,
)
from typing import Any

# DLDeviceType values.
CPU = 1
CUDA = 2
CUDA_HOST = 3

UNVERSIONED_NAME = b"dltensor"
VERSIONED_NAME = b"dltensor_versioned"
FLAG_READ_ONLY = 1 << 0

# The structs as dlpack.h declares them. An export is packed with struct (below, one call
# instead of a ctypes assignment per field); the tests read capsules back through these.


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


# Both deleters take the managed tensor's address; ctypes passes it as an int.
DELETER = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DELETER)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", DELETER),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


class _Export:
    """Everything one capsule points at (``memory``: the managed tensor, then its shape and
    strides), and the object whose memory it exports."""

    __slots__ = ("memory", "owner", "capsule", "name")

    def __init__(self, memory: ctypes.Array[ctypes.c_char], owner: object,
                 name: ctypes.Array[ctypes.c_char]) -> None:
        self.memory = memory
        self.owner = owner
        self.capsule: object = None  # until seen taken or abandoned (see the module docstring)
        self.name = name


# Every export whose deleter has not run yet, by the address of its managed tensor; and those
# whose capsule is not yet seen taken or abandoned.
_LIVE: dict[int, _Export] = {}
_PENDING: dict[int, _Export] = {}

# The capsule names must outlive every capsule: C keeps the pointer, not a copy.
_NAMES = {name: ctypes.create_string_buffer(name) for name in (UNVERSIONED_NAME, VERSIONED_NAME)}
_NAME_ADDRESS = {name: addressof(buffer) for name, buffer in _NAMES.items()}

# Function objects of our own: ctypes.pythonapi.PyCapsule_New is one object for the whole
# process, whose argtypes another package may set (some do, differently).
_capsule_new = ctypes.PYFUNCTYPE(py_object, c_void_p, c_void_p, c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(c_int, py_object, c_void_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))


def _make_deleter() -> Any:
    live, pending = _LIVE, _PENDING

    def deleter(address: int | None) -> None:
        if address is not None:
            pending.pop(address, None)
            live.pop(address, None)

    return DELETER(deleter)


_DELETER = _make_deleter()
_DELETER_ADDRESS = ctypes.cast(_DELETER, c_void_p).value
# The references sweep finds on a capsule nobody else holds: the export's, getrefcount's
# argument and the loop's variable.
_ONLY_OURS = 3


def sweep() -> None:
    """Lets go of capsules a consumer took, and releases the exports of capsules nobody took and
    nobody holds any more. A capsule someone still holds is looked at again next time."""
    if not _PENDING:
        return
    for address, export in list(_PENDING.items()):
        held = export.capsule
        if sys.getrefcount(held) > _ONLY_OURS:
            continue
        # pop, not del: a consumer's deleter on another thread may have taken it off since
        if _PENDING.pop(address, None) is None:
            continue
        if _capsule_is_valid(held, addressof(export.name)):
            _LIVE.pop(address, None)  # never taken, and now nobody can
        else:
            export.capsule = None  # taken: the consumer's deleter releases it
        del held


def live_exports() -> int:
    """How many exports no consumer has released yet (for tests and diagnostics)."""
    sweep()
    return len(_LIVE)


# The structs, packed in one go: DLTensor (data, device type and id, ndim, dtype code, bits and
# lanes, shape, strides, byte_offset), then DLManagedTensor's manager_ctx and deleter; or
# DLManagedTensorVersioned's version, manager_ctx, deleter and flags before the DLTensor.
_TENSOR = "QiiiBBHQQQ"
_UNVERSIONED = struct.Struct("=" + _TENSOR + "QQ")
_VERSIONED = struct.Struct("=IIQQQ" + _TENSOR)
assert _UNVERSIONED.size == ctypes.sizeof(DLManagedTensor)
assert _VERSIONED.size == ctypes.sizeof(DLManagedTensorVersioned)


def capsule(data: int, device: tuple[int, int], code: int, bits: int, shape: tuple[int, ...],
            strides: tuple[int, ...], owner: object, version: tuple[int, int] | None,
            read_only: bool = False) -> object:
    """A new capsule over ``data``: unversioned when ``version`` is None, else a
    ``DLManagedTensorVersioned`` of that version. ``strides`` are in elements. ``owner`` stays
    alive until the deleter runs."""
    sweep()
    ndim = len(shape)
    head = _UNVERSIONED if version is None else _VERSIONED
    memory = ctypes.create_string_buffer(head.size + 16 * ndim)
    address = addressof(memory)
    shape_at = address + head.size
    strides_at = shape_at + 8 * ndim
    if version is None:
        head.pack_into(memory, 0, data, device[0], device[1], ndim, code, bits, 1, shape_at,
                       strides_at, 0, address, _DELETER_ADDRESS)
        name = UNVERSIONED_NAME
    else:
        head.pack_into(memory, 0, version[0], version[1], address, _DELETER_ADDRESS,
                       FLAG_READ_ONLY if read_only else 0, data, device[0], device[1], ndim,
                       code, bits, 1, shape_at, strides_at, 0)
        name = VERSIONED_NAME
    struct.pack_into(f"={2 * ndim}q", memory, head.size, *shape, *strides)
    export = _Export(memory, owner, _NAMES[name])
    _LIVE[address] = export
    try:
        export.capsule = _capsule_new(address, _NAME_ADDRESS[name], None)
    except BaseException:
        _LIVE.pop(address, None)
        raise
    _PENDING[address] = export
    return export.capsule
