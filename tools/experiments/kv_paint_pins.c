/*
 * kv_paint_pins.c — what a full publish of a named KV cache costs with pinned blocks: the heap
 * map's repaint reads a block's pin count only while some block is pinned, and then only for a
 * used block, so pins add nothing a publish can measure. For callgrind, whose counts do not
 * depend on the machine's load:
 *
 *     cc -O2 -std=c11 -I libkvalloc/include tools/experiments/kv_paint_pins.c \
 *        build/libkvalloc.a -lpthread -ldl -lm -o kv_paint_pins
 *     valgrind --tool=callgrind ./kv_paint_pins BLOCKS PINNED PUBLISHES
 *
 * A cache of BLOCKS 16-token blocks on a named pool: half of them cached (keyed, then freed),
 * the first PINNED of those pinned, a quarter more held by a sequence; then PUBLISHES calls of
 * kva_stats_publish (each a full publish). Two runs that differ only in PUBLISHES give, by
 * difference, the instructions of one publish.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kvalloc.h"
#include "named_cache.h"

int main(int argc, char **argv) {
    experiment = "kv_paint_pins";
    if (argc != 4) {
        fprintf(stderr, "usage: %s BLOCKS PINNED PUBLISHES\n", argv[0]);
        return 2;
    }
    uint32_t blocks = (uint32_t)strtoul(argv[1], NULL, 10), pinned = (uint32_t)strtoul(argv[2], NULL, 10);
    long publishes = strtol(argv[3], NULL, 10);
    if (blocks < 4 || pinned > blocks / 2) {
        fprintf(stderr, "kv_paint_pins: at least 4 blocks, and at most half of them pinned\n");
        return 2;
    }
    kva_kv *kv = named_cache("kvpaint", blocks);
    kva_kv_info info;
    try(kva_kv_get_info(kv, &info), "info");
    uint64_t *keys = malloc(sizeof *keys * (blocks / 2));
    if (!keys) return 1;
    for (uint32_t i = 0; i < blocks / 2; i++) keys[i] = i + 1;
    kva_kv_seq cached, held, pin;
    try(kva_kv_seq_allocate(kv, blocks / 2 * 16, keys, blocks / 2, NULL, 0, 0, 0, &cached, NULL), "allocate");
    try(kva_kv_seq_free(kv, cached), "free");
    try(kva_kv_seq_allocate(kv, blocks / 4 * 16, NULL, 0, NULL, 0, 0, 0, &held, NULL), "hold");
    if (pinned) try(kva_kv_pin(kv, keys, pinned, NULL, 0, 0, &pin, NULL), "pin");
    for (long i = 0; i < publishes; i++) try(kva_stats_publish(info.pool), "publish");
    kva_kv_destroy(kv);
    free(keys);
    return 0;
}
