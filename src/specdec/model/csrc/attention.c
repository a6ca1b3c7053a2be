/* Attention for short chains of new tokens, one row (query position) at a time.
 *
 * Row t of a call attends to keys 0 .. start+t of the KV cache, exactly the keys and mask a
 * one-token decoding step at that position sees, with the same code: so the rows of a k-token
 * verification pass are bitwise what k one-token steps compute (batch invariance). One call
 * covers every row and head (in parallel), replacing a framework call per row and layer.
 *
 * Several sequences (a packed batch, each with its own cache) share one call.
 *
 * Per (row, head): s_j = scale * q.k_j (fixed-order dot product), m = max s_j,
 * e_j = exp(s_j - m) (a fixed polynomial), out = sum_j e_j v_j / sum_j e_j, keys in order.
 * Masked keys contribute exactly zero.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (Cephes-style range reduction and degree-5 polynomial, ~1 ulp). */
static inline __m256 exp256(__m256 x) {
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

/* One query row against keys 0 .. n-1 of one head: s_j = scale * q.k_j, softmax, sum of
 * e_j v_j. Every row of every call goes through this function, so a row's result depends only
 * on its own query, keys and mask. s: scratch of at least n + 8 floats. */
static void attend_row(const float *qv, const float *kb, const float *vb, int n, int D,
                       const uint8_t *mrow, float scale, float *s, float *o) {
    /* four keys at a time, each with its own accumulator (independent chains; every
     * key's sum is the same sequence of operations) */
    int j0 = 0;
    for (; j0 + 4 <= n; j0 += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *k0 = kb + (size_t)j0 * D;
        for (int d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qv + d);
            a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + D + d), a1);
            a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 2 * D + d), a2);
            a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 3 * D + d), a3);
        }
        s[j0] = hsum256(a0) * scale;
        s[j0 + 1] = hsum256(a1) * scale;
        s[j0 + 2] = hsum256(a2) * scale;
        s[j0 + 3] = hsum256(a3) * scale;
    }
    for (; j0 < n; j0++) {
        __m256 a0 = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(kb + (size_t)j0 * D + d), a0);
        s[j0] = hsum256(a0) * scale;
    }
    float m = -INFINITY;
    for (int jj = 0; jj < n; jj++) {
        if (mrow && !mrow[jj]) s[jj] = -INFINITY;
        m = s[jj] > m ? s[jj] : m;
    }
    if (m == -INFINITY) {  /* every key masked: nothing to attend to */
        memset(o, 0, sizeof(float) * D);
        return;
    }
    /* e_j = exp(s_j - m), masked keys exactly 0; the sum in a fixed order */
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 sj = _mm256_loadu_ps(s + j);
        const __m256 e = exp256(_mm256_sub_ps(sj, vm));
        _mm256_storeu_ps(s + j, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
    }
    if (j < n) {
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = j + i < n ? s[j + i] : -INFINITY;
        const __m256 sj = _mm256_loadu_ps(tail);
        const __m256 e = exp256(_mm256_sub_ps(sj, vm));
        _mm256_storeu_ps(tail, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
        for (int i = 0; j + i < n; i++) s[j + i] = tail[i];
    }
    float sum = 0.0f;
    for (int jj = 0; jj < n; jj++) sum += s[jj];
    const float inv = 1.0f / sum;
    /* keys outer, so V streams through once; each output element still adds the keys in order */
    memset(o, 0, sizeof(float) * D);
    for (int jj = 0; jj < n; jj++) {
        if (s[jj] == 0.0f) continue;  /* masked (or underflowed): adds nothing */
        const __m256 e = _mm256_set1_ps(s[jj]);
        const float *vj = vb + (size_t)jj * D;
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(e, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(o + d)));
    }
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(inv)));
}

/* Several sequences' new rows in one call (a packed batch). Rows are packed: q, out [N, H, D];
 * new keys/values knew, vnew [N, Hkv, D] (NULL: already in the caches). Row r belongs to
 * segment seg[r] and is that segment's row t[r]; segment s has its own cache (k[s], v[s]:
 * [Hkv, cap[s], D] of this layer), first new slot start[s], T[s] new rows and an optional mask
 * mask[s] [T[s], start[s] + T[s]] (nonzero = may attend; NULL: every earlier key).
 * First every new key/value is written to its slot, then row t of segment s attends to keys
 * 0 .. start[s] + t. Returns 0, or -1 if scratch memory ran out. */
int specdec_attend_segments(const float *q, const float *knew, const float *vnew, int N, int H, int Hkv, int D,
                            const int *seg, const int *t, const int *start, const int *T, const int *cap,
                            float *const *k, float *const *v, const uint8_t *const *mask, float scale,
                            float *out, int max_end, int nthreads) {
    const int rep = H / Hkv;
    int failed = 0;
    if (knew) {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int r = 0; r < N; r++) {
            const int s = seg[r];
            for (int h = 0; h < Hkv; h++) {
                const size_t slot = ((size_t)h * cap[s] + start[s] + t[r]) * D, src = ((size_t)r * Hkv + h) * D;
                memcpy(k[s] + slot, knew + src, sizeof(float) * D);
                memcpy(v[s] + slot, vnew + src, sizeof(float) * D);
            }
        }
    }
    #pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *sc = malloc(sizeof(float) * ((size_t)max_end + 8));
        if (!sc) failed = 1;
        #pragma omp for schedule(static)
        for (int task = 0; task < N * H; task++) {
            if (!sc) continue;
            const int h = task % H, r = task / H, s = seg[r], row = t[r];
            const int end = start[s] + T[s];
            const float *kb = k[s] + (size_t)(h / rep) * cap[s] * D;
            const float *vb = v[s] + (size_t)(h / rep) * cap[s] * D;
            const uint8_t *mrow = mask[s] ? mask[s] + (size_t)row * end : NULL;
            attend_row(q + ((size_t)r * H + h) * D, kb, vb, start[s] + row + 1, D, mrow, scale, sc,
                       out + ((size_t)r * H + h) * D);
        }
        free(sc);
    }
    return failed ? -1 : 0;
}
