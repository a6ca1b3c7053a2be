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
 * Masked keys contribute exactly zero. The query heads of a row that share a key/value head
 * (grouped-query attention) go through their keys together, a few at a time, so each key and
 * value is read once for them; each head's numbers are computed as they would be alone.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"

#define HEADS SPECDEC_ATTN_HEADS

/* Heads h0 .. h0+hb-1 of one query row (q: their rows, D floats apart), which share one key/value
 * head, against keys 0 .. n-1: s_h = scores, softmax, o_h = sum_j e_hj v_j / sum_j e_hj.
 * Each (head, key) score is the same sequence of operations (8-lane products over d in order,
 * one horizontal sum, times scale), and each output element sums its keys in order, however
 * many heads share the pass and whatever other rows the call has: a row's result depends on its
 * own query, keys and mask only. s: hb rows of n + 8 floats. */
static void attend_heads(const float *q, int hb, const float *kb, const float *vb, int n, int D,
                         const uint8_t *mrow, float scale, float *s, float *o) {
    const int ss = n + 8;
    /* scores: two keys at a time, one accumulator per (head, key) */
    for (int j = 0; j < n; j += 2) {
        const int nk = j + 1 < n ? 2 : 1;
        __m256 acc[HEADS][2];
        for (int h = 0; h < hb; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        const float *k0 = kb + (size_t)j * D, *k1 = k0 + (nk == 2 ? D : 0);
        for (int d = 0; d < D; d += 8) {
            const __m256 kd0 = _mm256_loadu_ps(k0 + d), kd1 = _mm256_loadu_ps(k1 + d);
            for (int h = 0; h < hb; h++) {
                const __m256 qd = _mm256_loadu_ps(q + (size_t)h * D + d);
                acc[h][0] = _mm256_fmadd_ps(qd, kd0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(qd, kd1, acc[h][1]);
            }
        }
        for (int h = 0; h < hb; h++) {
            s[(size_t)h * ss + j] = specdec_hsum256(acc[h][0]) * scale;
            if (nk == 2) s[(size_t)h * ss + j + 1] = specdec_hsum256(acc[h][1]) * scale;
        }
    }
    /* per head: e_j = exp(s_j - m), masked keys exactly 0, and 1 / (their sum in a fixed order) */
    float inv[HEADS];
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int h = 0; h < hb; h++) {
        float *sh = s + (size_t)h * ss;
        float m = -INFINITY;
        for (int jj = 0; jj < n; jj++) {
            if (mrow && !mrow[jj]) sh[jj] = -INFINITY;
            m = sh[jj] > m ? sh[jj] : m;
        }
        if (m == -INFINITY) {  /* every key masked: nothing to attend to, the output is 0 */
            memset(sh, 0, sizeof(float) * (size_t)n);
            inv[h] = 0.0f;
            continue;
        }
        const __m256 vm = _mm256_set1_ps(m);
        int j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 sj = _mm256_loadu_ps(sh + j);
            const __m256 e = specdec_exp256(_mm256_sub_ps(sj, vm));
            _mm256_storeu_ps(sh + j, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
        }
        if (j < n) {
            float tail[8];
            for (int i = 0; i < 8; i++) tail[i] = j + i < n ? sh[j + i] : -INFINITY;
            const __m256 sj = _mm256_loadu_ps(tail);
            const __m256 e = specdec_exp256(_mm256_sub_ps(sj, vm));
            _mm256_storeu_ps(tail, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
            for (int i = 0; j + i < n; i++) sh[j + i] = tail[i];
        }
        float sum = 0.0f;
        for (int jj = 0; jj < n; jj++) sum += sh[jj];
        inv[h] = 1.0f / sum;
    }
    /* o_h = (sum over keys, in order, of e_hj v_j) * inv_h, 16 output elements at a time */
    for (int d = 0; d < D; d += 16) {
        const int two = d + 8 < D;
        __m256 acc[HEADS][2];
        for (int h = 0; h < hb; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int jj = 0; jj < n; jj++) {
            const float *vj = vb + (size_t)jj * D + d;
            const __m256 v0 = _mm256_loadu_ps(vj), v1 = two ? _mm256_loadu_ps(vj + 8) : v0;
            for (int h = 0; h < hb; h++) {
                const __m256 e = _mm256_set1_ps(s[(size_t)h * ss + jj]);
                acc[h][0] = _mm256_fmadd_ps(e, v0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(e, v1, acc[h][1]);
            }
        }
        for (int h = 0; h < hb; h++) {
            const __m256 vi = _mm256_set1_ps(inv[h]);
            _mm256_storeu_ps(o + (size_t)h * D + d, _mm256_mul_ps(acc[h][0], vi));
            if (two) _mm256_storeu_ps(o + (size_t)h * D + d + 8, _mm256_mul_ps(acc[h][1], vi));
        }
    }
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
    /* a task: one row's query heads that share one key/value head, HEADS at a time */
    const int chunks = (rep + HEADS - 1) / HEADS, per_row = Hkv * chunks;
    #pragma omp for schedule(static)
    for (int task = 0; task < N * per_row; task++) {
        const int r = task / per_row, g = (task % per_row) / chunks, c = task % chunks;
        const int h0 = g * rep + c * HEADS, hb = rep - c * HEADS < HEADS ? rep - c * HEADS : HEADS;
        const int s = A->seg[r], row = A->t[r], end = A->start[s] + A->T[s];
        const float *kb = A->k[s] + layer * A->stride[s] + (size_t)g * A->cap[s] * D;
        const float *vb = A->v[s] + layer * A->stride[s] + (size_t)g * A->cap[s] * D;
        const uint8_t *mrow = A->mask[s] ? A->mask[s] + (size_t)row * end : NULL;
        attend_heads(q + ((size_t)r * H + h0) * D, hb, kb, vb, A->start[s] + row + 1, D, mrow, A->scale, scratch,
                     out + ((size_t)r * H + h0) * D);
    }
}

/* Several sequences' new rows in one call (a packed batch): q, out [N, H, D]; new keys/values
 * knew, vnew [N, Hkv, D] (NULL: already in the caches); A as in specdec.h. Row t of segment s
 * attends to keys 0 .. start[s] + t of its own cache. Returns 0, or -1 if scratch memory ran
 * out. */
int specdec_attend(const specdec_attn *A, int layer, const float *q, const float *knew, const float *vnew, int N,
                   int H, int Hkv, int D, float *out, int nthreads) {
    const size_t per_thread = specdec_attend_scratch(A->max_end);
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)nthreads);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nthreads)
    specdec_attend_team(A, layer, q, knew, vnew, N, H, Hkv, D, out, scratch + per_thread * (size_t)omp_get_thread_num());
    free(scratch);
    return 0;
}
