/*
 * proc_self.h — what the kernel says about this test process, read from /proc: memory
 * mappings and their flags, residency, huge-page settings. The tests check the library's
 * promises about memory against the kernel's own view, not against the library's word.
 */
#ifndef KVA_TEST_PROC_SELF_H
#define KVA_TEST_PROC_SELF_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

#define KVA_TEST_UNUSED static __attribute__((unused))

/* Counting the process's mappings finds leaked ones, except under AddressSanitizer: its shadow
 * mappings, terabytes of them, split and move as it works. There the tests fall back to what can
 * be checked by address; the normal build, which CI runs too, checks the whole process. */
#if defined(__SANITIZE_ADDRESS__)
#define MAPS_ARE_RELIABLE 0
#else
#define MAPS_ARE_RELIABLE 1
#endif

/* A /proc/meminfo figure (kB or a count), -1 if absent. */
KVA_TEST_UNUSED long meminfo_value(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long value = -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':') value = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return value;
}

/* Whether the kernel grants transparent huge pages to a range advised MADV_HUGEPAGE. */
KVA_TEST_UNUSED int thp_available(void) {
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return 0;
    char line[128] = {0};
    int ok = fgets(line, sizeof line, f) && !strstr(line, "[never]");
    fclose(f);
    return ok;
}

/* The VmFlags line of the mapping that contains addr, from /proc/self/smaps. */
KVA_TEST_UNUSED int vm_flags_of(const void *addr, char *flags, size_t len) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return 0;
    char line[512];
    int inside = 0, found = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            inside = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
        } else if (inside && strncmp(line, "VmFlags:", 8) == 0) {
            snprintf(flags, len, "%s", line + 8);
            found = 1;
            break;
        }
    }
    fclose(f);
    return found;
}

/* The number of mappings of the process. */
KVA_TEST_UNUSED long mapping_count(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    long n = 0;
    int ch;
    while ((ch = fgetc(f)) != EOF) n += ch == '\n';
    fclose(f);
    return n;
}

/* Bytes in mappings of at least min_size bytes: a pool's region is the only mapping that large
 * the tests make, so this follows regions while ignoring the C library's small mappings. */
KVA_TEST_UNUSED unsigned long large_mapped_bytes(unsigned long min_size) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    char line[512];
    unsigned long total = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && hi - lo >= min_size) total += hi - lo;
    }
    fclose(f);
    return total;
}

/* Pages of [base, base + length) that are resident (mincore). */
KVA_TEST_UNUSED size_t resident_pages(void *base, size_t length) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), n = length / page, count = 0;
    unsigned char *vec = malloc(n);
    REQUIRE(vec && mincore(base, length, vec) == 0);
    for (size_t i = 0; i < n; i++) count += vec[i] & 1;
    free(vec);
    return count;
}

#endif
