"""Tensors over pool memory: DLPack and the array interfaces on allocations (host, pinned and
CUDA pools, the last two through the fake driver), and a KV cache's memory in the layouts
attention kernels read, indexed by block id."""

from __future__ import annotations

import ctypes
import gc
import textwrap

import numpy as np
import pytest
from support import MiB, run_python
from test_backends import fake_driver, run_with_driver  # noqa: F401 - the fixture is used

import pykvalloc
from pykvalloc import _dlpack
from pykvalloc.tensor import DEVICE_CPU, ExportError, Tensor, tensor_dtype


def read_bytes(address: int, count: int) -> bytes:
    return ctypes.string_at(address, count)


# ---- allocations -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_version", [None, (0, 8), (1, 0), (1, 3)])
def test_numpy_sees_the_same_bytes_both_ways(pool, max_version):
    allocation = pool.alloc(64 << 10)
    tensor = allocation.tensor("float32", (128, 128))
    capsule = tensor.__dlpack__(max_version=max_version)
    versioned = max_version is not None and max_version[0] >= 1
    assert f'"{"dltensor_versioned" if versioned else "dltensor"}"' in repr(capsule)
    array = np.from_dlpack(tensor)
    assert array.shape == (128, 128) and array.dtype == np.float32
    assert array.ctypes.data == allocation.address and array.flags.writeable
    array[3, 5] = 1.5                                     # write through the export...
    assert allocation.view(np.float32, (128, 128))[3, 5] == 1.5   # ...read through a view
    allocation.view(np.float32)[7] = -2.0                 # and the other way round
    assert array[0, 7] == -2.0
    del capsule


def test_an_allocation_exports_its_bytes(pool):
    allocation = pool.alloc(1000)
    assert allocation.__dlpack_device__() == (DEVICE_CPU, 0)
    raw = np.from_dlpack(allocation)
    assert raw.dtype == np.uint8 and raw.shape == (1000,)
    raw[:] = 9
    assert read_bytes(allocation.address, 1000) == b"\x09" * 1000
    assert not hasattr(allocation, "__cuda_array_interface__")


def test_dtypes_shapes_and_strides(pool):
    allocation = pool.alloc(4096)
    assert allocation.tensor().shape == (4096,)
    assert allocation.tensor("fp16").shape == (2048,)
    assert allocation.tensor(np.int32, 7).shape == (7,)
    columns = allocation.tensor("int16", (4, 8), strides=(16, 2))
    assert not columns.is_contiguous and columns.nbytes == (3 * 16 + 7 * 2 + 1) * 2
    array = np.from_dlpack(columns)
    assert array.strides == (32, 4)
    array[:] = np.arange(32, dtype=np.int16).reshape(4, 8)
    assert allocation.view(np.int16)[16 + 4] == 10  # row 1, column 2
    assert tensor_dtype("bf16").code == 4 and tensor_dtype("fp8").bits == 8
    assert tensor_dtype(np.dtype("<u2")).name == "uint16"


def test_bad_tensor_arguments_change_nothing(pool):
    allocation = pool.alloc(256)
    with pytest.raises(pykvalloc.InvalidArgument, match="needs|spans"):
        allocation.tensor("float32", (65,))
    with pytest.raises(pykvalloc.InvalidArgument, match="spans"):
        allocation.tensor("uint8", (2, 200), strides=(200, 1))
    with pytest.raises(pykvalloc.InvalidArgument, match="unknown tensor dtype"):
        allocation.tensor("float128")
    with pytest.raises(pykvalloc.InvalidArgument, match="do not match"):
        allocation.tensor("uint8", (4, 4), strides=(4,))
    with pytest.raises(pykvalloc.InvalidArgument, match="negative"):
        allocation.tensor("uint8", (-1,))
    with pytest.raises(TypeError):
        allocation.tensor("uint8", "big")
    assert allocation._views == 0
    pool.free(allocation)
    with pytest.raises(pykvalloc.AllocationFreedError):
        allocation.tensor()
    with pytest.raises(TypeError, match="constructor"):
        Tensor(0, (1,), (1,), tensor_dtype("uint8"), (1, 0), None)


