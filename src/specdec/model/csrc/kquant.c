/* Linear layers over K-quant weight blocks with int8 activations and exact integer sums.
 *
 * Weight values are those of the GGUF K-quants, in 256-element super-blocks:
 *   q4k: w = d * sc[j] * q - dmin * mn[j],  q in 0..15, j = 32-element group (8 per block)
 *   q5k: the same with q in 0..31
 *   q6k: w = d * sc[s] * (q - 32),          q in 0..63, s = 16-element group (16 per block)
 * and of GGML's 32-weight types, eight groups of a 256-input block with a float16 scale each:
 *   q4_0: w = d * (q - 8), q5_0: w = d * (q - 16), q8_0: w = d * q (q signed),
 *   q4_1, q5_1: w = d * q + m
 * and float rows (F16, BF16, F32: see the float kernel below, which reads float activations).
 * They are repacked for this kernel in tiles of 16 output features (see tile_q4k): each code
 * vector holds 4 consecutive inputs of every output, so one dot-product instruction adds 4
 * products into each output's lane for a broadcast group of 4 activations. The lanes are
 * outputs, so no horizontal sums are needed, and the decoded weights are reused for up to
 * MAXRB activation rows.
 *
 * Activations are quantized per row and per 256-block to int8 (x ~ a * xq). Inside a block
 * every product and sum is an exact integer; each block then adds d * a * isum to a per-row,
 * per-output float accumulator, blocks in order. A row's result therefore depends on that row
 * alone: bitwise the same for 1 row or 64 rows per call. That batch invariance is what makes
 * a k-token verification pass compute exactly what one-token decoding computes.
 *
 * Built at first use by specdec.model.kquant (gcc -O3 -mavx2 -mfma -fopenmp
 * -ffp-contract=off), with -DSPECDEC_AVX512 where the CPU has AVX512-BW/VL/VNNI, and with
 * -DSPECDEC_AMX too where it also has AMX (amx_tile, amx_int8). All builds give bitwise the
 * same results (tested where the paths run). -ffp-contract=off keeps the compiler from fusing
 * float operations differently in the specialised copies of the row loop.
 *
 * The AMX path (several rows): a tile multiply (tdpbssd) computes, for up to 16 activation
 * rows and the 16 outputs of a tile, the exact int32 sum over one scale group (32 inputs for
 * q4k, 16 for q6k); the code vectors of the AVX-512 path are exactly the B operand's VNNI
 * layout (one row = 4 inputs x 16 outputs). The group sums are then scaled and accumulated
 * with the same integer and float operations, in the same order, as the other paths.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"
#if defined(SPECDEC_AMX) && !defined(SPECDEC_AMX_EMULATE)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TILE 16

/* Rows that share one decoding of the weights: as many as the vector registers hold (AVX-512
 * has 32, AVX2 16). */
#ifdef SPECDEC_AVX512
#define MAXRB 8
#else
#define MAXRB 4
#endif

/* A tile-block: 16 outputs x 256 inputs. A "chunk" is 4 consecutive inputs; a code vector
 * holds one chunk for all 16 outputs (64 bytes: output o's 4 codes at 4o..4o+3), so a 512-bit
 * vpdpbusd adds 4 products into each of 16 output lanes, and AVX2 does the same per 8-output
 * half. */
typedef struct {
    float d[TILE], dmin[TILE];
    uint8_t sc[8][TILE];      /* [group][output] */
    uint8_t mn[4][TILE][2];   /* [group pair][output][2] */
    uint8_t qs[8][4][64];     /* [group][v]: chunk v in the low nibbles, chunk v+4 in the high */
} tile_q4k;

typedef struct {
    float d[TILE];
    int8_t sc[16][TILE];      /* [sub-block][output] */
    struct {
        uint8_t ql[2][64];    /* [w]: chunk 2w in the low nibbles, chunk 2w+1 in the high */
        uint8_t qh[64];       /* bits 2c..2c+1 = chunk c's top two bits */
    } sub[16];                /* one sub-block's codes together: a single forward stream */
} tile_q6k;

/* Draft packings (`--draft-bits 3|2`): a model that only drafts may run on fewer bits. Not
 * GGUF formats but q4k's own with narrower codes: w = d * sc[j] * q - dmin * mn[j] with q in
 * 0..7 or 0..3 per 32-element group, scales and mins of 8 bits (the fit is specdec's, see
 * kquant.quantize), so the same integer sums and the same float operations as q4k. The header
 * (d, dmin, sc, mn) is q4k's, field for field. */
typedef struct {
    float d[TILE], dmin[TILE];
    uint8_t sc[8][TILE];
    uint8_t mn[4][TILE][2];
    uint8_t qs[8][2][64];     /* [group][w]: chunk 4w + i's codes at bits 2i..2i+1 */
} tile_q2;

typedef struct {
    float d[TILE], dmin[TILE];
    uint8_t sc[8][TILE];
    uint8_t mn[4][TILE][2];
    struct {
        uint8_t qs[2][64];    /* the codes' low two bits, as tile_q2 */
        uint8_t qh[64];       /* bit v: chunk v's third bit */
    } g[8];                   /* one group's codes together: a single forward stream */
} tile_q3;

/* Q5_K: q4k's header and nibbles, plus each code's fifth bit. */
typedef struct {
    float d[TILE], dmin[TILE];
    uint8_t sc[8][TILE];
    uint8_t mn[4][TILE][2];
    struct {
        uint8_t qs[4][64];    /* as tile_q4k's qs[j] */
        uint8_t qh[64];       /* bit v: chunk v's fifth bit */
    } g[8];
} tile_q5k;

/* GGML's 32-weight types, 16 outputs x 256 inputs (eight of the file's blocks per output):
 *   uint16_t d[8][16]         float16 scales, [group][output], as the file holds them
 *   uint16_t m[8][16]         float16 mins (Q4_1, Q5_1 only)
 *   then per group j (32 inputs) its code vectors, as q4k's:
 *     4 bits: qs[4][64]       chunk v in the low nibbles, chunk v+4 in the high
 *     5 bits: qs[4][64], qh[64]   and bit v of qh: chunk v's fifth bit
 *     8 bits: qs[8][64]       signed codes, one byte each
 * Scales stay float16 (widened in the kernel): a file's Q8_0 layer then reads 8.5 bits a weight,
 * as llama.cpp's does. */
static inline size_t legacy_head(int has_min) { return has_min ? 512 : 256; }
static inline size_t legacy_group(int bits) { return bits == 4 ? 256 : bits == 5 ? 320 : 512; }
static inline size_t legacy_size(int bits, int has_min) { return legacy_head(has_min) + 8 * legacy_group(bits); }

/* Float rows: [256 inputs][16 outputs] of the file's element type per tile-block. */
static inline size_t float_width(int kind) { return kind == KIND_F32 ? 4 : 2; }

_Static_assert(sizeof(tile_q5k) == 2944, "q5k tile layout");
_Static_assert(offsetof(tile_q5k, g) == offsetof(tile_q4k, qs), "q5k's header is q4k's");
_Static_assert(offsetof(tile_q2, mn) == offsetof(tile_q4k, mn) && offsetof(tile_q3, mn) == offsetof(tile_q4k, mn) &&
               offsetof(tile_q2, qs) == offsetof(tile_q4k, qs) && offsetof(tile_q3, g) == offsetof(tile_q4k, qs),
               "the draft packings' header is q4k's");
_Static_assert(sizeof(tile_q4k) == 2432, "q4k tile layout");
_Static_assert(sizeof(tile_q6k) == 3392, "q6k tile layout");
_Static_assert(sizeof(tile_q2) == 1408, "q2 tile layout");
_Static_assert(sizeof(tile_q3) == 1920, "q3 tile layout");

static inline size_t tile_size(int kind) {
    switch (kind) {
    case KIND_Q4K: return sizeof(tile_q4k);
    case KIND_Q5K: return sizeof(tile_q5k);
    case KIND_Q6K: return sizeof(tile_q6k);
    case KIND_Q3: return sizeof(tile_q3);
    case KIND_Q2: return sizeof(tile_q2);
    case KIND_Q4_0: return legacy_size(4, 0);
    case KIND_Q4_1: return legacy_size(4, 1);
    case KIND_Q5_0: return legacy_size(5, 0);
    case KIND_Q5_1: return legacy_size(5, 1);
    case KIND_Q8_0: return legacy_size(8, 0);
    case KIND_F16: case KIND_BF16: case KIND_F32: return (size_t)QK * TILE * float_width(kind);
    default: return 0;
    }
}

int specdec_tile_bytes(int kind) { return (int)tile_size(kind); }  /* 0: not a kind */
int specdec_tile_outputs(void) { return TILE; }


/* Row r of the activations, x: [K] floats. K need not be a multiple of 256: the last block is
 * padded with zeros (the weights' padding is zero too). */
