/* What the native sources share: the activation quantization, the q4k kernel's and the
 * attention's "team" entry points (called by every thread of an enclosing OpenMP parallel
 * region, work shared out with `omp for`, each ending in its barrier), and vector helpers.
 * The exported specdec_* functions each open one parallel region around these; layer.c runs a
 * whole decoder layer in one. */
#ifndef SPECDEC_H
#define SPECDEC_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define QK 256

/* Weight kinds (a layer's packed tiles, see kquant.c; mirrored by specdec.model.kquant): the
 * K-quants by their bits, GGML's 32-weight types by bits and min (40 = Q4_0, 41 = Q4_1...), and
 * float rows by their width. */
enum {
    KIND_Q2 = 2, KIND_Q3 = 3, KIND_Q4K = 4, KIND_Q5K = 5, KIND_Q6K = 6,
    KIND_Q8_0 = 8, KIND_Q4_0 = 40, KIND_Q4_1 = 41, KIND_Q5_0 = 50, KIND_Q5_1 = 51,
    KIND_F16 = 16, KIND_BF16 = 17, KIND_F32 = 32,
};

/* Activations quantized per row and 256-block (see kquant.c), and the float rows they were
 * quantized from (the float kinds read those). */
typedef struct {
    int8_t *q;      /* [M, K] codes (K padded to whole blocks) */
    float *a;       /* [M, nb] scales */
    int16_t *s32;   /* [M, nb, 8] sums of each 32 codes: the q4k min term, the 32-weight types' offsets */
    int16_t *s16;   /* [M, nb, 16] sums of each 16 codes: the q6k offset is -32 times them */
    int K, nb;
    const float *x; /* [M, ld] the float rows (set by whoever quantizes them) */
    int ld, Kin;    /* row stride of x; inputs per row (K before padding) */
} xquant;

/* Carving arrays out of one buffer: `ptr` = `count` items of `type` at offset `at` of `base`
 * (NULL: only count), `at` moved past them to the next 64-byte boundary. */
#define SPECDEC_TAKE(base, at, ptr, type, count)                   \
    do {                                                           \
        (ptr) = (base) ? (type *)((base) + (at)) : NULL;           \
        (at) += ((sizeof(type) * (size_t)(count) + 63) / 64) * 64; \
    } while (0)

/* Lay out xq's arrays for M rows of K inputs from `base` (NULL: only count); returns the
 * bytes they take (each array 64-byte aligned). */
size_t specdec_xquant_layout(xquant *xq, int M, int K, char *base);
/* Row r of the activations (x: [K] floats) into xq (the caller records the float rows). */
void specdec_quantize_row(const float *x, int r, int K, xquant *xq);
/* Team: rows 0..M-1 of x [M, K], recorded as xq's float rows. */
void specdec_quantize_team(const float *x, int M, int K, xquant *xq);
/* Team: y[i] [M, N[i]] = xq @ W_i^T + bias[i] (+ add[i], same shape, when add and add[i]). */
void specdec_linears_team(int n_layers, const int *kinds, const void *const *w, const float *const *bias,
                          const int *N, const xquant *xq, int M, float *const *y, const float *const *add);

/* One forward's row-by-row attention over a packed batch (see attention.c and
 * native.SegmentAttention); k/v: per segment, the cache of layer 0, each layer `stride`
 * floats further on. */
typedef struct {
    const int *seg, *t;     /* [N] per row: its segment, its row within the segment */
    const int *start, *T, *cap;  /* per segment */
    float *const *k, *const *v;
    const int64_t *stride;  /* per segment: floats from one layer's cache to the next */
    const uint8_t *const *mask;  /* per segment [T, start + T] (nonzero = may attend) or NULL */
    float scale;
    int max_end;
} specdec_attn;

/* Rows of one sequence whose query heads share one pass over their keys (see attention.c), the
 * most query heads per key/value head it handles, and the floats of attention scratch one
 * thread needs (rep: query heads per key/value head). */
#define SPECDEC_ATTN_ROWS 4
#define SPECDEC_ATTN_MAXREP 16
static inline size_t specdec_attend_scratch(int max_end, int rep) {
    return (size_t)SPECDEC_ATTN_ROWS * (size_t)rep * ((size_t)max_end + 8);
}

/* Team: write the new rows' keys/values (knew, vnew [N, Hkv, D]; NULL: already there), then
 * out [N, H, D] = attention of q [N, H, D]. scratch: this thread's specdec_attend_scratch floats. */
void specdec_attend_team(const specdec_attn *A, int layer, const float *q, const float *knew, const float *vnew,
                         int N, int H, int Hkv, int D, float *out, float *scratch);

static inline float specdec_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (Cephes-style range reduction and degree-5 polynomial, ~1 ulp). */
static inline __m256 specdec_exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