def test_stream_device_and_copy_arguments(pool):
    tensor = pool.alloc(64).tensor("float16")
    for stream in (1, -1, 0, 2):  # the protocol takes only None for a device without streams
        with pytest.raises(pykvalloc.InvalidArgument, match="stream=None"):
            tensor.__dlpack__(stream=stream)
    assert _dlpack.live_exports() == 0
    with pytest.raises(ExportError, match="without a copy"):
        tensor.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        tensor.__dlpack__(dl_device=(1, 1))
    same = np.from_dlpack(tensor, device="cpu")
    assert same.ctypes.data == tensor.address
    copied = np.from_dlpack(tensor, copy=True)  # met with a numpy copy: not pool memory
    assert copied.ctypes.data != tensor.address
    with pytest.raises(ExportError, match="never a copy"):
        pool.alloc(64).tensor("bfloat16").__dlpack__(copy=True)
    with pytest.raises(pykvalloc.InvalidArgument, match="max_version"):
        tensor.__dlpack__(max_version=3)


def test_a_type_numpy_lacks_goes_through_dlpack_only(pool):
    tensor = pool.alloc(64).tensor("bfloat16", (32,))
    with pytest.raises(ExportError, match="bfloat16"):
        np.asarray(tensor)
    capsule = tensor.__dlpack__(max_version=(1, 0))  # a consumer that knows bfloat16 takes it
    assert "dltensor_versioned" in repr(capsule)
    with pytest.raises(RuntimeError, match="dtype"):
        np.from_dlpack(tensor)  # numpy has no bfloat16: its error stands, the capsule released
    del capsule
    gc.collect()
    assert _dlpack.live_exports() == 0


def test_free_is_refused_while_an_export_lives(pool):
    allocation = pool.alloc(4096)
    tensor = allocation.tensor("uint32")
    array = np.from_dlpack(tensor)
    del tensor  # the array holds the export, which holds the tensor
    gc.collect()
    with pytest.raises(pykvalloc.AllocationInUseError, match="1 numpy view"):
        pool.free(allocation)
    unused = allocation.__dlpack__()  # a capsule nobody took holds the allocation too
    del array
    gc.collect()
    with pytest.raises(pykvalloc.AllocationInUseError):
        pool.free(allocation)
    assert _dlpack.live_exports() == 1
    del unused  # its destructor runs the deleter
    gc.collect()
    assert _dlpack.live_exports() == 0 and allocation._views == 0
    pool.free(allocation)
    assert allocation.freed