void specdec_quantize_row(const float *x, int r, int K, xquant *xq) {
    const int nb = xq->nb;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    float tail[QK];
    for (int b = 0; b < nb; b++) {
        const float *xp = x + (size_t)b * QK;
        if ((b + 1) * QK > K) {
            memset(tail, 0, sizeof(tail));
            memcpy(tail, xp, sizeof(float) * (size_t)(K - b * QK));
            xp = tail;
        }
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < QK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xp + i)));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const size_t rb = (size_t)r * nb + b;
        xq->a[rb] = amax / 127.0f;
        int8_t *qp = xq->q + (size_t)r * xq->K + (size_t)b * QK;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int i = 0; i < QK; i += 32) {
            /* cvtps rounds to nearest even; |x * inv| <= 127 so the packs never saturate */
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp + i), vinv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp + i + 8), vinv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp + i + 16), vinv));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp + i + 24), vinv));
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            /* undo the packs' per-128-bit-lane interleaving */
            bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qp + i), bytes);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qp[16 * g + i];
            xq->s16[rb * 16 + g] = (int16_t)s;
        }
        for (int g = 0; g < 8; g++) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += qp[32 * g + i];
            xq->s32[rb * 8 + g] = (int16_t)s;
        }
    }
}

static inline int32_t load4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Prefetching. The loop spends long enough on each tile-block that the hardware prefetchers
 * fall behind, so each block asks for the one PF_AHEAD blocks further on (the same tile, or the
 * next tile this thread takes: tiles lie back to back), into L2 (T1): far enough ahead to cover
 * DRAM latency at full bandwidth, without filling L1, which holds the block being read and the
 * activation rows. The requests are spread over the block's scale groups, a few lines each:
 * asked for all at once they stall the loop until the memory system takes them, and memory time
 * adds to compute time instead of overlapping it. One row is served the same way: without the
 * requests (left to the hardware prefetchers, as the AVX-512 build once did) a one-row pass
 * cost more than a two-row one on every CPU measured (Zen 4, Zen 5, an AMX Xeon; with them it
 * costs less on the Xeon: docs/results.md, 2026-12-05). `specdec bench forward`
 * shows how close a pass comes to max(memory, compute). (Prefetches past the end of the weights
 * never fault.) */
#define PF_AHEAD 12
static inline __attribute__((always_inline)) void prefetch_part(const void *t, size_t bytes, int part, int parts) {
    const char *p = (const char *)t + PF_AHEAD * bytes;
    const size_t lines = bytes / 64;  /* both tile-blocks are whole cache lines */
    for (size_t l = lines * part / parts; l < lines * (part + 1) / parts; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
}
_Static_assert(sizeof(tile_q4k) % 64 == 0 && sizeof(tile_q6k) % 64 == 0 && sizeof(tile_q2) % 64 == 0 &&
               sizeof(tile_q3) % 64 == 0, "tile-blocks are whole cache lines");

/* Per row and output, both builds do the same integer sums and then the same float operations
 * in the same order (one fmadd per block, a final subtraction and bias add), so the AVX2 and
 * AVX-512 builds give bitwise identical results. */

/* The 8 code vectors of group j, half h (8 outputs), 256-bit: chunk v's codes for 4 inputs of 8
 * outputs. bits = 4: q4k's nibbles; 3 or 2: the draft packings' codes (0..7, 0..3). */
static inline __attribute__((always_inline)) void codes256(const void *tb, int bits, int j, int h, __m256i c[8]) {
    if (bits == 4 || bits == 5) {
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const uint8_t *qs = bits == 4 ? ((const tile_q4k *)tb)->qs[j][0] : ((const tile_q5k *)tb)->g[j].qs[0];
        for (int v = 0; v < 4; v++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 64 * v + 32 * h));
            c[v] = _mm256_and_si256(raw, m4);
            c[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        if (bits == 5) {  /* bit v of qh to bit 4 of chunk v's codes (shifts within each byte) */
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(((const tile_q5k *)tb)->g[j].qh + 32 * h));
            const __m256i b4 = _mm256_set1_epi8(0x10);
            for (int v = 0; v < 8; v++) {
                const __m256i at4 = v < 4 ? _mm256_slli_epi16(hb, 4 - v) : v > 4 ? _mm256_srli_epi16(hb, v - 4) : hb;
                c[v] = _mm256_or_si256(c[v], _mm256_and_si256(at4, b4));
            }
        }
        return;
    }
    const __m256i m2 = _mm256_set1_epi8(0x03), b2 = _mm256_set1_epi8(0x04);
    const uint8_t *qs = bits == 2 ? ((const tile_q2 *)tb)->qs[j][0] : ((const tile_q3 *)tb)->g[j].qs[0];
    for (int w = 0; w < 2; w++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 64 * w + 32 * h));
        for (int i = 0; i < 4; i++) c[4 * w + i] = _mm256_and_si256(i ? _mm256_srli_epi16(raw, 2 * i) : raw, m2);
    }
    if (bits == 3) {
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(((const tile_q3 *)tb)->g[j].qh + 32 * h));
        for (int v = 0; v < 8; v++) {
            const __m256i at2 = v < 2 ? _mm256_slli_epi16(hb, 2 - v) : v > 2 ? _mm256_srli_epi16(hb, v - 2) : hb;
            c[v] = _mm256_or_si256(c[v], _mm256_and_si256(at2, b2));
        }
    }
}

/* One half (8 outputs, h = 0 or 1) of a tile of q4k or a draft packing (`bits` 4, 3, 2: a
 * constant wherever it is called, so each is compiled on its own), rows r0..r0+rb-1, with
 * 256-bit vectors. The packings share q4k's header (scales, mins, d, dmin). */
static inline __attribute__((always_inline)) void half_dot_k(
    const uint8_t *w, int bits, const xquant *xq, int r0, int rb, int h, float out[][TILE]) {
    const size_t tb = tile_size(bits);
    __m256 facc[MAXRB], fmin[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = fmin[r] = _mm256_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const tile_q4k *t = (const tile_q4k *)(w + b * tb);  /* (the header every packing shares) */
        __m256i iacc[MAXRB], imin[MAXRB];
        for (int r = 0; r < rb; r++) iacc[r] = imin[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)t->mn[p][8 * h]));
            for (int r = 0; r < rb; r++) {
                const int16_t *s32 = xq->s32 + ((size_t)(r0 + r) * xq->nb + b) * 8 + 2 * p;
                imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mn, _mm256_set1_epi32(load4(s32))));
            }
        }
        for (int j = 0; j < 8; j++) {
            if (h == 0) prefetch_part(t, tb, j, 8);  /* (the second half finds the tile in cache) */
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)&t->sc[j][8 * h]));
            __m256i c[8];
            codes256(t, bits, j, h, c);
            /* Each output's group sum in two 16-bit halves (lanes 2o, 2o+1), then one
             * multiply-add by the scale gives sc * g in 32 bits. Exact: a pair of products is at
             * most 2 * 15 * 127 = 3810 (maddubs never saturates) and 8 of them 30480 < 2^15; the
             * same integer as the 512-bit path's g * sc, in 17 operations per row, not 26. */
            const __m256i sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
            for (int r = 0; r < rb; r++) {
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 32 * j;
                if (bits == 5) {  /* a pair is at most 2 * 31 * 127 = 7874: four of them, not eight, per 16 bits */
                    __m256i lo = _mm256_maddubs_epi16(c[0], _mm256_set1_epi32(load4(xp)));
                    __m256i hi = _mm256_maddubs_epi16(c[4], _mm256_set1_epi32(load4(xp + 16)));
                    for (int v = 1; v < 4; v++) {
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(c[v], _mm256_set1_epi32(load4(xp + 4 * v))));
                        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(c[v + 4], _mm256_set1_epi32(load4(xp + 16 + 4 * v))));
                    }
                    iacc[r] = _mm256_add_epi32(iacc[r], _mm256_add_epi32(_mm256_madd_epi16(lo, sc16), _mm256_madd_epi16(hi, sc16)));
                    continue;
                }
                __m256i g16 = _mm256_maddubs_epi16(c[0], _mm256_set1_epi32(load4(xp)));
                for (int v = 1; v < 8; v++) g16 = _mm256_add_epi16(g16, _mm256_maddubs_epi16(c[v], _mm256_set1_epi32(load4(xp + 4 * v))));
                iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(g16, sc16));
            }
        }
        const __m256 d = _mm256_loadu_ps(t->d + 8 * h), dmin = _mm256_loadu_ps(t->dmin + 8 * h);
        for (int r = 0; r < rb; r++) {
            const __m256 a = _mm256_set1_ps(xq->a[(size_t)(r0 + r) * xq->nb + b]);
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(d, a), facc[r]);
            fmin[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(dmin, a), fmin[r]);
        }
    }
    for (int r = 0; r < rb; r++) _mm256_storeu_ps(out[r] + 8 * h, _mm256_sub_ps(facc[r], fmin[r]));
}

static inline __m256i q6_codes(__m256i lo_src, int lo_shift, __m256i hb, int c) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    const __m256i lo = _mm256_and_si256(lo_shift ? _mm256_srli_epi16(lo_src, 4) : lo_src, m4);
    const __m256i hi = _mm256_and_si256(c ? _mm256_srli_epi16(hb, 2 * c) : hb, m3);
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

