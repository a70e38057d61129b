"""torch.from_dlpack over pykvalloc memory (CPU torch): the same bytes, zero-copy, both ways;
the export keeps the allocation from being freed; KV tensors index by block id. Opt-in:
``make test-torch`` runs this directory with the interpreter of .venv-vllm, which has torch."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pykvalloc  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_this_worktree_is_under_test():
    # make test-torch puts the tree first on PYTHONPATH and names its build's library.
    assert Path(pykvalloc.__file__).resolve().is_relative_to(REPO_ROOT)
    library = os.environ.get("PYKVALLOC_LIB")
    assert library is None or Path(library).resolve().is_relative_to(REPO_ROOT)


@pytest.mark.parametrize("dtype, torch_dtype", [("float16", torch.float16),
                                                ("bfloat16", torch.bfloat16),
                                                (torch.float32, torch.float32),
                                                ("int8", torch.int8)])
def test_torch_sees_the_same_bytes(dtype, torch_dtype):
    with pykvalloc.Pool(16 << 20) as pool:
        allocation = pool.alloc(1 << 20)
        tensor = allocation.tensor(dtype, (64, 64))
        t = torch.from_dlpack(tensor)
        assert t.dtype == torch_dtype and t.shape == (64, 64) and t.device.type == "cpu"
        assert t.data_ptr() == allocation.address
        t.fill_(3)
        raw = allocation.view(np.uint8, (64 * 64 * t.element_size(),))
        assert bytes(raw[: t.element_size()]) == t[0, :1].view(torch.uint8).numpy().tobytes()
        raw[:] = 0
        assert int(t.count_nonzero()) == 0
        with pytest.raises(pykvalloc.AllocationInUseError):
            pool.free(allocation)
        del t, raw, tensor
        gc.collect()
        pool.free(allocation)


def test_torch_and_numpy_share_an_allocation():
    with pykvalloc.Pool(16 << 20) as pool:
        allocation = pool.alloc(4096)
        t = torch.from_dlpack(allocation.tensor("float32"))
        a = np.from_dlpack(allocation.tensor("float32"))
        t[5] = 7.5
        assert a[5] == 7.5
        a[6] = -1.0
        assert float(t[6]) == -1.0


def test_torch_tensors_of_a_kv_cache_index_by_block_id():
    with pykvalloc.KVCache(num_blocks=32, block_tokens=16, layers=4, kv_heads=2, head_dim=64,
                           dtype="bfloat16") as cache:
        seq = cache.allocate(40)
        table = torch.from_numpy(np.array(seq.block_table).astype(np.int64))
        kv = torch.from_dlpack(cache.kv_tensor(2))  # NHD
        assert kv.shape == (32, 2, 16, 2, 64) and kv.dtype == torch.bfloat16
        assert kv.is_contiguous()
        kv[table, 1] = 1.0  # every V of the sequence's blocks, one gather-scatter
        block = int(table[2])
        address = cache.block_address(block, 2, "V")
        assert ctypes.string_at(address, 2) == torch.tensor([1.0], dtype=torch.bfloat16).view(
            torch.uint8).numpy().tobytes()
        whole = torch.from_dlpack(cache.kv_tensor(layout="HND"))
        assert whole.shape == (4, 32, 2, 2, 16, 64)
        assert whole[2, block, 1].eq(1.0).all()
        seq.free()
        del kv, whole
