/* Fused CPU kernels of fn, compiled on first use by fn/kernels/_cpu.py.
 *
 * Plain C99 (AVX-512/AVX2 intrinsics where available, else loops compilers vectorize); every
 * kernel works on an element range [begin, end). A call is a job of chunks: the calling thread
 * and helper threads each run fn_work, claiming chunks with an atomic counter; the caller then
 * waits (fn_wait) only for chunks already claimed, never for a helper that has not started yet.
 * It follows the canonical orders documented in fn/kernels/_reference.py (16 fp64 lanes per
 * 1024-element block for sums of squares), so its results are bit-identical to the reference.
 * Build flags must not include -ffast-math.
 */

#define _DEFAULT_SOURCE /* madvise */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 1024
#define LANES 16

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Reverses the bits inside each byte of a 64-bit word; stored little-endian (x86), byte b
   then holds elements 8b..8b+7, MSB first. */
static inline uint64_t reverse_bytes_bits(uint64_t w)
{
    w = ((w >> 1) & 0x5555555555555555ull) | ((w & 0x5555555555555555ull) << 1);
    w = ((w >> 2) & 0x3333333333333333ull) | ((w & 0x3333333333333333ull) << 2);
    return ((w >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((w & 0x0F0F0F0F0F0F0F0Full) << 4);
}

#if defined(__AVX2__)
/* The signs (x >= 0) of 32 floats as 4 packed bytes (a little-endian word), MSB first: the
   compare masks narrowed to bytes, then ordered so that movemask's bit 8b + 7 - j is element
   8b + j. */
static inline uint32_t signs32(__m256 v0, __m256 v1, __m256 v2, __m256 v3)
{
    const __m256 zero = _mm256_setzero_ps();
    /* packs interleave the 128-bit lanes: bytes 0-15 hold elements 0-3, 8-11, 16-19, 24-27,
       bytes 16-31 elements 4-7, 12-15, 20-23, 28-31; the permute pairs each 8 elements. */
    const __m256i order = _mm256_setr_epi8(11, 10, 9, 8, 3, 2, 1, 0, 15, 14, 13, 12, 7, 6, 5, 4,
                                           11, 10, 9, 8, 3, 2, 1, 0, 15, 14, 13, 12, 7, 6, 5, 4);
    __m256i c0 = _mm256_castps_si256(_mm256_cmp_ps(v0, zero, _CMP_GE_OQ));
    __m256i c1 = _mm256_castps_si256(_mm256_cmp_ps(v1, zero, _CMP_GE_OQ));
    __m256i c2 = _mm256_castps_si256(_mm256_cmp_ps(v2, zero, _CMP_GE_OQ));
    __m256i c3 = _mm256_castps_si256(_mm256_cmp_ps(v3, zero, _CMP_GE_OQ));
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    b = _mm256_permute4x64_epi64(b, _MM_SHUFFLE(3, 1, 2, 0));
    return (uint32_t)_mm256_movemask_epi8(_mm256_shuffle_epi8(b, order));
}
#endif

/* One full block: signs and the 16 lane sums (lane j adds x[j]^2, x[j+16]^2, ... in order).
   fma(d, d, acc) equals acc + d * d here: the square of an fp32 value is exact in fp64. */
static void sign_block_full(const float *x, uint8_t *bits, double *acc)
{
#if defined(__AVX512F__)
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int k = 0; k < BLOCK / LANES; k += 4) {
        /* 64 signs as one little-endian word (bit j = element j), bytes reversed below. */
        uint64_t word = 0;
        for (int t = 0; t < 4; t++) {
            __m512 v = _mm512_loadu_ps(x + (k + t) * LANES);
            word |= (uint64_t)_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ) << (16 * t);
            __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
            __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            __m512d d1 = _mm512_cvtps_pd(hi);
            a0 = _mm512_fmadd_pd(d0, d0, a0);
            a1 = _mm512_fmadd_pd(d1, d1, a1);
        }
        word = reverse_bytes_bits(word);
        memcpy(bits + 2 * k, &word, 8);
    }
    _mm512_storeu_pd(acc, a0);
    _mm512_storeu_pd(acc + 8, a1);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    for (int k = 0; k < BLOCK; k += 2 * LANES) {
        __m256 v[4];
        for (int t = 0; t < 4; t++)
            v[t] = _mm256_loadu_ps(x + k + 8 * t);
        /* The two cache lines 2 KiB ahead: with the sums of squares, this loop does enough
           work per line that at one thread too few misses are in flight for the hardware
           prefetchers alone (packbits, with less work per line, takes a tuned distance). */
        __builtin_prefetch(x + k + 512, 0, 3);
        __builtin_prefetch(x + k + 528, 0, 3);
        uint32_t word = signs32(v[0], v[1], v[2], v[3]);
        memcpy(bits + k / 8, &word, 4);
        /* Converted straight from memory: vextractf128 would compete with the packs and
           shuffles for the same ports. a[2 (t % 2)], a[2 (t % 2) + 1]: lanes 8 (t % 2) + 0-7. */
        for (int t = 0; t < 4; t++) {
            __m256d d0 = _mm256_cvtps_pd(_mm_loadu_ps(x + k + 8 * t));
            __m256d d1 = _mm256_cvtps_pd(_mm_loadu_ps(x + k + 8 * t + 4));
            a[2 * (t % 2)] = _mm256_fmadd_pd(d0, d0, a[2 * (t % 2)]);
            a[2 * (t % 2) + 1] = _mm256_fmadd_pd(d1, d1, a[2 * (t % 2) + 1]);
        }
    }
    for (int i = 0; i < 4; i++)
        _mm256_storeu_pd(acc + 4 * i, a[i]);
#else
    for (int j = 0; j < LANES; j++)
        acc[j] = 0.0;
    for (int k = 0; k < BLOCK / LANES; k++) {
        const float *p = x + k * LANES;
        for (int j = 0; j < LANES; j++) {
            double d = p[j];
            acc[j] += d * d;
        }
        for (int h = 0; h < LANES / 8; h++) {
            uint32_t b = 0;
            for (int j = 0; j < 8; j++)
                b |= (uint32_t)(p[h * 8 + j] >= 0.0f) << (7 - j);
            bits[k * (LANES / 8) + h] = (uint8_t)b;
        }
    }
#endif
}

/* Signs (bit 1 for x >= 0, MSB first) and the canonical sum of squares of one block. */
static void sign_block(const float *x, int64_t len, uint8_t *bits, double *block_sum)
{
    double acc[LANES] = {0};
    if (len == BLOCK) {
        sign_block_full(x, bits, acc);
    } else {
        for (int64_t i = 0; i < len; i++) {
            double d = x[i];
            acc[i % LANES] += d * d;
        }
        for (int64_t i = 0; i < (len + 7) / 8; i++) {
            uint32_t b = 0;
            for (int j = 0; j < 8; j++) {
                int64_t idx = i * 8 + j;
                if (idx < len)
                    b |= (uint32_t)(x[idx] >= 0.0f) << (7 - j);
            }
            bits[i] = (uint8_t)b;
        }
    }
    for (int h = LANES / 2; h > 0; h /= 2)
        for (int j = 0; j < h; j++)
            acc[j] += acc[j + h];
    *block_sum = acc[0];
}