static inline __attribute__((always_inline)) void half_dot_q6k(
    const tile_q6k *w, const xquant *xq, int r0, int rb, int h, float out[][TILE]) {
    __m256 facc[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = _mm256_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const tile_q6k *t = w + b;
        __m256i iacc[MAXRB];
        for (int r = 0; r < rb; r++) iacc[r] = _mm256_setzero_si256();
        /* The offset -32 * (sum of each 16 codes) is applied once per block:
         * iacc = sum_s sc_s * (codes . x)_s - 32 * sum_s sc_s * S_s, the same integer as the
         * per-sub-block form, with the sums S_s (16 bits) taken two sub-blocks per multiply-add. */
        __m256i scp[8];  /* (sc_s, sc_s+1) per output, as 16-bit pairs */
        for (int p = 0; p < 8; p++)
            scp[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)&t->sc[2 * p][8 * h]),
                                                            _mm_loadl_epi64((const __m128i *)&t->sc[2 * p + 1][8 * h])));
        for (int r = 0; r < rb; r++) {
            const int16_t *s16 = xq->s16 + ((size_t)(r0 + r) * xq->nb + b) * 16;
            __m256i off = _mm256_madd_epi16(scp[0], _mm256_set1_epi32(load4(s16)));
            for (int p = 1; p < 8; p++) off = _mm256_add_epi32(off, _mm256_madd_epi16(scp[p], _mm256_set1_epi32(load4(s16 + 2 * p))));
            iacc[r] = _mm256_sub_epi32(iacc[r], _mm256_slli_epi32(off, 5));
        }
        for (int s = 0; s < 16; s++) {
            if (h == 0) prefetch_part(t, sizeof(tile_q6k), s, 16);
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)&t->sc[s][8 * h]));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)&t->sub[s].ql[0][32 * h]);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)&t->sub[s].ql[1][32 * h]);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)&t->sub[s].qh[32 * h]);
            const __m256i c0 = q6_codes(l0, 0, hb, 0), c1 = q6_codes(l0, 1, hb, 1);
            const __m256i c2 = q6_codes(l1, 0, hb, 2), c3 = q6_codes(l1, 1, hb, 3);
            /* 16-bit sums of two chunks (a pair of products is at most 2 * 63 * 127 = 16002,
             * two of them 32004 < 2^15), then one multiply-add by the scale per two chunks */
            const __m256i sc16 = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
            for (int r = 0; r < rb; r++) {
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 16 * s;
                const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_set1_epi32(load4(xp))),
                                                     _mm256_maddubs_epi16(c1, _mm256_set1_epi32(load4(xp + 4))));
                const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(c2, _mm256_set1_epi32(load4(xp + 8))),
                                                     _mm256_maddubs_epi16(c3, _mm256_set1_epi32(load4(xp + 12))));
                iacc[r] = _mm256_add_epi32(iacc[r], _mm256_add_epi32(_mm256_madd_epi16(s01, sc16), _mm256_madd_epi16(s23, sc16)));
            }
        }
        const __m256 d = _mm256_loadu_ps(t->d + 8 * h);
        for (int r = 0; r < rb; r++) {
            const __m256 a = _mm256_set1_ps(xq->a[(size_t)(r0 + r) * xq->nb + b]);
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(d, a), facc[r]);
        }
    }
    for (int r = 0; r < rb; r++) _mm256_storeu_ps(out[r] + 8 * h, facc[r]);
}

/* GGML's 32-weight types, one half of a tile (8 outputs), 256-bit. Per group j of 32 inputs and
 * row: the exact integer dot product of the codes with the activation codes, the type's offset
 * taken out with the group's activation sum S_j (q4_0: -8 S_j, q5_0: -16 S_j), then one fused
 * multiply-add of it by d_j * a into the row's float accumulator, groups in order (the _1 types'
 * m_j * S_j * a into a second one, added at the end). The same integers and float operations as
 * the 512-bit path, so the same bits. */
static inline __attribute__((always_inline)) void half_dot_legacy(
    const uint8_t *w, int bits, int has_min, const xquant *xq, int r0, int rb, int h, float out[][TILE]) {
    const size_t tb = legacy_size(bits, has_min), head = legacy_head(has_min), gs = legacy_group(bits);
    const int off = has_min ? 0 : bits == 4 ? -8 : bits == 5 ? -16 : 0;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    __m256 facc[MAXRB], fmin[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = fmin[r] = _mm256_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const uint8_t *t = w + b * tb;
        const uint16_t *d16 = (const uint16_t *)t, *m16 = d16 + 8 * TILE;
        for (int j = 0; j < 8; j++) {
            if (h == 0) prefetch_part(t, tb, j, 8);
            const uint8_t *g = t + head + j * gs;
            __m256i c[8], ac[8];
            if (bits == 8) {  /* signed codes: |q| times x with q's sign (llama.cpp's way; a pair <= 2 * 128 * 127) */
                for (int v = 0; v < 8; v++) {
                    c[v] = _mm256_loadu_si256((const __m256i *)(g + 64 * v + 32 * h));
                    ac[v] = _mm256_abs_epi8(c[v]);
                }
            } else {
                for (int v = 0; v < 4; v++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 64 * v + 32 * h));
                    c[v] = _mm256_and_si256(raw, m4);
                    c[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                }
                if (bits == 5) {
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(g + 256 + 32 * h));
                    for (int v = 0; v < 8; v++) {
                        const __m256i at4 = v < 4 ? _mm256_slli_epi16(hb, 4 - v) : v > 4 ? _mm256_srli_epi16(hb, v - 4) : hb;
                        c[v] = _mm256_or_si256(c[v], _mm256_and_si256(at4, b4));
                    }
                }
            }
            const __m256 dj = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16 + TILE * j + 8 * h)));
            const __m256 mj = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + TILE * j + 8 * h))) : dj;
            for (int r = 0; r < rb; r++) {
                const size_t rbk = (size_t)(r0 + r) * xq->nb + b;
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 32 * j;
                const int S = xq->s32[rbk * 8 + j];
                __m256i isum;
                if (bits == 8) {
                    isum = _mm256_setzero_si256();
                    for (int v = 0; v < 8; v++) {
                        const __m256i p = _mm256_maddubs_epi16(ac[v], _mm256_sign_epi8(_mm256_set1_epi32(load4(xp + 4 * v)), c[v]));
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                    }
                } else {  /* a pair is at most 2 * 31 * 127 = 7874: four pairs per 16-bit sum */
                    __m256i lo = _mm256_maddubs_epi16(c[0], _mm256_set1_epi32(load4(xp)));
                    __m256i hi = _mm256_maddubs_epi16(c[4], _mm256_set1_epi32(load4(xp + 16)));
                    for (int v = 1; v < 4; v++) {
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(c[v], _mm256_set1_epi32(load4(xp + 4 * v))));
                        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(c[v + 4], _mm256_set1_epi32(load4(xp + 16 + 4 * v))));
                    }
                    isum = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)),
                                            _mm256_set1_epi32(off * S));
                }
                const __m256 a = _mm256_set1_ps(xq->a[rbk]);
                facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dj, a), facc[r]);
                if (has_min) fmin[r] = _mm256_fmadd_ps(_mm256_set1_ps((float)S), _mm256_mul_ps(mj, a), fmin[r]);
            }
        }
    }
    for (int r = 0; r < rb; r++) _mm256_storeu_ps(out[r] + 8 * h, has_min ? _mm256_add_ps(facc[r], fmin[r]) : facc[r]);
}

/* 8 float weights (outputs 8h..8h+7 of one input) widened to float32: exact for every kind. */
static inline __m256 float_weights256(const uint8_t *p, int kind) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    if (kind == KIND_F16) return _mm256_cvtph_ps(raw);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));  /* bf16: the top half of a float */
}

/* Float rows (F16, BF16, F32), one half of a tile, on the float activations: each output's sum
 * over its inputs in two fused multiply-add chains (even and odd inputs), inputs in order, then
 * even + odd. The order depends on nothing but the inputs' count, so a row's result does not
 * depend on the other rows; every build runs the same per-lane operations. */
static inline __attribute__((always_inline)) void half_dot_float(
    const uint8_t *w, int kind, const xquant *xq, int r0, int rb, int h, float out[][TILE]) {
    const size_t ew = float_width(kind), tb = (size_t)QK * TILE * ew;
    __m256 even[MAXRB], odd[MAXRB];
    for (int r = 0; r < rb; r++) even[r] = odd[r] = _mm256_setzero_ps();
    const int K = xq->Kin;
    for (int i = 0; i < K; i += 2) {
        if (h == 0 && i % 32 == 0) prefetch_part(w + (size_t)(i / QK) * tb, tb, (i % QK) / 32, 8);
        const __m256 w0 = float_weights256(w + ((size_t)i * TILE + 8 * h) * ew, kind);
        const __m256 w1 = i + 1 < K ? float_weights256(w + ((size_t)(i + 1) * TILE + 8 * h) * ew, kind) : _mm256_setzero_ps();
        for (int r = 0; r < rb; r++) {
            const float *x = xq->x + (size_t)(r0 + r) * xq->ld;
            even[r] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[i]), even[r]);
            if (i + 1 < K) odd[r] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x[i + 1]), odd[r]);
        }
    }
    for (int r = 0; r < rb; r++) _mm256_storeu_ps(out[r] + 8 * h, _mm256_add_ps(even[r], odd[r]));
}

#ifdef SPECDEC_AVX512
/* Pieces the 512-bit paths (AVX-512 VNNI and AMX) share, so that both do exactly the same
 * integer and float operations around their dot products. */

/* q4k min term of block b: imin[r] += sum over the 8 groups of mn[group] * (sum of the
 * group's 32 activation codes), exact, per output lane. */
static inline __attribute__((always_inline)) void q4k_mins512(
    const tile_q4k *t, const xquant *xq, int r0, int rb, int b, __m512i imin[]) {
    for (int p = 0; p < 4; p++) {
        const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)t->mn[p]));
        for (int r = 0; r < rb; r++) {
            const int16_t *s32 = xq->s32 + ((size_t)(r0 + r) * xq->nb + b) * 8 + 2 * p;
            imin[r] = _mm512_dpwssd_epi32(imin[r], mn, _mm512_set1_epi32(load4(s32)));
        }
    }
}

