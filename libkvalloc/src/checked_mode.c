/*
 * checked_mode.c — poison and red-zone bytes for checked pools (checked.h).
 */
#include <string.h>

#include "checked.h"

void kva_poison(unsigned char *p, size_t n) { memset(p, KVA_POISON_FREE, n); }

int kva_holds(const unsigned char *p, size_t n, unsigned char pattern, size_t *bad) {
    /* A word at a time: a checked pool verifies whole blocks on every allocation. */
    uint64_t word;
    memset(&word, pattern, sizeof word);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        if (v != word) break;
    }
    for (; i < n; i++)
        if (p[i] != pattern) {
            *bad = i;
            return 0;
        }
    return 1;
}
