/*
 * kv_publish_scan.c — what a full publish of a named KV cache costs as its live sequences and
 * its blocks grow: the sequences section (the 16 longest live sequences and pins) is found by a
 * walk over the sequence slots, which must grow with the sequences, never with the blocks. For
 * callgrind, whose counts do not depend on the machine's load:
 *
 *     cc -O2 -std=c11 -I libkvalloc/include tools/experiments/kv_publish_scan.c \
 *        build/libkvalloc.a -lpthread -ldl -o kv_publish_scan
 *     valgrind --tool=callgrind ./kv_publish_scan BLOCKS SEQUENCES PUBLISHES
 *
 * A cache of BLOCKS 16-token blocks on a named pool, SEQUENCES live sequences of one block each
 * (and as many more of two blocks every 7th), then PUBLISHES calls of kva_stats_publish (each a
 * full publish: heap map, slabs, the KV sections). Two runs that differ only in PUBLISHES give,
 * by difference, the instructions of one publish.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kvalloc.h"
#include "named_cache.h"

int main(int argc, char **argv) {
    experiment = "kv_publish_scan";
    if (argc != 4) {
        fprintf(stderr, "usage: %s BLOCKS SEQUENCES PUBLISHES\n", argv[0]);
        return 2;
    }
    uint32_t blocks = (uint32_t)strtoul(argv[1], NULL, 10), sequences = (uint32_t)strtoul(argv[2], NULL, 10);
    long publishes = strtol(argv[3], NULL, 10);
    kva_kv *kv = named_cache("kvscan", blocks);
    kva_kv_info info;
    try(kva_kv_get_info(kv, &info), "info");
    for (uint32_t i = 0; i < sequences; i++) {
        kva_kv_seq seq;
        try(kva_kv_seq_admit(kv, i % 7 ? 16 : 32, i % 40, 0, NULL, 0, &seq, NULL), "admit");
    }
    for (long i = 0; i < publishes; i++) try(kva_stats_publish(info.pool), "publish");
    kva_kv_destroy(kv);
    return 0;
}