/* acc + dot(codes c, the 4 activation bytes at p in every lane), the broadcast done by the
 * instruction's own memory operand ({1to16}): the compiler emits a separate broadcast
 * instruction per dot product otherwise, which competes with the dot products for the vector
 * pipes once several rows share the loop. The same instruction either way. */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i c, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(c), "m"(*(const int32_t *)p));
    return acc;
}

/* The 8 code vectors of group j (chunk v: inputs 4v..4v+3 of the group, 16 outputs), 512-bit:
 * q4k's nibbles (bits = 4) or a draft packing's codes (3, 2; see codes256). */
static inline __attribute__((always_inline)) void codes512(const void *tb, int bits, int j, __m512i c[8]) {
    if (bits == 4 || bits == 5) {
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        const uint8_t *qs = bits == 4 ? ((const tile_q4k *)tb)->qs[j][0] : ((const tile_q5k *)tb)->g[j].qs[0];
        for (int v = 0; v < 4; v++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * v));
            c[v] = _mm512_and_si512(raw, m4);
            c[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        if (bits == 5) {
            const __m512i hb = _mm512_loadu_si512((const void *)((const tile_q5k *)tb)->g[j].qh);
            const __m512i b4 = _mm512_set1_epi8(0x10);
            for (int v = 0; v < 8; v++) {
                const __m512i at4 = v < 4 ? _mm512_slli_epi16(hb, 4 - v) : v > 4 ? _mm512_srli_epi16(hb, v - 4) : hb;
                c[v] = _mm512_or_si512(c[v], _mm512_and_si512(at4, b4));
            }
        }
        return;
    }
    const __m512i m2 = _mm512_set1_epi8(0x03), b2 = _mm512_set1_epi8(0x04);
    const uint8_t *qs = bits == 2 ? ((const tile_q2 *)tb)->qs[j][0] : ((const tile_q3 *)tb)->g[j].qs[0];
    for (int w = 0; w < 2; w++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * w));
        for (int i = 0; i < 4; i++) c[4 * w + i] = _mm512_and_si512(i ? _mm512_srli_epi16(raw, 2 * i) : raw, m2);
    }
    if (bits == 3) {
        const __m512i hb = _mm512_loadu_si512((const void *)((const tile_q3 *)tb)->g[j].qh);
        for (int v = 0; v < 8; v++) {
            const __m512i at2 = v < 2 ? _mm512_slli_epi16(hb, 2 - v) : v > 2 ? _mm512_srli_epi16(hb, v - 2) : hb;
            c[v] = _mm512_or_si512(c[v], _mm512_and_si512(at2, b2));
        }
    }
}

/* End of block b: acc[r] += float(isum[r]) * (scale * a[r, b]), one fused multiply-add per
 * block in block order: the float part every path shares. */
static inline __attribute__((always_inline)) void block_fma512(
    const float *scale, const xquant *xq, int r0, int rb, int b, const __m512i isum[], __m512 acc[]) {
    const __m512 s = _mm512_loadu_ps(scale);
    for (int r = 0; r < rb; r++) {
        const __m512 a = _mm512_set1_ps(xq->a[(size_t)(r0 + r) * xq->nb + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, a), acc[r]);
    }
}

/* The same computation on whole tiles with 512-bit vectors: twice the products per
 * instruction, which is what bounds a pass over several rows. q4k or a draft packing (`bits`,
 * a constant wherever it is called). */
static inline __attribute__((always_inline)) void tile_dot_k(
    const uint8_t *w, int bits, const xquant *xq, int r0, int rb, float out[][TILE]) {
    const size_t tb = tile_size(bits);
    __m512 facc[MAXRB], fmin[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = fmin[r] = _mm512_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const tile_q4k *t = (const tile_q4k *)(w + b * tb);  /* (the header every packing shares) */
        __m512i iacc[MAXRB], imin[MAXRB];
        for (int r = 0; r < rb; r++) iacc[r] = imin[r] = _mm512_setzero_si512();
        q4k_mins512(t, xq, r0, rb, b, imin);
        for (int j = 0; j < 8; j++) {
            prefetch_part(t, tb, j, 8);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)t->sc[j]));
            const __m512i sc16 = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
            __m512i c[8];
            codes512(t, bits, j, c);
            for (int r = 0; r < rb; r++) {
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 32 * j;
                /* two chains of four, not one of eight: the dot product's latency, not its
                 * throughput, bounded a sweep of several rows */
                __m512i g0 = dpbusd_bcast(_mm512_setzero_si512(), c[0], xp);
                __m512i g1 = dpbusd_bcast(_mm512_setzero_si512(), c[1], xp + 4);
                for (int v = 2; v < 8; v += 2) {
                    g0 = dpbusd_bcast(g0, c[v], xp + 4 * v);
                    g1 = dpbusd_bcast(g1, c[v + 1], xp + 4 * v + 4);
                }
                if (bits == 5) {
                    iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(_mm512_add_epi32(g0, g1), sc));
                } else {
                    /* sc * (g0 + g1) in one multiply-add of 16-bit pairs (g0 in the low half of
                     * each lane, g1 in the high): exact, as each half-sum of 16 products is at
                     * most 16 * 15 * 127 = 30480 < 2^15 in size (not so for Q5_K's codes) */
                    const __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAA, g0, _mm512_slli_epi32(g1, 16));
                    iacc[r] = _mm512_dpwssd_epi32(iacc[r], pair, sc16);
                }
            }
        }
        block_fma512(t->d, xq, r0, rb, b, iacc, facc);
        block_fma512(t->dmin, xq, r0, rb, b, imin, fmin);
    }
    for (int r = 0; r < rb; r++) _mm512_storeu_ps(out[r], _mm512_sub_ps(facc[r], fmin[r]));
}

static inline __m512i q6_codes512(__m512i lo_src, int lo_shift, __m512i hb, int c) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    const __m512i lo = _mm512_and_si512(lo_shift ? _mm512_srli_epi16(lo_src, 4) : lo_src, m4);
    const __m512i hi = _mm512_and_si512(c ? _mm512_srli_epi16(hb, 2 * c) : hb, m3);
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
}

static inline __attribute__((always_inline)) void tile_dot_q6k(
    const tile_q6k *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    __m512 facc[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = _mm512_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const tile_q6k *t = w + b;
        __m512i iacc[MAXRB];
        for (int r = 0; r < rb; r++) iacc[r] = _mm512_setzero_si512();
        for (int s = 0; s < 16; s++) {
            prefetch_part(t, sizeof(tile_q6k), s, 16);
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)t->sc[s]));
            const __m512i l0 = _mm512_loadu_si512((const void *)t->sub[s].ql[0]);
            const __m512i l1 = _mm512_loadu_si512((const void *)t->sub[s].ql[1]);
            const __m512i hb = _mm512_loadu_si512((const void *)t->sub[s].qh);
            const __m512i c0 = q6_codes512(l0, 0, hb, 0), c1 = q6_codes512(l0, 1, hb, 1);
            const __m512i c2 = q6_codes512(l1, 0, hb, 2), c3 = q6_codes512(l1, 1, hb, 3);
            for (int r = 0; r < rb; r++) {
                const size_t rbk = (size_t)(r0 + r) * xq->nb + b;
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 16 * s;
                __m512i g0 = dpbusd_bcast(_mm512_set1_epi32(-32 * xq->s16[rbk * 16 + s]), c0, xp);
                __m512i g1 = dpbusd_bcast(_mm512_setzero_si512(), c1, xp + 4);
                g0 = dpbusd_bcast(g0, c2, xp + 8);
                g1 = dpbusd_bcast(g1, c3, xp + 12);
                iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(_mm512_add_epi32(g0, g1), sc));
            }
        }
        block_fma512(t->d, xq, r0, rb, b, iacc, facc);
    }
    for (int r = 0; r < rb; r++) _mm512_storeu_ps(out[r], facc[r]);
}

/* GGML's 32-weight types with 512-bit vectors (see half_dot_legacy): the codes as unsigned
 * bytes for vpdpbusd (q8_0's signed codes plus 128, taken out again with -128 S_j), the same
 * integer per group, the same float operations. */
