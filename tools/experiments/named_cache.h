/*
 * named_cache.h — what the KV publishing experiments (kv_publish_scan.c, kv_paint_pins.c)
 * share: a call that must succeed, and the small named cache whose publishes they count.
 */
#ifndef KVA_EXPERIMENT_NAMED_CACHE_H
#define KVA_EXPERIMENT_NAMED_CACHE_H

#include <stdio.h>
#include <stdlib.h>

#include "kvalloc.h"

/* The experiment's name, for its messages. */
static const char *experiment;

/* Ends the experiment when a call it relies on fails. */
static void try(kva_status st, const char *what) {
    if (st != KVA_OK) {
        fprintf(stderr, "%s: %s: %s\n", experiment, what, kva_last_error());
        exit(1);
    }
}

/* A paged cache of `blocks` 16-token blocks of one layer, one head of 8, small pages, on a pool
 * it makes with this name (so that every publish fills its sections). */
static kva_kv *named_cache(const char *name, uint32_t blocks) {
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = 1;
    cfg.kv_heads = 1;
    cfg.head_dim = 8;
    cfg.block_tokens = 16;
    cfg.num_blocks = blocks;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.name = name;
    kva_kv *kv;
    try(kva_kv_create(&cfg, NULL, &kv), "create");
    return kv;
}

#endif
