/*
 * os.h — every operating-system call the library makes, behind one small interface.
 *
 * Contract: each function returns a kva_status (KVA_OK or KVA_ERR_BACKEND with kva_last_error()
 * naming the call and errno) and never leaves a partial mapping behind on failure. Nothing
 * here is called once a pool exists, except kva_os_unmap at destruction.
 */
#ifndef KVA_OS_H
#define KVA_OS_H

#include <stddef.h>

#include "internal.h"

#define KVA_HUGE_PAGE_SIZE ((size_t)2 << 20)

/* Reserves length bytes of address space aligned to alignment (a power of two), inaccessible.
 * *out receives the aligned start. */
kva_status kva_os_reserve(size_t length, size_t alignment, void **out);

/* Replaces [addr, addr+length) of a reservation with readable, writable memory. With huge set
 * the memory comes from hugetlb 2 MiB pages (addr and length multiples of 2 MiB). */
kva_status kva_os_commit(void *addr, size_t length, int huge);

/* Advises transparent huge pages for the range (KVA_ERR_BACKEND if the kernel refuses). */
kva_status kva_os_advise_thp(void *addr, size_t length);

/* Takes every first-touch page fault of the range now. */
kva_status kva_os_populate(void *addr, size_t length, size_t page_size);

/* Zeroed, lazily committed host memory for metadata. */
kva_status kva_os_map_metadata(size_t length, void **out);

/* Releases a reservation or a metadata mapping (whole or in part). NULL or 0 is a no-op. */
void kva_os_unmap(void *addr, size_t length);

/* The system's base page size. */
size_t kva_os_page_size(void);

/* Creates the shared-memory object `name` ("/..."), mode 0600, of length bytes, maps it
 * read-write and returns the mapping; an object of that name that already exists is replaced
 * (it can only be a leftover of a dead process with our pid). On failure nothing is left. */
kva_status kva_os_shm_create(const char *name, size_t length, void **out);
void kva_os_shm_unlink(const char *name);

uint64_t kva_os_realtime_ns(void);
uint64_t kva_os_monotonic_ns(void);
unsigned kva_os_thread_id(void);
unsigned kva_os_pid(void);

#endif