static inline __attribute__((always_inline)) void tile_dot_legacy(
    const uint8_t *w, int bits, int has_min, const xquant *xq, int r0, int rb, float out[][TILE]) {
    const size_t tb = legacy_size(bits, has_min), head = legacy_head(has_min), gs = legacy_group(bits);
    const int off = has_min ? 0 : bits == 4 ? -8 : bits == 5 ? -16 : -128;
    const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10), flip = _mm512_set1_epi8((char)0x80);
    __m512 facc[MAXRB], fmin[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = fmin[r] = _mm512_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const uint8_t *t = w + b * tb;
        const uint16_t *d16 = (const uint16_t *)t, *m16 = d16 + 8 * TILE;
        for (int j = 0; j < 8; j++) {
            prefetch_part(t, tb, j, 8);
            const uint8_t *g = t + head + j * gs;
            __m512i c[8];
            if (bits == 8) {
                for (int v = 0; v < 8; v++) c[v] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(g + 64 * v)), flip);
            } else {
                for (int v = 0; v < 4; v++) {
                    const __m512i raw = _mm512_loadu_si512((const void *)(g + 64 * v));
                    c[v] = _mm512_and_si512(raw, m4);
                    c[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                }
                if (bits == 5) {
                    const __m512i hb = _mm512_loadu_si512((const void *)(g + 256));
                    for (int v = 0; v < 8; v++) {
                        const __m512i at4 = v < 4 ? _mm512_slli_epi16(hb, 4 - v) : v > 4 ? _mm512_srli_epi16(hb, v - 4) : hb;
                        c[v] = _mm512_or_si512(c[v], _mm512_and_si512(at4, b4));
                    }
                }
            }
            const __m512 dj = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + TILE * j)));
            const __m512 mj = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m16 + TILE * j))) : dj;
            for (int r = 0; r < rb; r++) {
                const size_t rbk = (size_t)(r0 + r) * xq->nb + b;
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 32 * j;
                const int S = xq->s32[rbk * 8 + j];
                __m512i g0 = dpbusd_bcast(_mm512_set1_epi32(off * S), c[0], xp);
                __m512i g1 = dpbusd_bcast(_mm512_setzero_si512(), c[1], xp + 4);
                for (int v = 2; v < 8; v += 2) {
                    g0 = dpbusd_bcast(g0, c[v], xp + 4 * v);
                    g1 = dpbusd_bcast(g1, c[v + 1], xp + 4 * v + 4);
                }
                const __m512 a = _mm512_set1_ps(xq->a[rbk]);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(g0, g1)), _mm512_mul_ps(dj, a), facc[r]);
                if (has_min) fmin[r] = _mm512_fmadd_ps(_mm512_set1_ps((float)S), _mm512_mul_ps(mj, a), fmin[r]);
            }
        }
    }
    for (int r = 0; r < rb; r++) _mm512_storeu_ps(out[r], has_min ? _mm512_add_ps(facc[r], fmin[r]) : facc[r]);
}

static inline __m512 float_weights512(const uint8_t *p, int kind) {
    if (kind == KIND_F32) return _mm512_loadu_ps((const float *)p);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    if (kind == KIND_F16) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Float rows with 512-bit vectors: half_dot_float's operations on all 16 outputs at once. */
static inline __attribute__((always_inline)) void tile_dot_float(
    const uint8_t *w, int kind, const xquant *xq, int r0, int rb, float out[][TILE]) {
    const size_t ew = float_width(kind), tb = (size_t)QK * TILE * ew;
    __m512 even[MAXRB], odd[MAXRB];
    for (int r = 0; r < rb; r++) even[r] = odd[r] = _mm512_setzero_ps();
    const int K = xq->Kin;
    for (int i = 0; i < K; i += 2) {
        if (i % 32 == 0) prefetch_part(w + (size_t)(i / QK) * tb, tb, (i % QK) / 32, 8);
        const __m512 w0 = float_weights512(w + (size_t)i * TILE * ew, kind);
        const __m512 w1 = i + 1 < K ? float_weights512(w + (size_t)(i + 1) * TILE * ew, kind) : _mm512_setzero_ps();
        for (int r = 0; r < rb; r++) {
            const float *x = xq->x + (size_t)(r0 + r) * xq->ld;
            even[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[i]), even[r]);
            if (i + 1 < K) odd[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[i + 1]), odd[r]);
        }
    }
    for (int r = 0; r < rb; r++) _mm512_storeu_ps(out[r], _mm512_add_ps(even[r], odd[r]));
}
#else

static inline __attribute__((always_inline)) void tile_dot_legacy(
    const uint8_t *w, int bits, int has_min, const xquant *xq, int r0, int rb, float out[][TILE]) {
    half_dot_legacy(w, bits, has_min, xq, r0, rb, 0, out);
    half_dot_legacy(w, bits, has_min, xq, r0, rb, 1, out);
}

static inline __attribute__((always_inline)) void tile_dot_float(
    const uint8_t *w, int kind, const xquant *xq, int r0, int rb, float out[][TILE]) {
    half_dot_float(w, kind, xq, r0, rb, 0, out);
    half_dot_float(w, kind, xq, r0, rb, 1, out);
}

static inline __attribute__((always_inline)) void tile_dot_q6k(
    const tile_q6k *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    half_dot_q6k(w, xq, r0, rb, 0, out);
    half_dot_q6k(w, xq, r0, rb, 1, out);
}

static inline __attribute__((always_inline)) void tile_dot_k(
    const uint8_t *w, int bits, const xquant *xq, int r0, int rb, float out[][TILE]) {
    half_dot_k(w, bits, xq, r0, rb, 0, out);
    half_dot_k(w, bits, xq, r0, rb, 1, out);
}
#endif

/* One function per kind, its bits a constant (the row counts fixed at compile time, as DISPATCH does). */
static inline __attribute__((always_inline)) void tile_dot_q4k(const uint8_t *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    tile_dot_k(w, 4, xq, r0, rb, out);
}
static inline __attribute__((always_inline)) void tile_dot_q3(const uint8_t *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    tile_dot_k(w, 3, xq, r0, rb, out);
}
static inline __attribute__((always_inline)) void tile_dot_q2(const uint8_t *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    tile_dot_k(w, 2, xq, r0, rb, out);
}
static inline __attribute__((always_inline)) void tile_dot_q5k(const uint8_t *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    tile_dot_k(w, 5, xq, r0, rb, out);
}
#define LEGACY_FN(name, bits, has_min)                                                                  \
    static inline __attribute__((always_inline)) void name(const uint8_t *w, const xquant *xq, int r0, int rb, \
                                                           float out[][TILE]) {                           \
        tile_dot_legacy(w, bits, has_min, xq, r0, rb, out);                                             \
    }
LEGACY_FN(tile_dot_q4_0, 4, 0)
LEGACY_FN(tile_dot_q4_1, 4, 1)
LEGACY_FN(tile_dot_q5_0, 5, 0)
LEGACY_FN(tile_dot_q5_1, 5, 1)
LEGACY_FN(tile_dot_q8_0, 8, 0)
#undef LEGACY_FN
#define FLOAT_FN(name, kind)                                                                            \
    static inline __attribute__((always_inline)) void name(const uint8_t *w, const xquant *xq, int r0, int rb, \
                                                           float out[][TILE]) {                           \
        tile_dot_float(w, kind, xq, r0, rb, out);                                                       \
    }
FLOAT_FN(tile_dot_f16, KIND_F16)
FLOAT_FN(tile_dot_bf16, KIND_BF16)
FLOAT_FN(tile_dot_f32, KIND_F32)
#undef FLOAT_FN


#ifdef SPECDEC_AMX
#define AMX_ROWS 16  /* activation rows per tile multiply */

static int amx_on = 0;  /* set by specdec_amx_enable once the OS granted the tile state */

/* Tile configuration: tmm0 = C [rb x 16 int32], tmm1/tmm2 = A/B for a q4k group (32 inputs),
 * tmm3/tmm4 = A/B for a q6k sub-block (16 inputs). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

#ifdef SPECDEC_AMX_EMULATE
/* A scalar model of the six tile instructions this file uses, as the Intel SDM defines them
 * (a load fills `rows` rows of `colsb` bytes from a strided source and zeroes the rest; tdpbssd
 * adds, for each C row m and int32 column n, the products of A row m's signed bytes 4k..4k+3
 * with B row k's signed bytes 4n..4n+3). The build with -DSPECDEC_AMX_EMULATE runs the AMX
 * path's own code (layouts, strides, row counts, configuration) through it on any AVX-512
 * CPU, so that path is tested where no AMX exists. Tests only: it is slow. */
static __thread struct {
    tilecfg cfg;
    uint8_t t[8][16][64];
} emu;

static void emu_loadconfig(const tilecfg *c) { emu.cfg = *c; }
static void emu_zero(int t) { memset(emu.t[t], 0, sizeof(emu.t[t])); }
static void emu_loadd(int t, const void *src, size_t stride) {
    emu_zero(t);
    for (int m = 0; m < emu.cfg.rows[t]; m++) memcpy(emu.t[t][m], (const char *)src + m * stride, emu.cfg.colsb[t]);
}
static void emu_stored(int t, void *dst, size_t stride) {
    for (int m = 0; m < emu.cfg.rows[t]; m++) memcpy((char *)dst + m * stride, emu.t[t][m], emu.cfg.colsb[t]);
}
static void emu_dpbssd(int c, int a, int b) {
    for (int m = 0; m < emu.cfg.rows[c]; m++)
        for (int n = 0; n < emu.cfg.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &emu.t[c][m][4 * n], 4);
            for (int k = 0; k < emu.cfg.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
#ifdef SPECDEC_AMX_EMULATE_TDPBUSD /* a test's negative control: A's bytes read unsigned */
                    acc += (int32_t)emu.t[a][m][4 * k + i] * (int32_t)(int8_t)emu.t[b][k][4 * n + i];
#else
                    acc += (int32_t)(int8_t)emu.t[a][m][4 * k + i] * (int32_t)(int8_t)emu.t[b][k][4 * n + i];
#endif
            memcpy(&emu.t[c][m][4 * n], &acc, 4);
        }
}
#define TILE_LOADCONFIG(cfg) emu_loadconfig(cfg)
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOADD(t, src, stride) emu_loadd(t, src, stride)
#define TILE_STORED(t, dst, stride) emu_stored(t, dst, stride)
#define TILE_DPBSSD(c, a, b) emu_dpbssd(c, a, b)
#define TILE_RELEASE() ((void)0)