/* v <- v - scale * sign(v), sign(v) = +1 for v >= 0. */
static void fn_apply_error(float *v, float scale, int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++)
        v[i] = v[i] - (v[i] >= 0.0f ? scale : -scale);
}

/* Value i of rows of chunk packed signs scaled per row (fn_unpack_scaled's bits): the row's
   scale with the sign bit flipped where bit i is 0. */
static inline float scaled_sign(const uint8_t *packed, const float *scales, int64_t chunk,
                                int64_t i)
{
    uint32_t bits;
    memcpy(&bits, scales + i / chunk, 4);
    bits ^= (~(packed[i >> 3] >> (7 - (i & 7))) & 1u) << 31;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* ---- Error-compensated sign compression without full-size temporaries (1-bit allreduce) ----
   v = source + e, where the source is x zero-padded to e's length, or the momentum
   beta * m + (1 - beta) * g (two roundings, no fused multiply-add: built with
   -ffp-contract=off) with m read from x or from packed signs (scaled_sign), or the scaled sign
   sum of the W received chunks added in rank order (0 + row 0 + row 1 + ..., see
   fn.kernels.sum_ranks). Phase 1 writes the signs of v and the block sums of squares; phase 2
   (after the caller's checks) recomputes v and writes e' = v - scale * s(v) into out, which
   may be e itself. */

enum { FEEDBACK_X, FEEDBACK_MOMENTUM, FEEDBACK_SIGN_SUM, FEEDBACK_SIGNED_MOMENTUM };

typedef struct {
    int64_t mode, n;       /* n: valid elements of x (and g); the rest is zero padding */
    const float *x, *g;
    const void *e; /* fp32, or bf16 with e_bf16 */
    float beta, one_minus_beta;
    /* FEEDBACK_SIGN_SUM: [ranks, row_bytes] packed signs, summed with the weights [ranks];
       FEEDBACK_SIGNED_MOMENTUM: m's rows (scaled_sign, chunk = 8 row_bytes), the weights the
       rows' scales. */
    const uint8_t *signs;
    const float *weights;
    int64_t ranks, row_bytes;
    int64_t ahead; /* elements: how far ahead of the loads the input streams are prefetched */
    int64_t e_bf16;
} fn_feedback;

/* The float of bf16 bits (exact). */
static inline float bf16_value(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* x rounded to bf16 as torch rounds (to nearest, ties to even; NaN: 0x7FC0). */
static inline uint16_t bf16_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if (x != x)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of f's error, as fp32. */
static inline float error_value(const fn_feedback *f, int64_t i)
{
    if (f->e_bf16)
        return bf16_value(((const uint16_t *)f->e)[i]);
    return ((const float *)f->e)[i];
}

/* Adds row t's signed weights for the columns [off, off + len) to acc (off, len: multiples of 8
   but for the last block). */
static void add_signed_row(const fn_feedback *f, int64_t t, int64_t off, int64_t len, float *acc)
{
    const uint8_t *row = f->signs + t * f->row_bytes + off / 8;
    const float w = f->weights[t], nw = -w;
    for (int64_t b = 0; b < len / 8; b++) {
        uint32_t byte = row[b];
        for (int j = 0; j < 8; j++)
            acc[8 * b + j] += ((byte >> (7 - j)) & 1u) ? w : nw;
    }
    for (int64_t i = len / 8 * 8; i < len; i++)
        acc[i] += ((row[i >> 3] >> (7 - (i & 7))) & 1u) ? w : nw;
}

/* The sign sum of the columns [off, off + len) into out (len <= BLOCK): the rows added in
   rank order, from zero. */
static void sign_sum_columns(const fn_feedback *f, int64_t off, int64_t len, float *out)
{
    memset(out, 0, (size_t)len * sizeof(float));
    for (int64_t t = 0; t < f->ranks; t++)
        add_signed_row(f, t, off, len, out);
}

#if defined(__AVX2__)
/* Adds row t's signed weights (w where the bit is set, else -w) for the 32 columns of the 4
   bytes from `byte` on to acc: lane j of vector g takes bit 8 g + 7 - j of the bytes read as a
   little-endian word, shifted into the sign bit that blendv selects by. */
static inline void add_signed_row32(const fn_feedback *f, int64_t t, int64_t byte, __m256 *acc)
{
    uint32_t word;
    memcpy(&word, f->signs + t * f->row_bytes + byte, 4);
    __m256i bits = _mm256_set1_epi32((int)word);
    __m256 w = _mm256_set1_ps(f->weights[t]);
    __m256 nw = _mm256_xor_ps(w, _mm256_set1_ps(-0.0f));
    for (int g = 0; g < 4; g++) {
        __m256i shift = _mm256_setr_epi32(24 - 8 * g, 25 - 8 * g, 26 - 8 * g, 27 - 8 * g,
                                          28 - 8 * g, 29 - 8 * g, 30 - 8 * g, 31 - 8 * g);
        __m256 set = _mm256_castsi256_ps(_mm256_sllv_epi32(bits, shift));
        acc[g] = _mm256_add_ps(acc[g], _mm256_blendv_ps(nw, w, set));
    }
}

/* sign_sum_columns for the 32 columns from byte `byte` on into sum, in registers. */
static inline void sign_sum_registers(const fn_feedback *f, int64_t byte, __m256 *sum)
{
    for (int g = 0; g < 4; g++)
        sum[g] = _mm256_setzero_ps();
    for (int64_t t = 0; t < f->ranks; t++)
        add_signed_row32(f, t, byte, sum);
}
#endif

/* The sign sum of the columns [off, off + len) into out, in rank order. */
static void sign_sum_block(const fn_feedback *f, int64_t off, int64_t len, float *out)
{
    int64_t done = 0;
#if defined(__AVX2__)
    for (; done + 32 <= len; done += 32) {
        __m256 sum[4];
        sign_sum_registers(f, (off + done) / 8, sum);
        for (int g = 0; g < 4; g++)
            _mm256_storeu_ps(out + done + 8 * g, sum[g]);
    }
#endif
    if (done < len)
        sign_sum_columns(f, off + done, len - done, out + done);
}

/* v = source + e for the elements [off, off + len) (len <= BLOCK): the source, then e added
   (each fp32 operation rounded as in one expression). */
static void feedback_values(const fn_feedback *f, int64_t off, int64_t len, float *v)
{
    int64_t valid = f->n - off < 0 ? 0 : min64(len, f->n - off);
    if (f->mode == FEEDBACK_SIGN_SUM) {
        sign_sum_block(f, off, len, v);
        valid = len;
    } else if (f->mode == FEEDBACK_MOMENTUM) {
        const float *m = f->x + off, *g = f->g + off, b = f->beta, c = f->one_minus_beta;
        for (int64_t i = 0; i < valid; i++)
            v[i] = b * m[i] + c * g[i];
    } else if (f->mode == FEEDBACK_SIGNED_MOMENTUM) {
        const float *g = f->g + off, b = f->beta, c = f->one_minus_beta;
        const int64_t chunk = 8 * f->row_bytes;
        for (int64_t i = 0; i < valid; i++)
            v[i] = b * scaled_sign(f->signs, f->weights, chunk, off + i) + c * g[i];
    } else {
        memcpy(v, f->x + off, (size_t)valid * sizeof(float));
    }
    for (int64_t i = valid; i < len; i++)
        v[i] = 0.0f;
    if (f->e_bf16) {
        for (int64_t i = 0; i < len; i++)
            v[i] = v[i] + error_value(f, off + i);
    } else {
        const float *e = (const float *)f->e + off;
        for (int64_t i = 0; i < len; i++)
            v[i] = v[i] + e[i];
    }
}

#if defined(__AVX2__) && defined(__FMA__)

/* Whether the block at off is computed in registers (the fused paths below): a full block of
   x or momentum values, or of sign sums. */
static inline int feedback_fused(const fn_feedback *f, int64_t off, int64_t len)
{
    return len == BLOCK && (f->mode == FEEDBACK_SIGN_SUM || off + BLOCK <= f->n);
}

/* The two cache lines of 32 floats at p + ahead. */
static inline void prefetch_ahead(const float *p, int64_t ahead)
{
    _mm_prefetch((const char *)(p + ahead), _MM_HINT_T0);
    _mm_prefetch((const char *)(p + ahead + 16), _MM_HINT_T0);
}

/* The 8 error values from i on, as fp32. */
static inline __m256 error_values8(const fn_feedback *f, int64_t i)
{
    if (!f->e_bf16)
        return _mm256_loadu_ps((const float *)f->e + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)f->e + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Prefetches the error's 32 values `ahead` elements after i (two cache lines of fp32, one of
   bf16). */
static inline void prefetch_error(const fn_feedback *f, int64_t i, int64_t ahead)
{
    if (f->e_bf16)
        _mm_prefetch((const char *)((const uint16_t *)f->e + i + ahead), _MM_HINT_T0);
    else
        prefetch_ahead((const float *)f->e + i, ahead);
}

/* feedback_values of the 32 signed-momentum elements from i on (i a multiple of 32), in
   registers: m from 4 bytes of signs read as a little-endian word, lane j of vector t taking
   bit 8 t + 7 - j shifted into the sign bit (as add_signed_row32), each 8 values scaled by
   their row's scale (rows of whole bytes: a row changes inside the 32 only for short rows). */
static inline void signed_momentum_values32(const fn_feedback *f, int64_t i, __m256 *v)
{
    const uint64_t chunk = 8 * (uint64_t)f->row_bytes;
    const float *g = f->g + i;
    const __m256 b = _mm256_set1_ps(f->beta), c = _mm256_set1_ps(f->one_minus_beta);
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    if (f->ahead) /* e: by feedback_values32 */
        prefetch_ahead(g, f->ahead);
    uint32_t word;
    memcpy(&word, f->signs + (i >> 3), 4);
    const __m256i bits = _mm256_set1_epi32((int)word);
    uint64_t row = (uint64_t)i / chunk, next = (row + 1) * chunk;
    int32_t s;
    memcpy(&s, f->weights + row, 4);
    __m256i scale = _mm256_set1_epi32(s);
    for (int t = 0; t < 4; t++) {
        if ((uint64_t)i + 8 * t >= next) {
            row = ((uint64_t)i + 8 * t) / chunk;
            next = (row + 1) * chunk;
            memcpy(&s, f->weights + row, 4);
            scale = _mm256_set1_epi32(s);
        }
        __m256i shift = _mm256_setr_epi32(24 - 8 * t, 25 - 8 * t, 26 - 8 * t, 27 - 8 * t,
                                          28 - 8 * t, 29 - 8 * t, 30 - 8 * t, 31 - 8 * t);
        __m256i flip = _mm256_andnot_si256(_mm256_sllv_epi32(bits, shift), sign);
        __m256 m = _mm256_castsi256_ps(_mm256_xor_si256(scale, flip));
        m = _mm256_add_ps(_mm256_mul_ps(b, m), _mm256_mul_ps(c, _mm256_loadu_ps(g + 8 * t)));
        v[t] = _mm256_add_ps(m, error_values8(f, i + 8 * t));
    }
}

/* feedback_values of the 32 elements from i on, in registers (the same fp32 operations). */
static inline void feedback_values32(const fn_feedback *f, int64_t i, __m256 *v)
{
    const int64_t ahead = f->ahead; /* 0: the hardware prefetchers alone */
    if (ahead)
        prefetch_error(f, i, ahead);
    if (f->mode == FEEDBACK_SIGN_SUM) {
        sign_sum_registers(f, i / 8, v);
        for (int t = 0; t < 4; t++)
            v[t] = _mm256_add_ps(v[t], error_values8(f, i + 8 * t));
        return;
    }
    if (f->mode == FEEDBACK_SIGNED_MOMENTUM) {
        signed_momentum_values32(f, i, v);
        return;
    }
    const float *x = f->x + i;
    if (ahead)
        prefetch_ahead(x, ahead);
    if (f->mode == FEEDBACK_MOMENTUM) {
        const float *g = f->g + i;
        const __m256 b = _mm256_set1_ps(f->beta), c = _mm256_set1_ps(f->one_minus_beta);
        if (ahead)
            prefetch_ahead(g, ahead);
        for (int t = 0; t < 4; t++) {
            __m256 m = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(x + 8 * t)),
                                     _mm256_mul_ps(c, _mm256_loadu_ps(g + 8 * t)));
            v[t] = _mm256_add_ps(m, error_values8(f, i + 8 * t));
        }
    } else {
        for (int t = 0; t < 4; t++)
            v[t] = _mm256_add_ps(_mm256_loadu_ps(x + 8 * t), error_values8(f, i + 8 * t));
    }
}

/* sign_block of a fused block, v computed in registers: the same signs and lane sums; v is
   also stored to v_out + off when v_out is given. */
static void feedback_sign_block(const fn_feedback *f, int64_t off, uint8_t *bits,
                                double *block_sum, float *v_out)
{
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    for (int k = 0; k < BLOCK; k += 2 * LANES) {
        __m256 v[4];
        feedback_values32(f, off + k, v);
        if (v_out)
            for (int t = 0; t < 4; t++)
                _mm256_storeu_ps(v_out + off + k + 8 * t, v[t]);
        uint32_t word = signs32(v[0], v[1], v[2], v[3]);
        memcpy(bits + k / 8, &word, 4);
        for (int t = 0; t < 4; t++) {
            __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v[t]));
            __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v[t], 1));
            a[2 * (t % 2)] = _mm256_fmadd_pd(d0, d0, a[2 * (t % 2)]);
            a[2 * (t % 2) + 1] = _mm256_fmadd_pd(d1, d1, a[2 * (t % 2) + 1]);
        }
    }
    double acc[LANES];
    for (int i = 0; i < 4; i++)
        _mm256_storeu_pd(acc + 4 * i, a[i]);
    for (int h = LANES / 2; h > 0; h /= 2)
        for (int j = 0; j < h; j++)
            acc[j] += acc[j + h];
    *block_sum = acc[0];
}
#endif