def test_an_export_keeps_a_closed_pool_mapped():
    pool = pykvalloc.Pool(4 * MiB)
    array = np.from_dlpack(pool.alloc(MiB).tensor("int64"))
    pool.close()
    assert pool._finalizer.alive
    array[:] = 5
    assert array.sum() == 5 * (MiB // 8)
    del array
    gc.collect()
    assert not pool._finalizer.alive


def test_varpool_allocations_export_too():
    with pykvalloc.VarPool(4 * MiB) as var:
        allocation = var.alloc(3000)
        array = np.from_dlpack(allocation.tensor("uint16"))
        array[:] = 0xBEEF
        with pytest.raises(pykvalloc.AllocationInUseError):
            var.free(allocation)
        assert allocation.view(np.uint16)[1499] == 0xBEEF
        del array
        gc.collect()
        var.free(allocation)


def test_exports_alive_at_exit_do_not_crash():
    code = textwrap.dedent("""
        import numpy as np, pykvalloc
        pool = pykvalloc.Pool(4 << 20)
        a = np.from_dlpack(pool.alloc(4096).tensor("float32"))
        unused = pool.alloc(64).__dlpack__(max_version=(1, 0))
        kv = pykvalloc.KVCache(num_blocks=4, block_tokens=4, layers=2, kv_heads=1, head_dim=8)
        k = np.from_dlpack(kv.kv_tensor(0))
        a[:] = 1
        k[:] = 2
        print("ok", int(a.sum()), int(k.sum()))
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "1024", str(2 * 4 * 2 * 4 * 8)]
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


# ---- pinned and CUDA pools, through the fake driver -------------------------------------------


def test_pinned_pool_exports_cuda_host_memory(fake_driver):  # noqa: F811
    run_with_driver("""
        import gc, numpy as np, pykvalloc
        from pykvalloc import _dlpack
        with pykvalloc.Pool(4 << 20, pin=True) as pool:
            allocation = pool.alloc(4096)
            tensor = allocation.tensor("float32")
            assert allocation.__dlpack_device__() == (3, 0) == tensor.__dlpack_device__()
            array = np.from_dlpack(tensor)   # numpy takes CUDA host memory as CPU memory
            array[:] = 4.0
            assert allocation.view(np.float32)[1023] == 4.0
            cpu = np.from_dlpack(tensor, device="cpu")
            assert cpu.ctypes.data == allocation.address
            try:
                tensor.__dlpack__(stream=1)
                raise AssertionError("a stream accepted for pinned memory")
            except pykvalloc.InvalidArgument:
                pass
            del array, cpu, tensor
            gc.collect()
            pool.free(allocation)
            assert _dlpack.live_exports() == 0
        """, fake_driver)


def test_cuda_pool_exports_device_memory(fake_driver):  # noqa: F811
    run_with_driver("""
        import gc, numpy as np, pykvalloc
        from pykvalloc import _dlpack
        from pykvalloc.tensor import ExportError
        with pykvalloc.Pool(64 << 20, backend="cuda", device=0) as pool:
            allocation = pool.alloc(1 << 20)
            assert allocation.__dlpack_device__() == (2, 0)
            raw = allocation.__cuda_array_interface__
            assert raw["data"] == (allocation.address, False) and raw["version"] == 3
            assert raw["shape"] == (1 << 20,) and raw["typestr"] == "|u1"
            assert raw["stream"] is None and raw["strides"] is None
            tensor = allocation.tensor("float16", (512, 1024))
            interface = tensor.__cuda_array_interface__
            assert interface["typestr"] == "<f2" and interface["shape"] == (512, 1024)
            assert interface["data"][0] == allocation.address
            for stream in (None, -1, 1, 2, 0x7F00DEAD):
                capsule = tensor.__dlpack__(stream=stream)
                del capsule
            for stream, error in ((0, pykvalloc.InvalidArgument), (-2, pykvalloc.InvalidArgument),
                                  ("s", TypeError), (True, TypeError)):
                try:
                    tensor.__dlpack__(stream=stream)
                    raise AssertionError(f"stream {stream!r} accepted")
                except error:
                    pass
            try:
                np.from_dlpack(tensor)       # numpy cannot read GPU memory and must refuse
                raise AssertionError("numpy took a CUDA capsule")
            except (BufferError, RuntimeError, ValueError):
                pass
            try:
                np.asarray(tensor)
                raise AssertionError("numpy read GPU memory")
            except TypeError:
                pass
            try:
                tensor.__dlpack__(dl_device=(1, 0))
                raise AssertionError("exported GPU memory as CPU memory")
            except ExportError:
                pass
            gc.collect()
            assert _dlpack.live_exports() == 0    # the refused capsules were released
            held = tensor.__dlpack__(stream=1)
            del tensor
            try:
                pool.free(allocation)
                raise AssertionError("freed under a live export")
            except pykvalloc.AllocationInUseError:
                pass
            del held
            gc.collect()
            pool.free(allocation)

            cache = pykvalloc.KVCache(num_blocks=16, block_tokens=16, layers=2, kv_heads=4,
                                      head_dim=64, pool=pool)
            kv = cache.kv_tensor(1)
            assert kv.__dlpack_device__() == (2, 0)
            assert kv.__cuda_array_interface__["data"][0] == cache.block_address(0, 1, "K")
            assert kv.__cuda_array_interface__["strides"] is None
            del kv
            cache.close()
        print("done")
        """, fake_driver)


# ---- KV tensors --------------------------------------------------------------------------------


GEOMETRY = dict(num_blocks=12, block_tokens=4, layers=3, kv_heads=2, head_dim=8,
                dtype="float16")


def element_offset(index: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return sum(i * s for i, s in zip(index, strides))


@pytest.mark.parametrize("cache_layout", ["layers", "blocks"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_layer_tensor_is_indexed_by_block_id(cache_layout, layout):
    with pykvalloc.KVCache(**GEOMETRY, layout=cache_layout) as cache:
        seq = cache.allocate(20)  # five blocks
        table = np.array(seq.block_table)
        for layer in range(3):
            tensor = cache.kv_tensor(layer, layout=layout)
            assert tensor.shape == ((12, 2, 4, 2, 8) if layout == "NHD" else (12, 2, 2, 4, 8))
            assert tensor.is_contiguous == (cache_layout == "layers")
            kv = np.from_dlpack(tensor)
            for position, block in enumerate(table):
                for part, name in ((0, "K"), (1, "V")):
                    token, head, dim = position % 4, (position + part) % 2, (3 * position) % 8
                    value = float(100 * layer + 10 * position + part)
                    index = (token, head, dim) if layout == "NHD" else (head, token, dim)
                    kv[(block, part) + index] = value
                    # the documented offset inside the part: row-major in the layout's order
                    inner = element_offset(index, (16, 8, 1) if layout == "NHD" else (32, 8, 1))
                    address = cache.block_address(int(block), layer, name) + 2 * inner
                    assert np.frombuffer(read_bytes(address, 2), np.float16)[0] == value
        seq.free()


@pytest.mark.parametrize("cache_layout", ["layers", "blocks"])
def test_the_all_layer_tensor(cache_layout):
    with pykvalloc.KVCache(**GEOMETRY, layout=cache_layout) as cache:
        whole = cache.kv_tensor()
        assert whole.shape == (3, 12, 2, 4, 2, 8)
        assert whole.is_contiguous == (cache_layout == "layers")
        assert whole.address == cache.info.base
        for layer in range(3):
            assert whole[layer].address == cache.kv_tensor(layer).address
            assert whole[layer].strides == cache.kv_tensor(layer).strides
        array = np.from_dlpack(whole)
        array[2, 7, 1, 3, 1, 5] = 3.0
        assert np.from_dlpack(cache.kv_tensor(2))[7, 1, 3, 1, 5] == 3.0
        address = cache.block_address(7, 2, "V") + 2 * (3 * 16 + 1 * 8 + 5)
        assert np.frombuffer(read_bytes(address, 2), np.float16)[0] == 3.0
        if cache_layout == "blocks":  # one block's layers are adjacent: this permutation is whole
            permuted = array.transpose(1, 0, 2, 3, 4, 5)
            assert permuted.flags.c_contiguous


def test_kv_tensor_dtypes_and_bad_input():
    with pykvalloc.KVCache(**GEOMETRY) as cache:
        assert cache.dtype.name == "float16" and cache.kv_tensor(0).dtype.name == "float16"
        assert cache.kv_tensor(0, dtype="bfloat16").dtype.code == 4  # same size: a reading
        assert cache.kv_tensor(0, layout="hnd").shape[2] == 2
        with pytest.raises(pykvalloc.InvalidArgument, match="bytes per element"):
            cache.kv_tensor(0, dtype="float32")
        with pytest.raises(pykvalloc.InvalidArgument, match="'NHD' or 'HND'"):
            cache.kv_tensor(0, layout="NDH")
        with pytest.raises(pykvalloc.InvalidArgument, match="out of range"):
            cache.kv_tensor(3)
        with pytest.raises(pykvalloc.InvalidArgument):
            cache.kv_tensor(-1)
        assert cache._users == 0
    with pykvalloc.KVCache(**{**GEOMETRY, "dtype": "fp8"}) as fp8:
        assert fp8.kv_tensor(1).dtype.name == "float8_e4m3fn"
    contiguous = dict(GEOMETRY, num_blocks=None, capacity_bytes=8 * MiB, mode="contiguous")
    with pykvalloc.KVCache(**contiguous) as cache:
        with pytest.raises(pykvalloc.InvalidArgument, match="paged"):
            cache.kv_tensor(0)


def test_kv_tensors_block_neither_compaction_nor_sequences_and_keep_the_memory():
    cache = pykvalloc.KVCache(**GEOMETRY)
    kv = np.from_dlpack(cache.kv_tensor(0))
    seqs = [cache.allocate(8) for _ in range(3)]
    seqs[0].append(4)
    seqs[0].free()
    moves = cache.compact()  # a KV tensor is not a block-table view
    for src, dst in moves:
        kv[dst] = kv[src]
    table = seqs[1].block_table
    with pytest.raises(pykvalloc.TableInUseError, match="1 block_table"):
        cache.compact()
    del table
    cache.close()
    assert cache._finalizer.alive  # the tensor's array keeps the memory
    kv[:] = 1.0
    del kv
    gc.collect()
    assert not cache._finalizer.alive


# ---- MLA and groups ----------------------------------------------------------------------------


def test_an_mla_cache_has_one_latent_vector_per_token():
    mla = pykvalloc.KVGroup.mla(layers=3, kv_lora_rank=32, rope_dim=8)
    assert mla == pykvalloc.KVGroup(3, 1, 40, parts=1)
    with pykvalloc.KVCache(num_blocks=10, block_tokens=4, groups=[mla], dtype="bf16") as cache:
        info = cache.info
        assert info.block_bytes == 3 * 4 * 40 * 2 and info.kv_heads == 1 and info.head_dim == 40
        assert cache.layer_info(1).parts == 1
        latent = cache.kv_tensor(1)
        assert latent.shape == (10, 4, 40) and latent.is_contiguous  # vLLM's MLA cache shape
        whole = cache.kv_tensor()
        assert whole.shape == (3, 10, 4, 40) and whole.is_contiguous
        data = np.from_dlpack(cache.kv_tensor(1, dtype="uint16"))
        data[7, 2, 5] = 0x1234
        address = cache.block_address(7, 1, "K") + 2 * (2 * 40 + 5)
        assert read_bytes(address, 2) == (0x1234).to_bytes(2, "little")
        with pytest.raises(pykvalloc.InvalidArgument, match="one vector"):
            cache.block_address(7, 1, "V")


@pytest.mark.parametrize("cache_layout", ["layers", "blocks"])
def test_groups_of_different_shapes_index_by_block_id(cache_layout):
    G = pykvalloc.KVGroup
    groups = [G(2, 2, 8), G.mla(1, 12, 4), G(2, 1, 16)]
    with pykvalloc.KVCache(num_blocks=8, block_tokens=4, groups=groups, dtype="float16",
                           layout=cache_layout) as cache:
        assert cache.groups == tuple(groups) and cache.info.layers == 5
        assert cache.info.block_bytes == 4 * 2 * (2 * 2 * 2 * 8 + 16 + 2 * 2 * 16)
        with pytest.raises(pykvalloc.InvalidArgument, match="differ in shape"):
            cache.kv_tensor()
        expected = {0: (8, 2, 4, 2, 8), 1: (8, 2, 4, 2, 8), 2: (8, 4, 16), 3: (8, 2, 4, 1, 16),
                    4: (8, 2, 4, 1, 16)}
        seq = cache.allocate(12)
        block = int(seq.block_table[1])
        for layer, shape in expected.items():
            tensor = cache.kv_tensor(layer)
            assert tensor.shape == shape
            assert tensor.is_contiguous == (cache_layout == "layers")
            assert tensor.address == cache.block_address(0, layer, "K")
            array = np.from_dlpack(tensor)
            value = 10.0 + layer
            if len(shape) == 3:  # MLA: (block, token, latent)
                array[block, 3, 15] = value
                address = cache.block_address(block, layer, "K") + 2 * (3 * 16 + 15)
            else:
                array[block, 1, 3, 0, 7] = value
                geometry = cache.layer_info(layer)
                inner = 3 * geometry.kv_heads * geometry.head_dim + 7
                address = cache.block_address(block, layer, "V") + 2 * inner
            assert np.frombuffer(read_bytes(address, 2), np.float16)[0] == value
        for index, group in enumerate(groups):
            tensor = cache.kv_tensor(group=index)
            assert tensor.shape[0] == group.layers
            first = sum(g.layers for g in groups[:index])
            for offset in range(group.layers):
                assert tensor[offset].address == cache.kv_tensor(first + offset).address
                assert tensor[offset].strides == cache.kv_tensor(first + offset).strides
        seq.free()


def test_bad_groups_change_nothing():
    G = pykvalloc.KVGroup
    with pytest.raises(pykvalloc.InvalidArgument, match="or groups, not both"):
        pykvalloc.KVCache(num_blocks=8, layers=2, groups=[G(2, 2, 8)])
    with pytest.raises(pykvalloc.InvalidArgument, match="parts 3"):
        pykvalloc.KVCache(num_blocks=8, groups=[G(2, 2, 8, parts=3)])
    with pytest.raises(pykvalloc.InvalidArgument, match="zero geometry"):
        pykvalloc.KVCache(num_blocks=8, groups=[G(2, 0, 8)])
    with pytest.raises(pykvalloc.InvalidArgument, match="num_groups 0"):
        pykvalloc.KVCache(num_blocks=8, groups=[])
    with pytest.raises(pykvalloc.InvalidArgument, match="a group is"):
        pykvalloc.KVCache(num_blocks=8, groups=[(2, 8)])  # type: ignore[list-item]
    with pytest.raises(pykvalloc.InvalidArgument, match="paged"):
        pykvalloc.KVCache(capacity_bytes=8 * MiB, mode="contiguous", groups=[G(2, 2, 8)])
    with pykvalloc.KVCache(num_blocks=8, groups=[G(2, 2, 8)]) as cache:
        with pytest.raises(pykvalloc.InvalidArgument, match="not both"):
            cache.kv_tensor(0, group=0)
        with pytest.raises(pykvalloc.InvalidArgument, match="group 1 is out of range"):
            cache.kv_tensor(group=1)
        assert cache._users == 0


def test_exports_do_not_depend_on_the_shared_pythonapi_declarations(pool):
    # ctypes.pythonapi's function objects are one per process: a package that declares
    # PyCapsule_New's arguments its own way (some do) must not break an export.
    shared = ctypes.pythonapi.PyCapsule_New
    saved = shared.argtypes, shared.restype
    shared.argtypes, shared.restype = [ctypes.c_char_p], ctypes.c_int
    try:
        array = np.from_dlpack(pool.alloc(64).tensor("uint8"))
        assert array.shape == (64,)
    finally:
        shared.argtypes, shared.restype = saved


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_the_packed_capsule_reads_back_as_dlpack_h_declares_it(pool, max_version):
    allocation = pool.alloc(4096)
    tensor = allocation.tensor("int16", (4, 8), strides=(16, 2))
    capsule = tensor.__dlpack__(max_version=max_version)
    name = b"dltensor" if max_version is None else b"dltensor_versioned"
    get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    address = get_pointer(capsule, name)
    if max_version is None:
        managed = _dlpack.DLManagedTensor.from_address(address)
    else:
        managed = _dlpack.DLManagedTensorVersioned.from_address(address)
        assert (managed.version.major, managed.version.minor) == (1, 0) and managed.flags == 0
    assert managed.manager_ctx == address
    dl = managed.dl_tensor
    assert dl.data == allocation.address and dl.byte_offset == 0 and dl.ndim == 2
    assert (dl.device.device_type, dl.device.device_id) == (1, 0)
    assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (0, 16, 1)
    assert [dl.shape[i] for i in range(2)] == [4, 8]
    assert [dl.strides[i] for i in range(2)] == [16, 2]
    before = _dlpack.live_exports()
    managed.deleter(address)  # as a consumer that took it would (the capsule is then spent)
    assert _dlpack.live_exports() == before - 1