int specdec_amx_enable(int on) {
    amx_on = on != 0;
    return 0;
}
#else
#define TILE_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOADD(t, src, stride) _tile_loadd(t, src, stride)
#define TILE_STORED(t, dst, stride) _tile_stored(t, dst, stride)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_RELEASE() _tile_release()

/* Ask Linux for the tile data state (needed once per process before any tile instruction),
 * then enable or disable the AMX path. Returns 0, or -1 where the OS refuses. */
int specdec_amx_enable(int on) {
    if (!on) {
        amx_on = 0;
        return 0;
    }
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return -1;
    amx_on = 1;
    return 0;
}
#endif

static void amx_config(int rb) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)rb; cfg.colsb[0] = 64;
    cfg.rows[1] = (uint8_t)rb; cfg.colsb[1] = 32;
    cfg.rows[2] = 8;           cfg.colsb[2] = 64;
    cfg.rows[3] = (uint8_t)rb; cfg.colsb[3] = 16;
    cfg.rows[4] = 4;           cfg.colsb[4] = 64;
    TILE_LOADCONFIG(&cfg);
}

static void amx_tile_q4k(const tile_q4k *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    __attribute__((aligned(64))) int32_t cbuf[AMX_ROWS][TILE];
    __attribute__((aligned(64))) uint8_t bbuf[8][64];
    __m512 facc[AMX_ROWS], fmin[AMX_ROWS];
    for (int r = 0; r < rb; r++) facc[r] = fmin[r] = _mm512_setzero_ps();
    amx_config(rb);
    for (int b = 0; b < xq->nb; b++) {
        const tile_q4k *t = w + b;
        __m512i iacc[AMX_ROWS], imin[AMX_ROWS];
        for (int r = 0; r < rb; r++) iacc[r] = imin[r] = _mm512_setzero_si512();
        q4k_mins512(t, xq, r0, rb, b, imin);
        for (int j = 0; j < 8; j++) {
            prefetch_part(t, sizeof(tile_q4k), j, 8);
            __m512i c[8];  /* the group's 8 code vectors: B in VNNI layout */
            codes512(t, 4, j, c);
            for (int v = 0; v < 8; v++) _mm512_store_si512((void *)bbuf[v], c[v]);
            TILE_ZERO(0);
            TILE_LOADD(1, xq->q + (size_t)r0 * xq->K + (size_t)b * QK + 32 * j, xq->K);
            TILE_LOADD(2, bbuf, 64);
            TILE_DPBSSD(0, 1, 2);
            TILE_STORED(0, cbuf, 64);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)t->sc[j]));
            for (int r = 0; r < rb; r++)
                iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(_mm512_load_si512((const void *)cbuf[r]), sc));
        }
        block_fma512(t->d, xq, r0, rb, b, iacc, facc);
        block_fma512(t->dmin, xq, r0, rb, b, imin, fmin);
    }
    TILE_RELEASE();
    for (int r = 0; r < rb; r++) _mm512_storeu_ps(out[r], _mm512_sub_ps(facc[r], fmin[r]));
}

static void amx_tile_q6k(const tile_q6k *w, const xquant *xq, int r0, int rb, float out[][TILE]) {
    __attribute__((aligned(64))) int32_t cbuf[AMX_ROWS][TILE];
    __attribute__((aligned(64))) uint8_t bbuf[4][64];
    __m512 facc[AMX_ROWS];
    for (int r = 0; r < rb; r++) facc[r] = _mm512_setzero_ps();
    amx_config(rb);
    for (int b = 0; b < xq->nb; b++) {
        const tile_q6k *t = w + b;
        __m512i iacc[AMX_ROWS];
        for (int r = 0; r < rb; r++) iacc[r] = _mm512_setzero_si512();
        for (int s = 0; s < 16; s++) {
            prefetch_part(t, sizeof(tile_q6k), s, 16);
            const __m512i l0 = _mm512_loadu_si512((const void *)t->sub[s].ql[0]);
            const __m512i l1 = _mm512_loadu_si512((const void *)t->sub[s].ql[1]);
            const __m512i hb = _mm512_loadu_si512((const void *)t->sub[s].qh);
            _mm512_store_si512((void *)bbuf[0], q6_codes512(l0, 0, hb, 0));
            _mm512_store_si512((void *)bbuf[1], q6_codes512(l0, 1, hb, 1));
            _mm512_store_si512((void *)bbuf[2], q6_codes512(l1, 0, hb, 2));
            _mm512_store_si512((void *)bbuf[3], q6_codes512(l1, 1, hb, 3));
            TILE_ZERO(0);
            TILE_LOADD(3, xq->q + (size_t)r0 * xq->K + (size_t)b * QK + 16 * s, xq->K);
            TILE_LOADD(4, bbuf, 64);
            TILE_DPBSSD(0, 3, 4);
            TILE_STORED(0, cbuf, 64);
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)t->sc[s]));
            for (int r = 0; r < rb; r++) {
                const size_t rbk = (size_t)(r0 + r) * xq->nb + b;
                const __m512i g = _mm512_add_epi32(_mm512_load_si512((const void *)cbuf[r]),
                                                   _mm512_set1_epi32(-32 * xq->s16[rbk * 16 + s]));
                iacc[r] = _mm512_add_epi32(iacc[r], _mm512_mullo_epi32(g, sc));
            }
        }
        block_fma512(t->d, xq, r0, rb, b, iacc, facc);
    }
    TILE_RELEASE();
    for (int r = 0; r < rb; r++) _mm512_storeu_ps(out[r], facc[r]);
}
#else
int specdec_amx_enable(int on) { return on ? -1 : 0; }  /* this build has no AMX path */
#endif

#ifdef SPECDEC_AMX
#define AMX_OUT_ROWS AMX_ROWS
#else
#define AMX_OUT_ROWS MAXRB
#endif

#define DISPATCH(fn, w, xq, r0, rb, out)                  \
    switch (rb) {                                         \
    case 1: fn(w, xq, r0, 1, out); break;                 \
    case 2: fn(w, xq, r0, 2, out); break;                 \
    case 3: fn(w, xq, r0, 3, out); break;                 \
    case 4: fn(w, xq, r0, 4, out); break;                 \
    case 5: fn(w, xq, r0, MAXRB > 4 ? 5 : 4, out); break; \
    case 6: fn(w, xq, r0, MAXRB > 4 ? 6 : 4, out); break; \
    case 7: fn(w, xq, r0, MAXRB > 4 ? 7 : 4, out); break; \
    default: fn(w, xq, r0, MAXRB, out); break;            \
    }

size_t specdec_xquant_layout(xquant *xq, int M, int K, char *base) {
    xq->nb = (K + QK - 1) / QK;
    xq->K = xq->nb * QK;
    xq->Kin = K;
    xq->x = NULL;
    xq->ld = K;
    size_t at = 0;
#define TAKE(ptr, type, count) SPECDEC_TAKE(base, at, ptr, type, count)
    TAKE(xq->q, int8_t, (size_t)M * xq->K);
    TAKE(xq->a, float, (size_t)M * xq->nb);
    TAKE(xq->s32, int16_t, (size_t)M * xq->nb * 8);
    TAKE(xq->s16, int16_t, (size_t)M * xq->nb * 16);
#undef TAKE
    return at;
}

void specdec_quantize_team(const float *x, int M, int K, xquant *xq) {
    #pragma omp master
    {
        xq->x = x;  /* (read after the loop's barrier) */
        xq->ld = K;
    }
    /* rows are quantized independently, so splitting them among threads changes nothing */
    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++) specdec_quantize_row(x + (size_t)r * K, r, K, xq);
}