/* v = m (+ e): packed signs of v and per-block sums of squares; v is written to v_out when
   e is given (the error pass then turns it into the new error in place). */
static void fn_sign_compress(const float *m, const float *e, float *v_out, int64_t ahead,
                             int64_t begin, int64_t end, uint8_t *bits, double *block_sums)
{
    /* begin is a multiple of BLOCK; end is one too, or the total length. */
    for (int64_t b = begin / BLOCK; b < (end + BLOCK - 1) / BLOCK; b++) {
        int64_t off = b * BLOCK, len = min64(BLOCK, end - off);
        const float *x = m + off;
#if defined(__AVX2__) && defined(__FMA__)
        if (e && len == BLOCK) {
            fn_feedback f = {FEEDBACK_X, end, m, NULL, e};
            f.ahead = ahead;
            feedback_sign_block(&f, off, bits + off / 8, block_sums + b, v_out);
            continue;
        }
#endif
        if (e) {
            float *v = v_out + off;
            for (int64_t i = 0; i < len; i++)
                v[i] = m[off + i] + e[off + i];
            x = v;
        }
        sign_block(x, len, bits + off / 8, block_sums + b);
    }
}

/* Phase 1: packed signs of v and its block sums of squares (begin: a multiple of BLOCK). */
static void fn_feedback_signs(const fn_feedback *f, uint8_t *bits, double *block_sums,
                              int64_t begin, int64_t end)
{
    float v[BLOCK];
    for (int64_t b = begin / BLOCK; b < (end + BLOCK - 1) / BLOCK; b++) {
        int64_t off = b * BLOCK, len = min64(BLOCK, end - off);
#if defined(__AVX2__) && defined(__FMA__)
        if (feedback_fused(f, off, len)) {
            feedback_sign_block(f, off, bits + off / 8, block_sums + b, NULL);
            continue;
        }
#endif
        feedback_values(f, off, len, v);
        sign_block(v, len, bits + off / 8, block_sums + b);
    }
}

