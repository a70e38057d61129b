/*
 * fuzz_input.h — what the libFuzzer harnesses share: the input read as a stream of bytes (zeros
 * past its end, so every input decodes to some sequence of operations), and ORACLE, which
 * traps so that libFuzzer reports the input that broke an expectation.
 */
#ifndef KVA_FUZZ_INPUT_H
#define KVA_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>

typedef struct input {
    const uint8_t *data;
    size_t size, at;
} input;

static inline unsigned next_byte(input *in) { return in->at < in->size ? in->data[in->at++] : 0; }
static inline unsigned next_u16(input *in) { return next_byte(in) | next_byte(in) << 8; }

#define ORACLE(cond)                   \
    do {                               \
        if (!(cond)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
