/*
 * kv_events.c — KV events for KV-aware routing: a bounded ring of kva_kv_event in the cache,
 * written as blocks are registered and their registrations dropped, drained by the engine
 * (kva_kv_take_events).
 *
 * The ring holds event_count events from event_head on (modulo event_capacity), oldest first.
 * An event that finds it full is dropped and counted (events_dropped), so the events kept are a
 * prefix of what happened since the last drain and never out of order. A cache created without
 * events has no ring (kv->events NULL), and every producer tests that one pointer first: events
 * off cost one predictable branch per registration.
 */
#include <string.h>

#include "kv_cache.h"

kva_status kv_events_init(kva_kv *kv, uint32_t capacity) {
    void *ring;
    kva_status st = kv_metadata_map((size_t)capacity * sizeof *kv->events, &ring, &kv->events_length);
    if (st != KVA_OK) return st;
    kv->events = ring;
    kv->event_capacity = capacity;
    return KVA_OK;
}

void kv_events_release(kva_kv *kv) { kva_os_unmap(kv->events, kv->events_length); }

/* The next event's room, zeroed, or NULL (the event dropped and counted) when the ring is full. */
static kva_kv_event *event_slot(kva_kv *kv, uint32_t kind, uint32_t block, uint64_t ns) {
    if (kv->event_count == kv->event_capacity) {
        kv->events_dropped++;
        return NULL;
    }
    uint32_t at = kv->event_head + kv->event_count;
    if (at >= kv->event_capacity) at -= kv->event_capacity;
    kv->event_count++;
    kva_kv_event *ev = &kv->events[at];
    memset(ev, 0, sizeof *ev);
    ev->kind = kind;
    ev->block = block;
    ev->namespace_id = ns;
    ev->medium = kv->event_medium;
    return ev;
}

/* A key as an event carries it: an engine key's bytes, or the library's 128 bits, low 64 bits
 * first, each little-endian. Returns its length. */
static uint8_t key_bytes(const kv_ident *id, uint8_t *out) {
    if (id->len) {
        memcpy(out, id->bytes, id->len);
        return (uint8_t)id->len;
    }
    for (unsigned i = 0; i < 8; i++) {
        out[i] = (uint8_t)(id->key.lo >> (8 * i));
        out[8 + i] = (uint8_t)(id->key.hi >> (8 * i));
    }
    return 16;
}

void kv_event_stored(kva_kv *kv, uint32_t b, const kv_ident *id, const kv_ident *parent, uint32_t first_token) {
    kva_kv_event *ev = event_slot(kv, KVA_KV_EVENT_STORED, b, id->ns);
    if (!ev) return;
    ev->first_token = first_token;
    ev->num_tokens = kv->block_tokens;
    ev->library_key = id->len == 0;
    ev->key_len = key_bytes(id, ev->key);
    if (parent) ev->parent_len = key_bytes(parent, ev->parent);
}

void kv_event_removed(kva_kv *kv, uint32_t b) {
    kv_ident id = kv_block_ident(kv, b);
    kva_kv_event *ev = event_slot(kv, KVA_KV_EVENT_REMOVED, b, id.ns);
    if (!ev) return;
    ev->library_key = id.len == 0;
    ev->key_len = key_bytes(&id, ev->key);
}

void kv_event_cleared(kva_kv *kv) { event_slot(kv, KVA_KV_EVENT_CLEARED, KVA_KV_NO_BLOCK, 0); }

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

static kva_status take_events_locked(kva_kv *kv, kva_kv_event *buf, uint32_t capacity, uint32_t *count,
                                     uint64_t *dropped) {
    if (!kv->events) return INVALID("this cache keeps no events (created with event_capacity 0)");
    if (!buf || capacity == 0) return INVALID("no room for events: buf %p, capacity %u", (void *)buf, capacity);
    if (!count || !dropped) return INVALID("count or dropped is NULL");
    uint32_t n = kv->event_count < capacity ? kv->event_count : capacity;
    uint32_t first = kv->event_capacity - kv->event_head < n ? kv->event_capacity - kv->event_head : n;
    memcpy(buf, kv->events + kv->event_head, (size_t)first * sizeof *buf);
    memcpy(buf + first, kv->events, (size_t)(n - first) * sizeof *buf);
    kv->event_head = (kv->event_head + n) % kv->event_capacity;
    kv->event_count -= n;
    *count = n;
    *dropped = kv->events_dropped;
    kv->events_dropped = 0;
    return KVA_OK;
}

kva_status kva_kv_take_events(kva_kv *kv, kva_kv_event *buf, uint32_t capacity, uint32_t *count, uint64_t *dropped) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = take_events_locked(kv, buf, capacity, count, dropped);
    kv_unlock(kv);
    return st;
}