#if defined(__AVX2__)
/* The 8 values y rounded to bf16 as bf16_bits, stored at o. */
static inline void store_bf16x8(uint16_t *o, __m256 y)
{
    __m256i u = _mm256_castps_si256(y);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    /* packus interleaves the 128-bit lanes: the permute puts the 8 halves in order */
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(r));
}
#endif

/* Phase 2: out = v - scale * s(v) (begin: a multiple of BLOCK), fp32 or, with out_bf16,
   rounded once to bf16. With stream, a 32-byte aligned fp32 out is written with non-temporal
   stores (no read of its lines into the cache). */
static void fn_feedback_error(const fn_feedback *f, float scale, void *out_bytes, int stream,
                              int out_bf16, int64_t begin, int64_t end)
{
    float v[BLOCK], *out = out_bytes;
    uint16_t *out16 = out_bytes;
#if defined(__AVX2__)
    stream = stream && !out_bf16 && ((uintptr_t)out & 31) == 0;
    const __m256 zero = _mm256_setzero_ps(), up = _mm256_set1_ps(scale);
    const __m256 down = _mm256_set1_ps(-scale);
#endif
    for (int64_t b = begin / BLOCK; b < (end + BLOCK - 1) / BLOCK; b++) {
        int64_t off = b * BLOCK, len = min64(BLOCK, end - off), i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if (feedback_fused(f, off, len)) {
            /* v in registers; out may be e itself: each vector is read before it is written */
            for (; i < BLOCK; i += 32) {
                __m256 x[4];
                feedback_values32(f, off + i, x);
                for (int t = 0; t < 4; t++) {
                    __m256 s = _mm256_blendv_ps(down, up, _mm256_cmp_ps(x[t], zero, _CMP_GE_OQ));
                    __m256 y = _mm256_sub_ps(x[t], s);
                    if (out_bf16)
                        store_bf16x8(out16 + off + i + 8 * t, y);
                    else if (stream)
                        _mm256_stream_ps(out + off + i + 8 * t, y);
                    else
                        _mm256_storeu_ps(out + off + i + 8 * t, y);
                }
            }
            continue;
        }
#endif
        feedback_values(f, off, len, v);
#if defined(__AVX2__)
        if (stream) {
            for (; i + 8 <= len; i += 8) {
                __m256 x = _mm256_loadu_ps(v + i);
                __m256 s = _mm256_blendv_ps(down, up, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
                _mm256_stream_ps(out + off + i, _mm256_sub_ps(x, s));
            }
        }
#endif
        for (; i < len; i++) {
            float y = v[i] - (v[i] >= 0.0f ? scale : -scale);
            if (out_bf16)
                out16[off + i] = bf16_bits(y);
            else
                out[off + i] = y;
        }
    }
#if defined(__AVX2__)
    if (stream)
        _mm_sfence();
#endif
}

/* out[k] = +-scales[k / chunk] by sign bit k of packed (rows of chunk bits, chunk % 8 == 0):
   the scale's bits with the sign bit flipped where the bit is 0 (-0.0 for a zero scale, as
   -1.0f * 0.0f); integer operations, which vectorize. begin is a multiple of 8. With stream,
   the 32-byte aligned groups of 8 are written with non-temporal stores. */
static void fn_unpack_scaled(const uint8_t *packed, const float *scales, int64_t chunk,
                             float *out, int stream, int64_t begin, int64_t end)
{
    int64_t k = begin;
    uint32_t *o = (uint32_t *)out;
#if defined(__AVX2__)
    stream = stream && ((uintptr_t)out & 31) == 0; /* k is a multiple of 8: o + k stays aligned */
#endif
    while (k < end) {
        int64_t row = k / chunk, stop = min64(end, (row + 1) * chunk);
        uint32_t s;
        memcpy(&s, scales + row, 4);
        const uint8_t *bytes = packed + k / 8;
        int64_t whole = (stop - k) / 8, b = 0;
#if defined(__AVX2__)
        const __m256i weights = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
        const __m256i value = _mm256_set1_epi32((int)s);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        for (; b < whole; b++) {
            __m256i bit = _mm256_and_si256(_mm256_set1_epi32(bytes[b]), weights);
            __m256i clear = _mm256_cmpeq_epi32(bit, _mm256_setzero_si256());
            __m256i v = _mm256_xor_si256(value, _mm256_and_si256(clear, sign));
            if (stream)
                _mm256_stream_si256((__m256i *)(o + k + 8 * b), v);
            else
                _mm256_storeu_si256((__m256i *)(o + k + 8 * b), v);
        }
#endif
        for (; b < whole; b++) {
            uint32_t byte = bytes[b];
            for (int j = 0; j < 8; j++)
                o[k + 8 * b + j] = s ^ ((~(byte >> (7 - j)) & 1u) << 31);
        }
        for (k += 8 * whole; k < stop; k++)
            o[k] = s ^ ((~(packed[k >> 3] >> (7 - (k & 7))) & 1u) << 31);
    }
#if defined(__AVX2__)
    if (stream)
        _mm_sfence();
#endif
}

/* The new momentum of a compressed step as the packed signs it arrives as (see
   fn_unpack_scaled): fn_adam_apply writes its values into m, instead of reading m. */
typedef struct {
    const uint8_t *packed;
    const float *scales;
    int64_t chunk, stream;
    float *m;
} fn_signed_momentum;

static void fn_adam_apply(const float *m, const fn_signed_momentum *signed_m, const float *v,
                          const float *k, int clamp, int decay, float neg_eta, float *p,
                          int64_t begin, int64_t end);

/* out = sqrt(v) correctly rounded: the instruction is IEEE 754's square root (sqrtps, sqrtf). */
static void fn_sqrt_rn(const float *v, float *out, int64_t begin, int64_t end)
{
    int64_t i = begin;
#if defined(__AVX512F__)
    for (; i + 16 <= end; i += 16)
        _mm512_storeu_ps(out + i, _mm512_sqrt_ps(_mm512_loadu_ps(v + i)));
#elif defined(__AVX2__)
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(out + i, _mm256_sqrt_ps(_mm256_loadu_ps(v + i)));
#endif
    for (; i < end; i++)
        out[i] = sqrtf(v[i]);
}

/* The Adam direction of the 1-bit family's compressed update, rounded as the torch rule:
   out = ((m / (sqrt(v) + eps)) clamped to [-bound, bound] (+ wd * p)) * neg_eta, sqrt correctly
   rounded (sqrtps / sqrtf). flags: 1 clamps; 2 adds the direction to out instead (out the
   params, p NULL or out); 4 (with 2) takes m as a fn_signed_momentum, whose values it writes. */
static void fn_adam_direction(const float *m, const float *v, const float *p, const float *k,
                              int flags, float neg_eta, float *out, int64_t begin, int64_t end)
{
    const float eps = k[0], bound = k[1], wd = k[2];
    const int clamp = flags & 1;
    if (flags & 2) {
        const fn_signed_momentum *signed_m = flags & 4 ? (const void *)m : NULL;
        fn_adam_apply(signed_m ? NULL : m, signed_m, v, k, clamp, p != NULL, neg_eta, out, begin,
                      end);
        return;
    }
    for (int64_t i = begin; i < end; i++) {
        float u = m[i] / (sqrtf(v[i]) + eps);
        if (clamp)
            u = u < -bound ? -bound : (u > bound ? bound : u); /* NaN stays NaN */
        if (p)
            u = u + wd * p[i];
        out[i] = u * neg_eta;
    }
}

/* begin is a multiple of 8; end is one too, or the total length. ahead: elements from the
   loads on that are prefetched (0: none). */
static void fn_packbits(const float *x, uint8_t *bits, int64_t ahead, int64_t begin,
                        int64_t end)
{
    int64_t full = end / 8, i = begin / 8;
#if defined(__AVX512F__)
    for (; i + 8 <= full; i += 8) {
        if (ahead)
            for (int t = 0; t < 4; t++)
                _mm_prefetch((const char *)(x + 8 * i + ahead + 16 * t), _MM_HINT_T0);
        uint64_t word = 0;
        for (int t = 0; t < 4; t++) {
            __m512 v = _mm512_loadu_ps(x + 8 * i + 16 * t);
            word |= (uint64_t)_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ) << (16 * t);
        }
        word = reverse_bytes_bits(word);
        memcpy(bits + i, &word, 8);
    }
#elif defined(__AVX2__)
    for (; i + 4 <= full; i += 4) {
        const float *p = x + 8 * i;
        if (ahead)
            for (int t = 0; t < 2; t++)
                _mm_prefetch((const char *)(p + ahead + 16 * t), _MM_HINT_T0);
        uint32_t word = signs32(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8),
                                _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24));
        memcpy(bits + i, &word, 4);
    }
