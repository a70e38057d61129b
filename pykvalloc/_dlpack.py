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
import sys
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    addressof,
    c_char_p,
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
    """Everything one capsule points at, and the object whose memory it exports."""

    __slots__ = ("managed", "shape", "strides", "owner", "capsule", "name")

    def __init__(self, managed: DLManagedTensor | DLManagedTensorVersioned,
                 shape: ctypes.Array[c_int64], strides: ctypes.Array[c_int64],
                 owner: object, name: ctypes.Array[ctypes.c_char]) -> None:
        self.managed = managed
        self.shape = shape
        self.strides = strides
        self.owner = owner
        self.capsule: object = None  # until seen taken or abandoned (see the module docstring)
        self.name = name


# Every export whose deleter has not run yet, by the address of its managed tensor.
_LIVE: dict[int, _Export] = {}

# The capsule names must outlive every capsule: C keeps the pointer, not a copy.
_NAMES = {name: ctypes.create_string_buffer(name) for name in (UNVERSIONED_NAME, VERSIONED_NAME)}

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = py_object
_capsule_new.argtypes = [c_void_p, c_void_p, c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = c_int
_capsule_is_valid.argtypes = [py_object, c_void_p]


def _make_deleter() -> Any:
    live = _LIVE

    def deleter(address: int | None) -> None:
        if address is not None:
            live.pop(address, None)

    return DELETER(deleter)


_DELETER = _make_deleter()
# The references sweep finds on a capsule nobody else holds: the export's, getrefcount's
# argument and the loop's variable.
_ONLY_OURS = 3


def sweep() -> None:
    """Lets go of capsules a consumer took, and releases the exports of capsules nobody took and
    nobody holds any more."""
    abandoned = []
    for address, export in list(_LIVE.items()):
        held = export.capsule
        if held is None:
            continue
        if not _capsule_is_valid(held, addressof(export.name)):
            export.capsule = None  # taken: the consumer's deleter releases it
        elif sys.getrefcount(held) <= _ONLY_OURS:
            abandoned.append(address)
        del held
    for address in abandoned:
        _LIVE.pop(address, None)


def live_exports() -> int:
    """How many exports no consumer has released yet (for tests and diagnostics)."""
    sweep()
    return len(_LIVE)


def capsule(data: int, device: tuple[int, int], code: int, bits: int, shape: tuple[int, ...],
            strides: tuple[int, ...], owner: object, version: tuple[int, int] | None,
            read_only: bool = False) -> object:
    """A new capsule over ``data``: unversioned when ``version`` is None, else a
    ``DLManagedTensorVersioned`` of that version. ``strides`` are in elements. ``owner`` stays
    alive until the deleter runs."""
    ndim = len(shape)
    shape_array = (c_int64 * max(ndim, 1))(*shape)
    strides_array = (c_int64 * max(ndim, 1))(*strides)
    managed: DLManagedTensor | DLManagedTensorVersioned
    if version is None:
        managed = DLManagedTensor()
        name = _NAMES[UNVERSIONED_NAME]
    else:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*version)
        managed.flags = FLAG_READ_ONLY if read_only else 0
        name = _NAMES[VERSIONED_NAME]
    tensor = managed.dl_tensor
    tensor.data = data
    tensor.device = DLDevice(*device)
    tensor.ndim = ndim
    tensor.dtype = DLDataType(code, bits, 1)
    tensor.shape = ctypes.cast(shape_array, POINTER(c_int64))
    tensor.strides = ctypes.cast(strides_array, POINTER(c_int64))
    tensor.byte_offset = 0
    address = addressof(managed)
    managed.manager_ctx = address
    managed.deleter = _DELETER
    sweep()
    export = _Export(managed, shape_array, strides_array, owner, name)
    _LIVE[address] = export
    try:
        export.capsule = _capsule_new(address, addressof(name), None)
    except BaseException:
        _LIVE.pop(address, None)
        raise
    return export.capsule

