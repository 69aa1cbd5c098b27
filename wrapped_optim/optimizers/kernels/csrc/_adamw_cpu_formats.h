/*
 * Part of _adamw_cpu.c (included there after its enums; not a header of its own): the bit
 * casts and the exact conversions between FP32 and each stored format, in integer bit
 * arithmetic and selects on 32-bit lanes so the loops that use them vectorize.
 */
static inline __attribute__((always_inline)) uint32_t f2u(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline __attribute__((always_inline)) float u2f(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    return u2f((uint32_t)h << 16);
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float x) {
    uint32_t u = f2u(x);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (x != x) ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

static inline __attribute__((always_inline)) float load(const void *base, int64_t i, int kind) {
    if (kind == KIND_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store(void *base, int64_t i, int kind, float x) {
    if (kind == KIND_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}


/* fp16 <-> FP32 bits, as torch's scalar conversions (c10's fp16_ieee_*): round to nearest
 * even, overflow to inf, NaN to the quiet NaN 0x7E00 with the sign kept. Integer selects only,
 * so the loops vectorize. */
static inline __attribute__((always_inline)) uint16_t f32_to_f16(float x) {
    uint32_t f = f2u(x);
    uint32_t a = f & 0x7FFFFFFFu;
    /* below 2^-14: the FP32 adder rounds into the subnormal (a magic-number add) */
    uint32_t small = f2u(u2f(a) + u2f(126u << 23)) - (126u << 23);
    uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    uint32_t o = u2f(a) < u2f(113u << 23) ? small : normal;
    o = o < 0x7C00u ? o : 0x7C00u; /* past the range (and inf): inf */
    o = x != x ? 0x7E00u : o;
    return (uint16_t)(o | ((f >> 16) & 0x8000u));
}

static inline __attribute__((always_inline)) float f16_to_f32(uint16_t h) {
    uint32_t o = ((uint32_t)h & 0x7FFFu) << 13;
    uint32_t exp = o & (0x7C00u << 13);
    uint32_t normal = o + ((uint32_t)(127 - 15) << 23);
    uint32_t special = normal + ((uint32_t)(128 - 16) << 23); /* inf, NaN */
    uint32_t sub = f2u(u2f(normal + (1u << 23)) - u2f(113u << 23)); /* exact */
    uint32_t r = exp == (0x7C00u << 13) ? special : (exp == 0 ? sub : normal);
    return u2f(r | (((uint32_t)h & 0x8000u) << 16));
}

/* FP8 E4M3 (no inf; 0x7F/0xFF are NaN), as c10's fp8e4m3fn_from_fp32_value of a value already
 * clamped to +-448 (codecs saturates before the cast, so only NaN lies beyond the range).
 * Every step is in 32-bit lanes (the byte is taken at the store), so the loop vectorizes. */
static inline __attribute__((always_inline)) uint8_t f32_to_e4m3(float x) {
    uint32_t f = f2u(x);
    uint32_t a = f & 0x7FFFFFFFu;
    /* below 2^-6 (subnormal): the FP32 adder rounds to a multiple of 2^-9 */
    uint32_t small = f2u(u2f(a) + u2f(141u << 23)) - (141u << 23);
    uint32_t normal = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    uint32_t o = u2f(a) < u2f(121u << 23) ? small : normal;
    o = x != x ? 0x7Fu : o;
    return (uint8_t)(o | ((f >> 24) & 0x80u));
}

static inline __attribute__((always_inline)) float e4m3_to_f32(uint8_t b) {
    uint32_t c = (uint32_t)b & 0x7Fu;
    uint32_t normal = (c << 20) + (120u << 23);
    /* exponent 0: (1 + m/8) * 2^-6 - 2^-6 = m * 2^-9, exact */
    float sub = u2f(normal + (1u << 23)) - u2f(121u << 23);
    float mag = c < 8u ? sub : u2f(normal);
    mag = c == 0x7Fu ? u2f(0x7FC00000u) : mag;
    return u2f(f2u(mag) | (((uint32_t)b & 0x80u) << 24));
}