#endif
    for (; i < full; i++) {
        const float *p = x + i * 8;
        uint32_t b = 0;
        for (int j = 0; j < 8; j++)
            b |= (uint32_t)(p[j] >= 0.0f) << (7 - j);
        bits[i] = (uint8_t)b;
    }
    if (end % 8) {
        uint32_t b = 0;
        for (int64_t idx = full * 8; idx < end; idx++)
            b |= (uint32_t)(x[idx] >= 0.0f) << (7 - (idx - full * 8));
        bits[full] = (uint8_t)b;
    }
}

/* out[k] = +-1 by bit k: one row of unpack_scaled with the scale 1 (begin: a multiple of 8). */
static void fn_unpackbits(const uint8_t *bits, float *out, int stream, int64_t begin, int64_t end)
{
    const float one = 1.0f;
    fn_unpack_scaled(bits, &one, INT64_MAX, out, stream, begin, end);
}

/* Element i of a group: x[i] for i < nx, else zero padding; plus e[i] when e is given
   (LoCo's v = x + e, added in fp32 as torch does). */
static inline float group_value(const float *x, const float *e, int64_t nx, int64_t i)
{
    float v = i < nx ? x[i] : 0.0f;
    return e ? v + e[i] : v;
}

#if defined(__AVX2__)
/* group_value of the 8 elements i..i+7 (i + 8 <= the group's length). */
static inline __m256 group_values8(const float *x, const float *e, int64_t nx, int64_t i)
{
    __m256 v;
    if (i + 8 <= nx) {
        v = _mm256_loadu_ps(x + i);
    } else {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        int32_t have = nx - i > 0 ? (int32_t)(nx - i) : 0;
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(have), lane);
        v = _mm256_maskload_ps(have ? x + i : x, mask); /* masked-off lanes read as zero */
    }
    return e ? _mm256_add_ps(v, _mm256_loadu_ps(e + i)) : v;
}

/* The codes rint(v / div) clamped to [lo, hi] of the 32 elements i..i+31 as int8, in order:
   the conversion rounds to nearest even as rintf does; the clamp comes after the saturating
   narrowing to int8, which leaves a clamp to bounds inside int8's range unchanged. */
