"""The reader's numpy dtypes against kvalloc_stats.h as the C compiler lays it out."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap

import numpy as np
import pytest
from support import REPO_ROOT

from pykvalloc import stats

HEADER = REPO_ROOT / "libkvalloc" / "include" / "kvalloc_stats.h"

DTYPES = {
    "kva_shm_section": stats.SECTION_DTYPE,
    "kva_shm_header": stats.HEADER_DTYPE,
    "kva_shm_summary": stats.SUMMARY_DTYPE,
    "kva_shm_heapmap": stats.HEAPMAP_DTYPE,
    "kva_shm_class": stats.CLASS_DTYPE,
    "kva_shm_classes": stats.COUNTED_DTYPE,
    "kva_shm_slab": stats.SLAB_DTYPE,
    "kva_shm_slabs": stats.SLABS_DTYPE,
    "kva_shm_arena": stats.ARENA_DTYPE,
    "kva_shm_arenas": stats.COUNTED_DTYPE,
    "kva_shm_latency": stats.LATENCY_DTYPE,
    "kva_shm_kv": stats.KV_DTYPE,
    "kva_shm_trace": stats.TRACE_DTYPE,
    "kva_shm_trace_record": stats.RECORD_DTYPE,
    "kva_shm_kv_sequences": stats.KV_SEQUENCES_DTYPE,
    "kva_shm_kv_sequence": stats.KV_SEQUENCE_DTYPE,
    "kva_shm_kv_namespaces": stats.KV_NAMESPACES_DTYPE,
    "kva_shm_kv_namespace": stats.KV_NAMESPACE_DTYPE,
}

pytestmark = pytest.mark.skipif(not HEADER.is_file(), reason="no source tree beside")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_dtypes_match_the_c_layout(tmp_path):
    lines = []
    for c_name, dtype in DTYPES.items():
        lines.append(f'printf("{c_name} sizeof %zu\\n", sizeof({c_name}));')
        for field in dtype.names:
            lines.append(f'printf("{c_name} {field} %zu %zu\\n", offsetof({c_name}, {field}), '
                         f'sizeof((({c_name} *)0)->{field}));')
    source = tmp_path / "probe.c"
    source.write_text(textwrap.dedent("""\
        #include <stddef.h>
        #include <stdio.h>
        #include "kvalloc_stats.h"
        int main(void) {
        %s
            return 0;
        }
        """) % "\n".join("    " + line for line in lines))
    binary = tmp_path / "probe"
    subprocess.run(["cc", "-std=c11", "-I", str(HEADER.parent), str(source), "-o", str(binary)],
                   check=True)
    from_c = subprocess.run([str(binary)], capture_output=True, text=True,
                            check=True).stdout.splitlines()

    expected = []
    for c_name, dtype in DTYPES.items():
        expected.append(f"{c_name} sizeof {dtype.itemsize}")
        for field in dtype.names:
            sub, offset = dtype.fields[field][:2]
            expected.append(f"{c_name} {field} {offset} {sub.itemsize}")
    assert from_c == expected


def test_constants_match_the_header():
    text = HEADER.read_text()

    def define(name: str) -> int:
        match = re.search(rf"#define {name} (0x[0-9a-fA-F]+|\d+)", text)
        assert match, name
        return int(match.group(1), 0)

    assert define("KVA_SHM_MAGIC") == stats.MAGIC
    assert define("KVA_SHM_ABI_MAJOR") == stats.ABI_MAJOR
    assert define("KVA_SHM_ABI_MINOR") == stats.ABI_MINOR
    assert define("KVA_SHM_MAX_SECTIONS") == stats.MAX_SECTIONS
    assert define("KVA_SHM_LATENCY_BUCKETS") == stats.LATENCY_BUCKETS
    assert define("KVA_SHM_STRIP_CELLS") == stats.STRIP_CELLS
    assert define("KVA_SHM_KV_SEQ_TABLE") == stats.KV_SEQ_TABLE
    assert define("KVA_SHM_KV_NAMESPACE_SLOTS") == stats.KV_NAMESPACE_SLOTS
    assert re.search(rf"KVA_SHM_KV_SEQ_PIN = 1u << 0\b", text) and stats.KV_SEQ_PIN == 1
    assert re.search(rf"KVA_SHM_KV_NS_OTHER = 1u << 0\b", text) and stats.KV_NS_OTHER == 1
    assert np.frombuffer(b"KVASTAT1", "<u8")[0] == stats.MAGIC
    for name, value in (("SUMMARY", 1), ("HEAPMAP", 2), ("CLASSES", 3), ("SLABS", 4),
                        ("ARENAS", 5), ("LATENCY", 6), ("KV", 7), ("TRACE", 8),
                        ("KV_SEQUENCES", 9), ("KV_NAMESPACES", 10)):
        assert re.search(rf"KVA_SHM_SECTION_{name} = {value}\b", text), name
        assert getattr(stats, f"SECTION_{name}") == value
    for index, name in enumerate(("FREE", "BLOCK", "SLAB", "MIXED", "KV_USED", "KV_CACHED",
                                  "KV_PINNED")):
        assert re.search(rf"KVA_SHM_CELL_{name} = {index}\b", text), name
        assert getattr(stats, f"CELL_{name}") == index
    for code, name in stats.OP_NAMES.items():
        assert re.search(rf"KVA_SHM_OP_{name.upper()} = {code}\b", text), name
