/* Linear layers over K-quant weight blocks with int8 activations and exact integer sums.
 *
 * Weight values are those of the GGUF K-quants, in 256-element super-blocks:
 *   q4k: w = d * sc[j] * q - dmin * mn[j],  q in 0..15, j = 32-element group (8 per block)
 *   q6k: w = d * sc[s] * (q - 32),          q in 0..63, s = 16-element group (16 per block)
 * They are repacked for this kernel in tiles of 8 output features: each 32-byte vector holds
 * 4 consecutive inputs of 8 outputs, so one dot-product instruction (VNNI vpdpbusd, or
 * maddubs+madd on AVX2) adds 4 products into each of 8 output lanes for a broadcast group of
 * 4 activations. The lanes are outputs, so no horizontal sums are needed, and the decoded
 * weights are reused for up to MAXRB activation rows.
 *
 * Activations are quantized per row and per 256-block to int8 (x ~ a * xq). Inside a block
 * every product and sum is an exact integer; each block then adds d * a * isum to a per-row,
 * per-output float accumulator, blocks in order. A row's result therefore depends on that row
 * alone: bitwise the same for 1 row or 64 rows per call. That batch invariance is what makes
 * a k-token verification pass compute exactly what one-token decoding computes.
 *
 * Built at first use by specdec.model.kquant (gcc -O3 -mavx2 -mfma -fopenmp
 * -ffp-contract=off), with -DSPECDEC_VNNI where the CPU has AVX512-VNNI: the integer sums, and
 * so the results, are the same either way. -ffp-contract=off keeps the compiler from fusing
 * float operations differently in the specialised copies of the row loop.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256
#define TILE 8
/* Rows that share one decoding of the weights: as many as the vector registers hold (AVX-512
 * has 32, AVX2 16). */
#ifdef SPECDEC_VNNI
#define MAXRB 8
#else
#define MAXRB 4
#endif

typedef struct {
    float d[TILE], dmin[TILE];
    uint8_t sc[8][TILE];      /* [group][output] */
    uint8_t mn[4][TILE][2];   /* [group pair][output][2] */
    uint8_t qs[8][4][32];     /* [group][v][output*4 + e]: chunk v low nibble, chunk v+4 high */
} tile_q4k;

typedef struct {
    float d[TILE];
    int8_t sc[16][TILE];      /* [sub-block][output] */
    struct {
        uint8_t ql[2][32];    /* [w][output*4 + e]: chunk 2w in the low nibble, 2w+1 in the high */
        uint8_t qh[32];       /* [output*4 + e]: bits 2c..2c+1 = chunk c's top two bits */
    } sub[16];                /* one sub-block's codes together: a single forward stream */
} tile_q6k;

_Static_assert(sizeof(tile_q4k) == 1216, "q4k tile layout");
_Static_assert(sizeof(tile_q6k) == 1696, "q6k tile layout");

int specdec_tile_bytes(int kind) { return kind == 4 ? (int)sizeof(tile_q4k) : (int)sizeof(tile_q6k); }

#ifdef SPECDEC_VNNI
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DPWSSD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#else
/* exact here: u <= 63 and |s| <= 127, so the int16 pair sums of maddubs never saturate */
#define DPBUSD(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif

typedef struct {
    int8_t *q;      /* [M, K] codes (K padded to whole blocks) */
    float *a;       /* [M, nb] scales */
    int32_t *o16;   /* [M, nb, 16] -32 * (sum of each 16 codes): the q6k offset */
    int16_t *s32;   /* [M, nb, 8] sums of each 32 codes: the q4k min term */
    int K, nb;
} xquant;

/* x: [M, K] floats; K need not be a multiple of 256: the last block is padded with zeros
 * (the weights' padding is zero too). */