static inline __m256i codes32(const float *x, const float *e, int64_t nx, int64_t i, __m256 div,
                              __m256i lo, __m256i hi)
{
    __m256i c[4];
    for (int k = 0; k < 4; k++)
        c[k] = _mm256_cvtps_epi32(_mm256_div_ps(group_values8(x, e, nx, i + 8 * k), div));
    /* packs interleave the 128-bit lanes as in signs32; the permute restores element order. */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    b = _mm256_min_epi8(_mm256_max_epi8(b, lo), hi);
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

/* Symmetric blockwise quantization of one group: value i is group_value(x, e, nx, i) (len
   values count, the rest are zero padding); a group containing NaN/Inf gets a NaN scale and
   zero codes. */
static void quantize_group(const float *x, const float *e, int64_t nx, int64_t len,
                           int64_t group_size, int nbits, uint8_t *q, float *scale_out)
{
    const float qmax = (float)(1 << (nbits - 1));
    /* |x| ordered as floats is ordered as its bit pattern (NaN > Inf > finite): an integer
       max, which vectorizes without reassociating float operations. */
    uint32_t top = 0;
    int64_t i = 0;
#if defined(__AVX2__)
    __m256i top8 = _mm256_setzero_si256();
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    for (; i + 8 <= len; i += 8) {
        __m256i u = _mm256_castps_si256(group_values8(x, e, nx, i));
        top8 = _mm256_max_epu32(top8, _mm256_and_si256(u, magnitude));
    }
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, top8);
    for (int k = 0; k < 8; k++)
        top = lanes[k] > top ? lanes[k] : top;
#endif
    for (; i < len; i++) {
        float v = group_value(x, e, nx, i);
        uint32_t u;
        memcpy(&u, &v, 4);
        u &= 0x7FFFFFFFu;
        top = u > top ? u : top;
    }
    int finite = top < 0x7F800000u;
    float absmax;
    memcpy(&absmax, &top, 4);
    float scale = absmax / qmax; /* inf for a group with an Inf, NaN with a NaN: the reference's */
    *scale_out = scale;
    float div = scale > 0.0f ? scale : 1.0f;
    int64_t i0 = 0;
#if defined(__AVX2__)
    if (finite) {
        const __m256 divs = _mm256_set1_ps(div);
        const __m256i lo = _mm256_set1_epi8((char)-(1 << (nbits - 1)));
        const __m256i hi = _mm256_set1_epi8((char)((1 << (nbits - 1)) - 1));
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i weights = _mm256_set1_epi16(0x0110); /* bytes (16, 1): hi * 16 + lo */
        /* The next group (its usual place: group_size values on) is prefetched while this
           one, already in L1 from the max pass, is coded: the memory stream keeps going. */
        const uintptr_t ahead = (uintptr_t)group_size * sizeof(float);
        for (; i0 + 64 <= len; i0 += 64) {
            for (int k = 0; k < 256; k += 64) {
                _mm_prefetch((const char *)((uintptr_t)(x + i0) + ahead + k), _MM_HINT_T0);
                if (e)
                    _mm_prefetch((const char *)((uintptr_t)(e + i0) + ahead + k), _MM_HINT_T0);
            }
            __m256i a = codes32(x, e, nx, i0, divs, lo, hi);
            __m256i b = codes32(x, e, nx, i0 + 32, divs, lo, hi);
            if (nbits == 8) {
                _mm256_storeu_si256((__m256i *)(q + i0), a);
                _mm256_storeu_si256((__m256i *)(q + i0 + 32), b);
                continue;
            }
            __m256i pa = _mm256_maddubs_epi16(_mm256_and_si256(a, nibble), weights);
            __m256i pb = _mm256_maddubs_epi16(_mm256_and_si256(b, nibble), weights);
            __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(pa, pb),
                                                 _MM_SHUFFLE(3, 1, 2, 0));
            _mm256_storeu_si256((__m256i *)(q + i0 / 2), p);
        }
    }
#endif
    for (; i0 < group_size; i0 += 256) {
        int8_t c[256];
        int64_t m = min64(256, group_size - i0);
        int64_t valid = finite ? (len - i0 < 0 ? 0 : min64(m, len - i0)) : 0;
        for (int64_t k = 0; k < valid; k++) {
            float r = rintf(group_value(x, e, nx, i0 + k) / div);
            r = r < -qmax ? -qmax : r;
            r = r > qmax - 1.0f ? qmax - 1.0f : r;
            c[k] = (int8_t)(int32_t)r;
        }
        for (int64_t k = valid; k < m; k++)
            c[k] = 0;
        if (nbits == 8) {
            for (int64_t k = 0; k < m; k++)
                q[i0 + k] = (uint8_t)c[k];
        } else {
            for (int64_t k = 0; k < m / 2; k++)
                q[i0 / 2 + k] = (uint8_t)(((c[2 * k] & 0xF) << 4) | (c[2 * k + 1] & 0xF));
        }
    }
}

/* begin is a multiple of group_size; end is one too, or the total length. */
static void fn_quantize(const float *x, int nbits, int64_t group_size, uint8_t *q,
                        float *scales, int64_t begin, int64_t end)
{
    for (int64_t g = begin / group_size; g < (end + group_size - 1) / group_size; g++) {
        int64_t off = g * group_size;
        int64_t len = min64(group_size, end - off);
        quantize_group(x + off, NULL, len, len, group_size, nbits, q + off * nbits / 8,
                       scales + g);
    }
}

#if defined(__AVX2__)
/* 32 4-bit codes (16 bytes, high nibble first) as 32 int8 values in order. */
static inline __m256i nibbles32(const uint8_t *q)
{
    /* 4-bit two's complement by table: 0..7, then -8..-1 */
    const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1,
                                           0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4), lo = _mm_and_si128(b, low4);
    __m256i n = _mm256_set_m128i(_mm_unpackhi_epi8(hi, lo), _mm_unpacklo_epi8(hi, lo));
    return _mm256_shuffle_epi8(table, n);
}

/* (float)code * s of 32 int8 codes into out[0..31], or added to it (add == 1), or streamed
   to it (add == 2: non-temporal stores, out 32-byte aligned). */
static inline void scaled32(__m256i c, __m256 s, float *out, int add)
{
    __m128i h[2] = {_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)};
    for (int k = 0; k < 2; k++) {
        __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h[k]));
        __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h[k], 8)));
        a = _mm256_mul_ps(a, s);
        b = _mm256_mul_ps(b, s);
        if (add == 2) {
            _mm256_stream_ps(out + 16 * k, a);
            _mm256_stream_ps(out + 16 * k + 8, b);
            continue;
        }
        if (add) {
            a = _mm256_add_ps(_mm256_loadu_ps(out + 16 * k), a);
            b = _mm256_add_ps(_mm256_loadu_ps(out + 16 * k + 8), b);
        }
        _mm256_storeu_ps(out + 16 * k, a);
        _mm256_storeu_ps(out + 16 * k + 8, b);
    }
}
#endif

static inline void put(float *dst, float v, int add) { *dst = add == 1 ? *dst + v : v; }

/* dst[i - begin] = DQ(q)[i] for i in [begin, end), or dst[i - begin] += DQ(q)[i] (add == 1),
   or = with non-temporal stores of whole vectors (add == 2: dst + i - begin 32-byte aligned
   at every group start; the caller fences), group by group: the scale is loaded once and the inner loops have no division or branch per
   element. Each value is (float)code * scale, as element by element. */
static inline void dequantize_range(const uint8_t *q, const float *scales, int nbits,
                                    int64_t group_size, int64_t begin, int64_t end, float *dst,
                                    int add)
{
    int64_t i = begin;
    while (i < end) {
        int64_t g = i / group_size;
        int64_t stop = min64(end, (g + 1) * group_size);
        const float s = scales[g];
        if (nbits == 8) {
#if defined(__AVX2__)
            for (; i + 32 <= stop; i += 32)
                scaled32(_mm256_loadu_si256((const __m256i *)(q + i)), _mm256_set1_ps(s),
                         dst + (i - begin), add);
#endif
            for (; i < stop; i++)
                put(dst + (i - begin), (float)(int8_t)q[i] * s, add);
            continue;
        }
        if ((i & 1) && i < stop) { /* a group that starts on a low nibble (odd group_size) */
            int32_t lo = q[i / 2] & 0xF;
            put(dst + (i - begin), (float)(lo - ((lo & 8) << 1)) * s, add);
            i++;
        }
#if defined(__AVX2__)
        for (; i + 32 <= stop; i += 32)
            scaled32(nibbles32(q + i / 2), _mm256_set1_ps(s), dst + (i - begin), add);
#endif
        const uint8_t *qb = q + i / 2;
        float *o = dst + (i - begin);
        int64_t pairs = (stop - i) / 2;
        for (int64_t k = 0; k < pairs; k++) {
            int32_t hi = qb[k] >> 4, lo = qb[k] & 0xF;
            put(o + 2 * k, (float)(hi - ((hi & 8) << 1)) * s, add); /* 4-bit two's complement */
            put(o + 2 * k + 1, (float)(lo - ((lo & 8) << 1)) * s, add);
        }
        i += 2 * pairs;
        if (i < stop) { /* the odd last value: a high nibble */
            int32_t hi = q[i / 2] >> 4;
            put(dst + (i - begin), (float)(hi - ((hi & 8) << 1)) * s, add);
            i++;
        }
    }
}

