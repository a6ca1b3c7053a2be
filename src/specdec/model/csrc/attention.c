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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"

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
        s[j0] = specdec_hsum256(a0) * scale;
        s[j0 + 1] = specdec_hsum256(a1) * scale;
        s[j0 + 2] = specdec_hsum256(a2) * scale;
        s[j0 + 3] = specdec_hsum256(a3) * scale;
    }
    for (; j0 < n; j0++) {
        __m256 a0 = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(kb + (size_t)j0 * D + d), a0);
        s[j0] = specdec_hsum256(a0) * scale;
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
        const __m256 e = specdec_exp256(_mm256_sub_ps(sj, vm));
        _mm256_storeu_ps(s + j, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
    }
    if (j < n) {
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = j + i < n ? s[j + i] : -INFINITY;
        const __m256 sj = _mm256_loadu_ps(tail);
        const __m256 e = specdec_exp256(_mm256_sub_ps(sj, vm));
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

void specdec_attend_team(const specdec_attn *A, int layer, const float *q, const float *knew, const float *vnew,
                         int N, int H, int Hkv, int D, float *out, float *scratch) {
    const int rep = H / Hkv;
    if (knew) {
        #pragma omp for schedule(static)
        for (int r = 0; r < N; r++) {
            const int s = A->seg[r];
            float *kl = A->k[s] + layer * A->stride[s], *vl = A->v[s] + layer * A->stride[s];
            for (int h = 0; h < Hkv; h++) {
                const size_t slot = ((size_t)h * A->cap[s] + A->start[s] + A->t[r]) * D, src = ((size_t)r * Hkv + h) * D;
                memcpy(kl + slot, knew + src, sizeof(float) * D);
                memcpy(vl + slot, vnew + src, sizeof(float) * D);
            }
        }
    }
    #pragma omp for schedule(static)
    for (int task = 0; task < N * H; task++) {
        const int h = task % H, r = task / H, s = A->seg[r], row = A->t[r];
        const int end = A->start[s] + A->T[s];
        const float *kb = A->k[s] + layer * A->stride[s] + (size_t)(h / rep) * A->cap[s] * D;
        const float *vb = A->v[s] + layer * A->stride[s] + (size_t)(h / rep) * A->cap[s] * D;
        const uint8_t *mrow = A->mask[s] ? A->mask[s] + (size_t)row * end : NULL;
        attend_row(q + ((size_t)r * H + h) * D, kb, vb, A->start[s] + row + 1, D, mrow, A->scale, scratch,
                   out + ((size_t)r * H + h) * D);
    }
}

/* Several sequences' new rows in one call (a packed batch): q, out [N, H, D]; new keys/values
 * knew, vnew [N, Hkv, D] (NULL: already in the caches); A as in specdec.h. Row t of segment s
 * attends to keys 0 .. start[s] + t of its own cache. Returns 0, or -1 if scratch memory ran
 * out. */
int specdec_attend(const specdec_attn *A, int layer, const float *q, const float *knew, const float *vnew, int N,
                   int H, int Hkv, int D, float *out, int nthreads) {
    float *scratch = malloc(sizeof(float) * ((size_t)A->max_end + 8) * (size_t)nthreads);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nthreads)
    specdec_attend_team(A, layer, q, knew, vnew, N, H, Hkv, D, out,
                        scratch + ((size_t)A->max_end + 8) * (size_t)omp_get_thread_num());
    free(scratch);
    return 0;
}