static void quantize_rows(const float *x, int M, int K, xquant *xq) {
    const int nb = xq->nb;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    float tail[QK];
    for (int r = 0; r < M; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xp = x + (size_t)r * K + (size_t)b * QK;
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
                xq->o16[rb * 16 + g] = -32 * s;
            }
            for (int g = 0; g < 8; g++) {
                int s = 0;
                for (int i = 0; i < 32; i++) s += qp[32 * g + i];
                xq->s32[rb * 8 + g] = (int16_t)s;
            }
        }
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The hardware prefetchers alone leave DRAM bandwidth unused on the 6-bit tiles' three
 * interleaved streams; asking for the tile-block after next keeps them ahead. (Prefetches of
 * addresses past the end of the weights are harmless: they never fault.) */
static inline void prefetch_ahead(const void *t, size_t bytes) {
    const char *p = (const char *)t + 2 * bytes;
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

/* One tile of 8 outputs for rows r0..r0+rb-1: out[r][o]. */
static inline __attribute__((always_inline)) void tile_dot_q4k(
    const tile_q4k *w, const xquant *xq, int r0, int rb, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 facc[MAXRB], fmin[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = fmin[r] = _mm256_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const tile_q4k *t = w + b;
        prefetch_ahead(t, sizeof(tile_q4k));
        __m256i iacc[MAXRB], imin[MAXRB];
        for (int r = 0; r < rb; r++) iacc[r] = imin[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)t->mn[p]));
            for (int r = 0; r < rb; r++) {
                int32_t pair;
                memcpy(&pair, xq->s32 + ((size_t)(r0 + r) * xq->nb + b) * 8 + 2 * p, 4);
                imin[r] = DPWSSD(imin[r], mn, _mm256_set1_epi32(pair));
            }
        }
        for (int j = 0; j < 8; j++) {
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)t->sc[j]));
            __m256i c[8];
            for (int v = 0; v < 4; v++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)t->qs[j][v]);
                c[v] = _mm256_and_si256(raw, m4);
                c[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            for (int r = 0; r < rb; r++) {
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 32 * j;
                __m256i g = _mm256_setzero_si256();
                for (int v = 0; v < 8; v++) g = DPBUSD(g, c[v], bcast4(xp + 4 * v));
                iacc[r] = _mm256_add_epi32(iacc[r], _mm256_mullo_epi32(g, sc));
            }
        }
        const __m256 d = _mm256_loadu_ps(t->d), dmin = _mm256_loadu_ps(t->dmin);
        for (int r = 0; r < rb; r++) {
            const __m256 a = _mm256_set1_ps(xq->a[(size_t)(r0 + r) * xq->nb + b]);
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(d, a), facc[r]);
            fmin[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(dmin, a), fmin[r]);
        }
    }
    for (int r = 0; r < rb; r++) out[r] = _mm256_sub_ps(facc[r], fmin[r]);
}

static inline __attribute__((always_inline)) void tile_dot_q6k(
    const tile_q6k *w, const xquant *xq, int r0, int rb, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    __m256 facc[MAXRB];
    for (int r = 0; r < rb; r++) facc[r] = _mm256_setzero_ps();
    for (int b = 0; b < xq->nb; b++) {
        const tile_q6k *t = w + b;
        prefetch_ahead(t, sizeof(tile_q6k));
        __m256i iacc[MAXRB];
        for (int r = 0; r < rb; r++) iacc[r] = _mm256_setzero_si256();
        for (int s = 0; s < 16; s++) {
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)t->sc[s]));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)t->sub[s].ql[0]);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)t->sub[s].ql[1]);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)t->sub[s].qh);
            __m256i c[4];
            c[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
            c[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
            c[2] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
            c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
            for (int r = 0; r < rb; r++) {
                const size_t rbk = (size_t)(r0 + r) * xq->nb + b;
                const int8_t *xp = xq->q + (size_t)(r0 + r) * xq->K + (size_t)b * QK + 16 * s;
                /* two independent chains: the dot-product latency, not its throughput, bounds one row */
                __m256i g0 = DPBUSD(_mm256_set1_epi32(xq->o16[rbk * 16 + s]), c[0], bcast4(xp));
                __m256i g1 = DPBUSD(_mm256_setzero_si256(), c[1], bcast4(xp + 4));
                g0 = DPBUSD(g0, c[2], bcast4(xp + 8));
                g1 = DPBUSD(g1, c[3], bcast4(xp + 12));
                iacc[r] = _mm256_add_epi32(iacc[r], _mm256_mullo_epi32(_mm256_add_epi32(g0, g1), sc));
            }
        }
        const __m256 d = _mm256_loadu_ps(t->d);
        for (int r = 0; r < rb; r++) {
            const __m256 a = _mm256_set1_ps(xq->a[(size_t)(r0 + r) * xq->nb + b]);
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(d, a), facc[r]);
        }
    }
    for (int r = 0; r < rb; r++) out[r] = facc[r];
}