static void fn_dequantize(const uint8_t *q, const float *scales, int nbits, int64_t group_size,
                          float *out, int64_t begin, int64_t end)
{
    dequantize_range(q, scales, nbits, group_size, begin, end, out + begin, 0);
}

/* Where v's values come from: x holds R rows of `row` values; v's row j (padded with zeros to
   `prow`, a multiple of the group size) is x's row (j % nodes) * local + j / nodes, for
   R = nodes * local rows (one row: plain zero padding past the row). */
typedef struct {
    int64_t row, prow, nodes, local;
} rows_layout;

/* The x values of v from offset off (inside one padded row) on: *valid of them (maybe <= 0). */
static inline const float *row_source(const float *x, rows_layout l, int64_t off, int64_t *valid)
{
    int64_t j = off / l.prow, c = off % l.prow;
    *valid = l.row - c;
    return x + ((j % l.nodes) * l.local + j / l.nodes) * l.row + c;
}

/* LoCo phase 1: q, scales of Q(v), v = x laid out as above (+ e when given), whole groups over
   [begin, end) (begin, end multiples of group_size). */
static void fn_loco_quantize(const float *x, const float *e, rows_layout l, int nbits,
                             int64_t group_size, uint8_t *q, float *scales, int64_t begin,
                             int64_t end)
{
    for (int64_t off = begin; off < end; off += group_size) {
        int64_t valid;
        const float *src = row_source(x, l, off, &valid);
        quantize_group(src, e ? e + off : NULL, valid, group_size, group_size, nbits,
                       q + off * nbits / 8, scales + off / group_size);
    }
}

/* LoCo phase 2: out = (v - DQ(q)) * keep + beta * e with v as in phase 1 (e = 0 when not
   given, as a reset error is): torch's rounding order (three roundings, no fused multiply-add:
   -ffp-contract=off). out may be e itself (each element is read before it is written). */
static void fn_loco_error(const float *x, const float *e, rows_layout l, const uint8_t *q,
                          const float *scales, int nbits, int64_t group_size, float keep,
                          float beta, float *out, int64_t begin, int64_t end)
{
    float dq[256];
    int64_t i = begin;
    while (i < end) {
        int64_t stop = min64(end, min64(i + 256, (i / l.prow + 1) * l.prow)), valid;
        const float *src = row_source(x, l, i, &valid);
        dequantize_range(q, scales, nbits, group_size, i, stop, dq, 0);
        for (int64_t k = 0; k < stop - i; k++) {
            float ei = e ? e[i + k] : 0.0f;
            float v = (k < valid ? src[k] : 0.0f) + ei;
            float r = v - dq[k];
            float a = r * keep;
            float b = beta * ei;
            out[i + k] = a + b;
        }
        i = stop;
    }
}

#define SUM_TILE 256

/* out[i] = sum over the `pieces` rows of DQ(row)[i], rows of `cols` values (whole groups) in
   one buffer, added in rank order from zero (0 + row 0 + row 1 + ..., fn.kernels.sum_ranks). */
static void fn_dequantize_sum(const uint8_t *q, const float *scales, int nbits,
                              int64_t group_size, int64_t pieces, int64_t cols, float *out,
                              int64_t begin, int64_t end)
{
    float acc[SUM_TILE];
    for (int64_t t0 = begin; t0 < end; t0 += SUM_TILE) {
        int64_t len = min64(SUM_TILE, end - t0);
        memset(acc, 0, (size_t)len * sizeof(float));
        for (int64_t r = 0; r < pieces; r++)
            dequantize_range(q, scales, nbits, group_size, r * cols + t0, r * cols + t0 + len,
                             acc, 1);
        memcpy(out + t0, acc, (size_t)len * sizeof(float));
    }
}

/* out[i] (i < the output length) = DQ(q)[source(i)]: the W = nodes * local chunks of `cols`
   values arrive in rank order (node, local) and are written in chunk order (local, node). */
static void fn_dequantize_into(const uint8_t *q, const float *scales, int nbits,
                               int64_t group_size, int64_t cols, int64_t nodes, int64_t local,
                               float *out, int64_t begin, int64_t end)
{
    int64_t i = begin;
    while (i < end) {
        int64_t chunk = i / cols, stop = min64(end, (chunk + 1) * cols);
        int64_t piece = (chunk % nodes) * local + chunk / nodes;
        const uint8_t *pq = q + piece * cols * nbits / 8;
        const float *ps = scales + piece * cols / group_size;
        int64_t b = i - chunk * cols, e = stop - chunk * cols;
        float *dst = out + chunk * cols + b;
#if defined(__AVX2__)
        /* out is written, never read: streamed past the cache (no read for ownership) */
        if (nbits == 4 && group_size % 8 == 0 && b % 8 == 0 && (uintptr_t)dst % 32 == 0) {
            dequantize_range(pq, ps, nbits, group_size, b, e, dst, 2);
            i = stop;
            continue;
        }
#endif
        dequantize_range(pq, ps, nbits, group_size, b, e, dst, 0);
        i = stop;
    }
#if defined(__AVX2__)
    _mm_sfence();
#endif
}

enum {
    SIGN_COMPRESS,
    APPLY_ERROR,
    PACKBITS,
    UNPACKBITS,
    QUANTIZE,
    DEQUANTIZE,
    LOCO_QUANTIZE,
    LOCO_ERROR,
    DEQUANTIZE_SUM,
    DEQUANTIZE_INTO,
    FEEDBACK_SIGNS,
    FEEDBACK_ERROR,
    UNPACK_SCALED,
    ADAM_DIRECTION,
    SQRT_RN,
};

typedef struct {
    int64_t kernel, n, chunk, count, next, left;
    void *p[5];
    int64_t i[6];
    float scale, scale2;
} fn_job;

