/*
 * version.c — what a binding asks before its first call: the version and the sizes of the
 * public structs it mirrors.
 */
#include "internal.h"

#define KVA_STR2(x) #x
#define KVA_STR(x) KVA_STR2(x)

const char *kva_version(void) {
    return KVA_STR(KVA_VERSION_MAJOR) "." KVA_STR(KVA_VERSION_MINOR) "." KVA_STR(KVA_VERSION_PATCH);
}

size_t kva_struct_size(kva_struct_id which) {
    switch (which) {
    case KVA_STRUCT_CONFIG: return sizeof(kva_config);
    case KVA_STRUCT_STATS: return sizeof(kva_stats);
    case KVA_STRUCT_CLASS_STATS: return sizeof(kva_class_stats);
    }
    return 0;
}