#define DISPATCH(fn, w, xq, r0, rb, out)               \
    switch (rb) {                                      \
    case 1: fn(w, xq, r0, 1, out); break;              \
    case 2: fn(w, xq, r0, 2, out); break;              \
    case 3: fn(w, xq, r0, 3, out); break;              \
    case 4: fn(w, xq, r0, 4, out); break;              \
    case 5: fn(w, xq, r0, MAXRB > 4 ? 5 : 4, out); break; \
    case 6: fn(w, xq, r0, MAXRB > 4 ? 6 : 4, out); break; \
    case 7: fn(w, xq, r0, MAXRB > 4 ? 7 : 4, out); break; \
    default: fn(w, xq, r0, MAXRB, out); break;         \
    }

/* y[M, N] = x[M, K] @ W^T (+ bias). kind: 4 = q4k, 6 = q6k; w: ceil(N/8) tiles of
 * ceil(K/256) tile-blocks. Returns 0, or -1 if scratch memory could not be allocated. */
int specdec_kquant_linear(int kind, const void *w, const float *bias, int N, int K,
                          const float *x, int M, float *y, int nthreads) {
    xquant xq;
    xq.nb = (K + QK - 1) / QK;
    xq.K = xq.nb * QK;
    xq.q = malloc((size_t)M * xq.K);
    xq.a = malloc(sizeof(float) * (size_t)M * xq.nb);
    xq.o16 = malloc(sizeof(int32_t) * (size_t)M * xq.nb * 16);
    xq.s32 = malloc(sizeof(int16_t) * (size_t)M * xq.nb * 8);
    if (!xq.q || !xq.a || !xq.o16 || !xq.s32) {
        free(xq.q); free(xq.a); free(xq.o16); free(xq.s32);
        return -1;
    }
    quantize_rows(x, M, K, &xq);
    const int tiles = (N + TILE - 1) / TILE;
    const size_t tile_bytes = (size_t)xq.nb * (kind == 4 ? sizeof(tile_q4k) : sizeof(tile_q6k));
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int t = 0; t < tiles; t++) {
        const void *wt = (const char *)w + (size_t)t * tile_bytes;
        const int n0 = t * TILE, nv = N - n0 < TILE ? N - n0 : TILE;
        float bt[TILE] = {0};
        if (bias) memcpy(bt, bias + n0, sizeof(float) * nv);
        const __m256 bv = _mm256_loadu_ps(bt);
        for (int r0 = 0; r0 < M; r0 += MAXRB) {
            const int rb = M - r0 < MAXRB ? M - r0 : MAXRB;
            __m256 out[MAXRB];
            if (kind == 4) {
                DISPATCH(tile_dot_q4k, (const tile_q4k *)wt, &xq, r0, rb, out);
            } else {
                DISPATCH(tile_dot_q6k, (const tile_q6k *)wt, &xq, r0, rb, out);
            }
            for (int r = 0; r < rb; r++) {
                float o[TILE];
                _mm256_storeu_ps(o, _mm256_add_ps(out[r], bv));
                memcpy(y + (size_t)(r0 + r) * N + n0, o, sizeof(float) * nv);
            }
        }
    }
    free(xq.q); free(xq.a); free(xq.o16); free(xq.s32);
    return 0;
}