static void run_chunk(const fn_job *j, int64_t b, int64_t e)
{
    switch (j->kernel) {
    case SIGN_COMPRESS:
        fn_sign_compress(j->p[0], j->p[1], j->p[2], j->i[0], b, e, j->p[3], j->p[4]);
        break;
    case APPLY_ERROR:
        fn_apply_error(j->p[0], j->scale, b, e);
        break;
    case FEEDBACK_SIGNS:
        fn_feedback_signs(j->p[0], j->p[1], j->p[2], b, e);
        break;
    case FEEDBACK_ERROR:
        fn_feedback_error(j->p[0], j->scale, j->p[1], (int)j->i[0], (int)j->i[1], b, e);
        break;
    case UNPACK_SCALED:
        fn_unpack_scaled(j->p[0], j->p[1], j->i[0], j->p[2], (int)j->i[1], b, e);
        break;
    case ADAM_DIRECTION:
        fn_adam_direction(j->p[0], j->p[1], j->p[2], j->p[3], (int)j->i[0], j->scale, j->p[4], b,
                          e);
        break;
    case SQRT_RN:
        fn_sqrt_rn(j->p[0], j->p[1], b, e);
        break;
    case PACKBITS:
        fn_packbits(j->p[0], j->p[1], j->i[0], b, e);
        break;
    case UNPACKBITS:
        fn_unpackbits(j->p[0], j->p[1], (int)j->i[0], b, e);
        break;
    case QUANTIZE:
        fn_quantize(j->p[0], (int)j->i[0], j->i[1], j->p[1], j->p[2], b, e);
        break;
    case DEQUANTIZE:
        fn_dequantize(j->p[0], j->p[1], (int)j->i[0], j->i[1], j->p[2], b, e);
        break;
    case LOCO_QUANTIZE: {
        rows_layout l = {j->i[2], j->i[3], j->i[4], j->i[5]};
        fn_loco_quantize(j->p[0], j->p[1], l, (int)j->i[0], j->i[1], j->p[2], j->p[3], b, e);
        break;
    }
    case LOCO_ERROR: {
        rows_layout l = {j->i[2], j->i[3], j->i[4], j->i[5]};
        fn_loco_error(j->p[0], j->p[1], l, j->p[2], j->p[3], (int)j->i[0], j->i[1], j->scale,
                      j->scale2, j->p[4], b, e);
        break;
    }
    case DEQUANTIZE_SUM:
        fn_dequantize_sum(j->p[0], j->p[1], (int)j->i[0], j->i[1], j->i[2], j->i[3], j->p[2], b,
                          e);
        break;
    case DEQUANTIZE_INTO:
        fn_dequantize_into(j->p[0], j->p[1], (int)j->i[0], j->i[1], j->i[2], j->i[3], j->i[4],
                           j->p[2], b, e);
        break;
    }
}

void fn_work(fn_job *j)
{
    for (;;) {
        int64_t c = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (c >= j->count)
            return;
        int64_t b = c * j->chunk, e = b + j->chunk < j->n ? b + j->chunk : j->n;
        run_chunk(j, b, e);
        __atomic_fetch_sub(&j->left, 1, __ATOMIC_RELEASE);
    }
}

void fn_wait(fn_job *j)
{
    while (__atomic_load_n(&j->left, __ATOMIC_ACQUIRE) > 0)
        sched_yield();
}

/* Asks for transparent huge pages on the 2 MiB-aligned interior of a fresh output buffer:
   filling a large output otherwise costs one page fault per 4 KiB. */
void fn_advise_huge(void *p, int64_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
    if (end > begin)
        madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* The scale from the block sums, with exactly the IEEE operations of the reference's
   rms_from_block_sums: the count sums are zero padded to length (a power of two) and folded
   in place as first half + second half, then sqrt(total / n) is rounded once to float. */
float fn_rms(double *sums, int64_t count, int64_t length, int64_t n)
{
    if (n == 0)
        return 0.0f;
    for (int64_t j = count; j < length; j++)
        sums[j] = 0.0;
    for (int64_t h = length / 2; h >= 1; h /= 2)
        for (int64_t j = 0; j < h; j++)
            sums[j] = sums[j] + sums[j + h];
    return (float)sqrt(sums[0] / (double)n);
}

/* ------------------------------------------------------------------------------------------
   The 1-bit family's compressed Adam step added to the params in one pass (fn_adam_direction
   with flag 2): p = p + ((m / (sqrt(v) + eps)) clamped to [-bound, bound] (+ wd * p)) * neg_eta,
   each operation rounded as fn_adam_direction followed by the params' p + u. With signed_m, m
   is +-scales[i / chunk] by sign bit i (the bits of fn_unpack_scaled), written into signed_m->m
   (non-temporal with stream) as it is used, unless that is NULL; begin is then a multiple of 8. */
static void fn_adam_apply(const float *m, const fn_signed_momentum *signed_m, const float *v,
                          const float *k, int clamp, int decay, float neg_eta, float *p,
                          int64_t begin, int64_t end)
{
    const float eps = k[0], bound = k[1], wd = k[2];
    float *const m_out = signed_m ? signed_m->m : NULL;
    int64_t i = begin;
#if defined(__AVX2__)
    const __m256 ve = _mm256_set1_ps(eps), vb = _mm256_set1_ps(bound);
    const __m256 vnb = _mm256_set1_ps(-bound), vw = _mm256_set1_ps(wd);
    const __m256 vn = _mm256_set1_ps(neg_eta);
    const __m256i weights = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    const int stream = m_out && signed_m->stream && ((uintptr_t)m_out & 31) == 0;
    for (; i + 8 <= end; i += 8) {
        __m256 mi;
        if (signed_m) { /* 8 values of one row: chunk is a multiple of 8 */
            uint32_t s;
            memcpy(&s, signed_m->scales + i / signed_m->chunk, 4);
            __m256i bit = _mm256_and_si256(_mm256_set1_epi32(signed_m->packed[i >> 3]), weights);
            __m256i clear = _mm256_cmpeq_epi32(bit, _mm256_setzero_si256());
            mi = _mm256_castsi256_ps(
                _mm256_xor_si256(_mm256_set1_epi32((int)s), _mm256_and_si256(clear, sign)));
            if (stream)
                _mm256_stream_ps(m_out + i, mi);
            else if (m_out)
                _mm256_storeu_ps(m_out + i, mi);
        } else {
            mi = _mm256_loadu_ps(m + i);
        }
        __m256 u = _mm256_div_ps(mi, _mm256_add_ps(_mm256_sqrt_ps(_mm256_loadu_ps(v + i)), ve));
        if (clamp) { /* as the scalar ternaries: NaN stays NaN */
            u = _mm256_blendv_ps(u, vnb, _mm256_cmp_ps(u, vnb, _CMP_LT_OQ));
            u = _mm256_blendv_ps(u, vb, _mm256_cmp_ps(u, vb, _CMP_GT_OQ));
        }
        __m256 pi = _mm256_loadu_ps(p + i);
        if (decay)
            u = _mm256_add_ps(u, _mm256_mul_ps(vw, pi));
        _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_mul_ps(u, vn)));
    }
    if (stream)
        _mm_sfence();
#endif
    for (; i < end; i++) {
        float mi = m ? m[i] : scaled_sign(signed_m->packed, signed_m->scales, signed_m->chunk, i);
        if (m_out)
            m_out[i] = mi;
        float u = mi / (sqrtf(v[i]) + eps);
        if (clamp)
            u = u < -bound ? -bound : (u > bound ? bound : u);
        if (decay)
            u = u + wd * p[i];
        p[i] = p[i] + u * neg_eta;
    }
}