void specdec_linears_team(int n_layers, const int *kinds, const void *const *w, const float *const *bias,
                          const int *N, const xquant *xq, int M, float *const *y, const float *const *add) {
    int first[17];  /* first tile of each layer in the joint tile numbering (n_layers <= 16) */
    first[0] = 0;
    for (int i = 0; i < n_layers; i++) first[i + 1] = first[i] + (N[i] + TILE - 1) / TILE;
    const int tiles = first[n_layers];
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int i = 0;
        while (t >= first[i + 1]) i++;
        const size_t tile_bytes = (size_t)xq->nb * tile_size(kinds[i]);
        const void *wt = (const char *)w[i] + (size_t)(t - first[i]) * tile_bytes;
        const int n0 = (t - first[i]) * TILE, nv = N[i] - n0 < TILE ? N[i] - n0 : TILE;
        const float *res = add ? add[i] : NULL;
        /* The AMX path takes whole sweeps of 16 rows only: a tile multiply over fewer rows
         * costs nearly as much as over 16: on an AMX Xeon it lost to the AVX-512 path at 2-12
         * rows and won at 16 (docs/results.md, 2026-12-05).
         * The rows left over (and every call under 16 rows: decoding, verification) go to the
         * AVX-512 path, split evenly over its sweeps (9 rows: 5 + 4, not 8 + 1), so every sweep
         * carries enough rows to hide the weights' memory time. (other kinds: AVX-512) */
#ifdef SPECDEC_AMX
        const int amx_kind = kinds[i] == KIND_Q4K || kinds[i] == KIND_Q6K;
        const int amx_rows = amx_on && amx_kind ? M / AMX_ROWS * AMX_ROWS : 0, amx_step = AMX_ROWS;
#else
        const int amx_rows = 0, amx_step = 0;
#endif
        const int rest = M - amx_rows, sweeps = rest > 0 ? (rest + MAXRB - 1) / MAXRB : 1;
        const int step = (rest + sweeps - 1) / sweeps;
        for (int r0 = 0; r0 < M; r0 += r0 < amx_rows ? amx_step : step) {
            const int rb = r0 < amx_rows ? amx_step : M - r0 < step ? M - r0 : step;
            float out[AMX_OUT_ROWS][TILE];
#ifdef SPECDEC_AMX
            if (r0 < amx_rows) {
                if (kinds[i] == KIND_Q4K) amx_tile_q4k((const tile_q4k *)wt, xq, r0, rb, out);
                else amx_tile_q6k((const tile_q6k *)wt, xq, r0, rb, out);
            } else
#endif
            {
                const uint8_t *wb = (const uint8_t *)wt;
                switch (kinds[i]) {
                case KIND_Q4K: DISPATCH(tile_dot_q4k, wb, xq, r0, rb, out); break;
                case KIND_Q6K: DISPATCH(tile_dot_q6k, (const tile_q6k *)wt, xq, r0, rb, out); break;
                case KIND_Q5K: DISPATCH(tile_dot_q5k, wb, xq, r0, rb, out); break;
                case KIND_Q3: DISPATCH(tile_dot_q3, wb, xq, r0, rb, out); break;
                case KIND_Q2: DISPATCH(tile_dot_q2, wb, xq, r0, rb, out); break;
                case KIND_Q4_0: DISPATCH(tile_dot_q4_0, wb, xq, r0, rb, out); break;
                case KIND_Q5_0: DISPATCH(tile_dot_q5_0, wb, xq, r0, rb, out); break;
                case KIND_Q8_0: DISPATCH(tile_dot_q8_0, wb, xq, r0, rb, out); break;
                /* the rarer kinds: one copy with the row count at run time (the same
                 * operations per row; a copy per row count would double the build's time) */
                case KIND_Q4_1: tile_dot_q4_1(wb, xq, r0, rb, out); break;
                case KIND_Q5_1: tile_dot_q5_1(wb, xq, r0, rb, out); break;
                case KIND_F16: tile_dot_f16(wb, xq, r0, rb, out); break;
                case KIND_BF16: tile_dot_bf16(wb, xq, r0, rb, out); break;
                default: tile_dot_f32(wb, xq, r0, rb, out); break;
                }
            }
            /* y = out + bias, plus a residual connection (x + layer(x)) where given: one
             * branch-free loop per case, which the compiler vectorizes (elementwise, so the
             * same bits at any vector width) */
            const float *bi = bias[i] ? bias[i] + n0 : NULL;
            for (int r = 0; r < rb; r++) {
                const size_t row = (size_t)(r0 + r) * N[i] + n0;
                float *yr = y[i] + row;
                const float *o_ = out[r], *rr = res ? res + row : NULL;
                if (bi && rr) for (int o = 0; o < nv; o++) yr[o] = rr[o] + (o_[o] + bi[o]);
                else if (bi) for (int o = 0; o < nv; o++) yr[o] = o_[o] + bi[o];
                else if (rr) for (int o = 0; o < nv; o++) yr[o] = rr[o] + o_[o];
                else memcpy(yr, o_, sizeof(float) * (size_t)nv);
            }
        }
    }
}

/* Several linear layers over the same input x[M, K] (q/k/v, gate/up): the activations
 * are quantized once, and one parallel loop runs over the tiles of all of them.
 * Layer i: kinds[i] (KIND_*, specdec.h), w[i] = ceil(N[i]/16) tiles of ceil(K/256) tile-blocks,
 * bias[i] (or NULL), y[i] = [M, N[i]]. Returns 0, or -1 if scratch memory ran out. */
int specdec_kquant_linears(int n_layers, const int *kinds, const void *const *w, const float *const *bias,
                           const int *N, int K, const float *x, int M, float *const *y, int nthreads) {
    xquant xq;
    char *buf = n_layers > 16 ? NULL : malloc(specdec_xquant_layout(&xq, M, K, NULL));
    if (!buf) return -1;
    specdec_xquant_layout(&xq, M, K, buf);
    #pragma omp parallel num_threads(nthreads)
    {
        specdec_quantize_team(x, M, K, &xq);
        specdec_linears_team(n_layers, kinds, w, bias, N, &xq, M, y, NULL);
    }
    free(buf);
    return 0;
}

/* -- repacking blocks into tiles -----------------------------------------------------------------
 *
 * specdec.model.kquant.tiles_reference does this in numpy (the definition, with the layout
 * spelled out as array transposes); this is the same byte shuffle, tested equal.
 * Blocks in GGUF-like layout (kquant.Q4K_DTYPE / Q6K_DTYPE): */
typedef struct {
    float d, dmin;
    uint8_t sc[8], mn[8];
    uint8_t qs[128];   /* pair p of groups, l < 32: group 2p in the low nibbles, 2p+1 in the high */
} block_q4k;

typedef struct {
    float d;
    int8_t sc[16];
    uint8_t ql[128];   /* half h, l < 32: low nibbles of groups 0 and 2; l >= 32: of groups 1 and 3 */
    uint8_t qh[64];    /* half h: top two bits of groups 0..3 at bits 0, 2, 4, 6 */
} block_q6k;

_Static_assert(sizeof(block_q4k) == 152, "q4k block layout");
_Static_assert(sizeof(block_q6k) == 212, "q6k block layout");

/* code of weight i (0..255) of a block */
static inline int q4k_code(const block_q4k *b, int i) {
    const int g = i / 32;
    return (b->qs[32 * (g / 2) + i % 32] >> (4 * (g % 2))) & 0xF;
}

static inline int q6k_code(const block_q6k *b, int i) {
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;
    const int lo = (b->ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 0xF;
    return lo | (((b->qh[32 * h + l] >> (2 * g)) & 3) << 4);
}

/* blocks: [n, nb] of the kind's block type; out: [ceil(n/16), nb] tiles (outputs past n zero). */
void specdec_tiles(int kind, const void *blocks, int64_t n, int64_t nb, void *out, int nthreads) {
    const int64_t T = (n + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t tj = 0; tj < T * nb; tj++) {
        const int64_t t = tj / nb, j = tj % nb;
        if (kind == 4) {
            tile_q4k *o = (tile_q4k *)out + tj;
            memset(o, 0, sizeof(*o));
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const block_q4k *b = (const block_q4k *)blocks + (t * TILE + r) * nb + j;
                o->d[r] = b->d;
                o->dmin[r] = b->dmin;
                for (int g = 0; g < 8; g++) o->sc[g][r] = b->sc[g];
                for (int p = 0; p < 4; p++) o->mn[p][r][0] = b->mn[2 * p], o->mn[p][r][1] = b->mn[2 * p + 1];
                /* qs[g][v][4r + e]: weight 32g + 4v + e in the low nibble, 32g + 16 + 4v + e in the high */
                for (int g = 0; g < 8; g++)
                    for (int v = 0; v < 4; v++)
                        for (int e = 0; e < 4; e++)
                            o->qs[g][v][4 * r + e] = (uint8_t)(q4k_code(b, 32 * g + 4 * v + e)
                                                               | (q4k_code(b, 32 * g + 16 + 4 * v + e) << 4));
            }
        } else {
            tile_q6k *o = (tile_q6k *)out + tj;
            memset(o, 0, sizeof(*o));
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const block_q6k *b = (const block_q6k *)blocks + (t * TILE + r) * nb + j;
                o->d[r] = b->d;
                for (int s = 0; s < 16; s++) {
                    o->sc[s][r] = b->sc[s];
                    for (int e = 0; e < 4; e++) {  /* chunk c of sub-block s: weights 16s + 4c + e */
                        const int c0 = q6k_code(b, 16 * s + e), c1 = q6k_code(b, 16 * s + 4 + e);
                        const int c2 = q6k_code(b, 16 * s + 8 + e), c3 = q6k_code(b, 16 * s + 12 + e);
                        o->sub[s].ql[0][4 * r + e] = (uint8_t)((c0 & 0xF) | ((c1 & 0xF) << 4));
                        o->sub[s].ql[1][4 * r + e] = (uint8_t)((c2 & 0xF) | ((c3 & 0xF) << 4));
                        o->sub[s].qh[4 * r + e] = (uint8_t)((c0 >> 4) | ((c1 >> 4) << 2) | ((c2 >> 4) << 4) | ((c3 >> 4) << 6));
                    }
                }
            }
        }
    }
}

/* -- repacking the file's own blocks (Q5_K, the 32-weight types, float rows) into tiles ----------
 *
 * specdec.model.kquant._tiles_raw does this in numpy (the definition); this is the same byte
 * shuffle, tested equal. raw: [n rows, nblk file blocks] of the kind's GGUF blocks (floats: nblk
 * = K elements); out: [ceil(n/16), ceil(K/256)] tiles, outputs and inputs past the layer zero. */
static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* the 32 codes of one 32-weight block, unsigned (q8_0: the file's signed bytes as they are) */
static void legacy_codes(int kind, const uint8_t *b, uint8_t q[32]) {
    if (kind == KIND_Q8_0) {
        memcpy(q, b + 2, 32);
        return;
    }
    const int has_min = kind == KIND_Q4_1 || kind == KIND_Q5_1, five = kind == KIND_Q5_0 || kind == KIND_Q5_1;
    const uint8_t *qs = b + 2 + 2 * has_min;
    uint32_t qh = 0;
    if (five) {
        memcpy(&qh, qs, 4);
        qs += 4;
    }
    for (int j = 0; j < 32; j++) {
        q[j] = (uint8_t)(j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4));
        if (five) q[j] |= (uint8_t)(((qh >> j) & 1) << 4);
    }
}

