/*
 * bench_publish.c — what a pool's statistics segment costs: the same work on an anonymous pool
 * and on a named one (tracing off, the default). Meant to run under callgrind, whose instruction
 * counts do not depend on the machine's load; tools/run_publish_cost.sh runs it and prints the
 * cost per operation, with the fixed cost of creating the segment taken out by differencing two
 * run lengths.
 *
 * Usage: bench_publish batch64|batch4k|large NAMED(0|1) ROUNDS
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kvalloc.h"
int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: bench_publish batch64|batch4k|large NAMED ROUNDS\n");
        return 2;
    }
    const char *pattern = argv[1];
    int named = atoi(argv[2]), rounds = atoi(argv[3]);
    kva_config c;
    kva_config_init(&c);
    c.capacity = (size_t)1 << 30;
    c.pages = KVA_PAGES_SMALL;
    if (named)
        c.name = "pubcost";
    kva_pool *p;
    if (kva_pool_create(&c, &p))
        return 1;
    void *v[1000];
    if (!strcmp(pattern, "batch64") || !strcmp(pattern, "batch4k")) {
        size_t size = pattern[5] == '6' ? 64 : 4096;
        for (int r = 0; r < rounds; r++) {
            for (int i = 0; i < 1000; i++)
                kva_alloc(p, size, &v[i]);
            for (int i = 0; i < 1000; i++)
                kva_free(p, v[i]);
        }
    } else { /* large blocks, 1..64 MiB, every call a slow path that may publish */
        unsigned s = 1;
        for (int r = 0; r < rounds; r++) {
            for (int i = 0; i < 8; i++) {
                s = s * 1103515245 + 12345;
                kva_alloc(p, (size_t)1 << (20 + (s >> 16) % 7), &v[i]);
            }
            for (int i = 0; i < 8; i++)
                kva_free(p, v[i]);
        }
    }
    kva_pool_destroy(p);
    return 0;
}