/* group j's code vectors in a tile (4/5 bits: low nibbles chunk v, high chunk v + 4; 5 bits: qh
 * bit c = chunk c's fifth bit; 8 bits: one byte each), output r's 32 codes q */
static void put_group(uint8_t *g, int bits, int r, const uint8_t q[32]) {
    for (int e = 0; e < 4; e++) {
        if (bits == 8) {
            for (int c = 0; c < 8; c++) g[64 * c + 4 * r + e] = q[4 * c + e];
            continue;
        }
        for (int v = 0; v < 4; v++) g[64 * v + 4 * r + e] = (uint8_t)((q[4 * v + e] & 0xF) | ((q[4 * (v + 4) + e] & 0xF) << 4));
        if (bits == 5) {
            uint8_t h = 0;
            for (int c = 0; c < 8; c++) h |= (uint8_t)(((q[4 * c + e] >> 4) & 1) << c);
            g[256 + 4 * r + e] = h;
        }
    }
}

int specdec_tiles_raw(int kind, const uint8_t *raw, int64_t n, int64_t nblk, void *out, int nthreads) {
    const size_t tb = tile_size(kind);
    if (!tb || kind == KIND_Q4K || kind == KIND_Q6K || kind == KIND_Q3 || kind == KIND_Q2) return -1;
    const int is_float = kind == KIND_F16 || kind == KIND_BF16 || kind == KIND_F32;
    const int per = is_float ? 1 : kind == KIND_Q5K ? 256 : 32;            /* weights per file block */
    const int bytes = is_float ? (int)float_width(kind) : kind == KIND_Q5K ? 176
                      : kind == KIND_Q8_0 ? 34 : kind == KIND_Q4_0 ? 18 : kind == KIND_Q4_1 ? 20 : kind == KIND_Q5_0 ? 22 : 24;
    const int64_t K = nblk * per, nb = (K + QK - 1) / QK, T = (n + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t tj = 0; tj < T * nb; tj++) {
        const int64_t t = tj / nb, b = tj % nb;
        uint8_t *o = (uint8_t *)out + tj * tb;
        memset(o, 0, tb);
        for (int r = 0; r < TILE && t * TILE + r < n; r++) {
            const uint8_t *row = raw + (t * TILE + r) * nblk * bytes;
            if (is_float) {
                const int w = bytes;
                for (int i = 0; i < QK && b * QK + i < K; i++) memcpy(o + ((size_t)i * TILE + r) * w, row + (b * QK + i) * w, w);
            } else if (kind == KIND_Q5K) {
                const uint8_t *blk = row + b * 176, *qh = blk + 16, *qs = blk + 48;
                tile_q5k *q5 = (tile_q5k *)o;
                q5->d[r] = _cvtsh_ss(rd16(blk));
                q5->dmin[r] = _cvtsh_ss(rd16(blk + 2));
                const uint8_t *sb = blk + 4;  /* 12 bytes of 6-bit scales and mins, as Q4_K's */
                for (int g = 0; g < 8; g++) {
                    const int sc = g < 4 ? sb[g] & 63 : (sb[g + 4] & 0xF) | ((sb[g - 4] >> 6) << 4);
                    const int mn = g < 4 ? sb[g + 4] & 63 : (sb[g + 4] >> 4) | ((sb[g] >> 6) << 4);
                    q5->sc[g][r] = (uint8_t)sc;
                    q5->mn[g / 2][r][g % 2] = (uint8_t)mn;
                    uint8_t q[32];
                    for (int l = 0; l < 32; l++)
                        q[l] = (uint8_t)(((qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xF) | (((qh[l] >> g) & 1) << 4));
                    put_group((uint8_t *)&q5->g[g], 5, r, q);
                }
            } else {
                const int has_min = kind == KIND_Q4_1 || kind == KIND_Q5_1;
                const int bits = kind == KIND_Q8_0 ? 8 : (kind == KIND_Q5_0 || kind == KIND_Q5_1) ? 5 : 4;
                uint16_t *d16 = (uint16_t *)o, *m16 = d16 + 8 * TILE;
                for (int j = 0; j < 8 && b * 8 + j < nblk; j++) {
                    const uint8_t *blk = row + (b * 8 + j) * bytes;
                    d16[TILE * j + r] = rd16(blk);
                    if (has_min) m16[TILE * j + r] = rd16(blk + 2);
                    uint8_t q[32];
                    legacy_codes(kind, blk, q);
                    put_group(o + legacy_head(has_min) + j * legacy_group(bits), bits, r, q);
                }
            }
        }
    }
    return 0;
}

/* -- quantizing float weights to Q6_K ---------------------------------------------------------
 *
 * Layers a GGUF stores in other types (Q5_0, Q8_0, Q4_1...) are de-quantized and rounded to
 * Q6_K blocks at install. specdec.model.kquant.quantize_reference does it in numpy; this is the
 * same float32 operations in the same order (a division, a product, round-half-to-even, a
 * clip: each exactly rounded, nothing summed), so both give the same bytes (tested). */

/* numpy's max: a NaN anywhere makes the result NaN */
static inline float max_nan(float m, float v) { return (m != m) ? m : ((v > m || v != v) ? v : m); }

/* w: [n, K] float32, K a multiple of 256 (zero-padded by the caller); out: [n, K/256] blocks.
 * Rows are independent, so the thread count changes nothing. */
void specdec_quantize_q6k(const float *w, int64_t n, int64_t K, void *out, int nthreads) {
    const int64_t nb = K / QK;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *x = w + r * K + b * QK;
            block_q6k *blk = (block_q6k *)out + r * nb + b;
            float s[16];
            for (int g = 0; g < 16; g++) {  /* s = |g|.max() / 31: each group's step */
                float m = fabsf(x[16 * g]);
                for (int i = 1; i < 16; i++) m = max_nan(m, fabsf(x[16 * g + i]));
                s[g] = m / 31.0f;
            }
            float smax = s[0];
            for (int g = 1; g < 16; g++) smax = max_nan(smax, s[g]);
            const float d = smax / 127.0f;  /* the block's scale of the group scales */
            uint8_t q[QK];
            for (int g = 0; g < 16; g++) {
                float sc = 0.0f;
                if (d > 0) {
                    sc = rintf(s[g] / d);
                    sc = sc < 0.0f ? 0.0f : (sc > 127.0f ? 127.0f : sc);
                }
                blk->sc[g] = (int8_t)sc;
                const float step = d * sc;
                for (int i = 0; i < 16; i++) {
                    float v = step > 0 ? rintf(x[16 * g + i] / step) : 0.0f;
                    v = v < -32.0f ? -32.0f : (v > 31.0f ? 31.0f : v);
                    q[16 * g + i] = (uint8_t)(int)(v + 32.0f);
                }
            }
            blk->d = d;
            for (int h = 0; h < 2; h++) {
                const uint8_t *qq = q + 128 * h;  /* element 32 * group + l of this half */
                for (int l = 0; l < 32; l++) {
                    blk->ql[64 * h + l] = (uint8_t)((qq[l] & 0xF) | ((qq[64 + l] & 0xF) << 4));
                    blk->ql[64 * h + 32 + l] = (uint8_t)((qq[32 + l] & 0xF) | ((qq[96 + l] & 0xF) << 4));
                    blk->qh[32 * h + l] = (uint8_t)((qq[l] >> 4) | ((qq[32 + l] >> 4) << 2) | ((qq[64 + l] >> 4) << 4)
                                                    | ((qq[96 + l] >> 4) << 6));
                }
            }
        }
    }
}

/* -- de-quantizing GGUF's legacy 32-weight types ---------------------------------------------------
 *
 * Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks to float32, as the gguf package's numpy de-quantizer
 * (which transformers uses) computes them: the f16 scales widened exactly, then one product
 * (and for _1 types one sum) per weight, so the floats are the same bits (tested).
 * type: GGML's type number; raw: n_blocks blocks; out: n_blocks * 32 floats. Returns 0, or -1
 * for a type it does not know. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8 };

static inline float f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

int specdec_dequantize_legacy(int type, const uint8_t *raw, int64_t n_blocks, float *out, int nthreads) {
    int bytes;
    switch (type) {
    case GGML_Q4_0: bytes = 18; break;
    case GGML_Q4_1: bytes = 20; break;
    case GGML_Q5_0: bytes = 22; break;
    case GGML_Q5_1: bytes = 24; break;
    case GGML_Q8_0: bytes = 34; break;
    default: return -1;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n_blocks; i++) {
        const uint8_t *b = raw + i * bytes;
        float *y = out + i * 32;
        const float d = f16(b);
        if (type == GGML_Q8_0) {
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
            continue;
        }
        const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
        const float m = has_min ? f16(b + 2) : 0.0f;
        const uint8_t *q = b + 2 + 2 * has_min;
        uint32_t qh = 0;
        if (five) {
            memcpy(&qh, q, 4);  /* bit j: weight j's fifth bit */
            q += 4;
        }
        for (int j = 0; j < 32; j++) {  /* weights 0..15 in the low nibbles, 16..31 in the high */
            int v = j < 16 ? (q[j] & 0xF) : (q[j - 16] >> 4);
            if (five) v |= ((qh >> j) & 1) << 4;
            if (has_min) y[j] = d * (float)v + m;
            else y[j] = d * (float)(v - (five ? 16 : 8));
        }
    }
    return 0;
}
