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
 * Masked keys contribute exactly zero. Work is shared out in tasks of a few consecutive rows of
 * one sequence and the query heads that share one key/value head (grouped-query attention):
 * all their query vectors go through the keys together, so each key and value is fetched from
 * memory once per task (at long contexts the cache no longer fits the core's caches, and reading
 * it once per row and head was most of the time). Each vector's numbers are computed as they
 * would be alone.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"

/* Scores of query vectors qv[0..nq-1] (nq <= 4) against keys j0, j0+1 (nk = 1 or 2 of them):
 * s_v[j] = scale * q_v . k_j, one 8-lane accumulator per (vector, key) over d in order, one
 * horizontal sum in a fixed order. */
static inline __attribute__((always_inline)) void scores4(const float *const *qv, const int nq, const float *kb, int j0,
                                                         int nk, int D, float scale, float *const *sv) {
    __m256 acc[4][2];
    for (int i = 0; i < nq; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const float *k0 = kb + (size_t)j0 * D, *k1 = k0 + (nk == 2 ? D : 0);
    for (int d = 0; d < D; d += 8) {
        const __m256 kd0 = _mm256_loadu_ps(k0 + d), kd1 = _mm256_loadu_ps(k1 + d);
        for (int i = 0; i < nq; i++) {
            const __m256 qd = _mm256_loadu_ps(qv[i] + d);
            acc[i][0] = _mm256_fmadd_ps(qd, kd0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(qd, kd1, acc[i][1]);
        }
    }
    for (int i = 0; i < nq; i++) {
        sv[i][j0] = specdec_hsum256(acc[i][0]) * scale;
        if (nk == 2) sv[i][j0 + 1] = specdec_hsum256(acc[i][1]) * scale;
    }
}

/* o_v[d .. d+15] = (sum over keys j < n, in order, of e_vj v_j) * inv_v for vectors 0..nq-1
 * (nq <= 4); e_vj is 0 past vector v's own keys, which adds nothing (+0 or -0 to a sum that
 * starts at +0 and so is never -0: the same bits as stopping at its last key). */
static inline __attribute__((always_inline)) void values4(const float *const *sv, const int nq, const float *vb, int n,
                                                         int D, int d, const float *inv, float *const *ov) {
    const int two = d + 8 < D;
    __m256 acc[4][2];
    for (int i = 0; i < nq; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *vj = vb + (size_t)j * D + d;
        const __m256 v0 = _mm256_loadu_ps(vj), v1 = two ? _mm256_loadu_ps(vj + 8) : v0;
        for (int i = 0; i < nq; i++) {
            const __m256 e = _mm256_set1_ps(sv[i][j]);
            acc[i][0] = _mm256_fmadd_ps(e, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(e, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < nq; i++) {
        const __m256 vi = _mm256_set1_ps(inv[i]);
        _mm256_storeu_ps(ov[i] + d, _mm256_mul_ps(acc[i][0], vi));
        if (two) _mm256_storeu_ps(ov[i] + d + 8, _mm256_mul_ps(acc[i][1], vi));
    }
}

/* Weights under e^-64 of the largest (2^-92: far below what a float32 sum whose largest term is
 * 1 resolves) are exactly 0. Kept, their products with the values were denormal numbers, which
 * the CPU computes far slower: with far-apart scores the attention became a large share of a
 * several-row pass (docs/results.md, 2026-12-06 fourth entry). (exp256 also clamps its input at
 * -87, where it would give e^-87 for any lower score.) */
#define SOFTMAX_FLOOR (-64.0f)

/* Softmax of one vector's scores s[0..n-1] in place (n: its own keys; mrow: its mask row or
 * NULL): e_j = exp(s_j - m), masked keys and those under SOFTMAX_FLOOR exactly 0; s[n..nmax-1]
 * set to 0. Returns 1 / (sum of the e_j in key order), 0 where every key is masked (the output
 * is then 0). */
static float softmax_row(float *sh, int n, int nmax, const uint8_t *mrow) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), lowest = _mm256_set1_ps(SOFTMAX_FLOOR);
    float m = -INFINITY;
    for (int jj = 0; jj < n; jj++) {
        if (mrow && !mrow[jj]) sh[jj] = -INFINITY;
        m = sh[jj] > m ? sh[jj] : m;
    }
    memset(sh + n, 0, sizeof(float) * (size_t)(nmax - n));
    if (m == -INFINITY) {  /* every key masked: nothing to attend to */
        memset(sh, 0, sizeof(float) * (size_t)n);
        return 0.0f;
    }
    const __m256 vm = _mm256_set1_ps(m);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 sj = _mm256_loadu_ps(sh + j), dj = _mm256_sub_ps(sj, vm);
        const __m256 e = _mm256_and_ps(specdec_exp256(dj), _mm256_cmp_ps(dj, lowest, _CMP_GE_OQ));
        _mm256_storeu_ps(sh + j, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
    }
    if (j < n) {
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = j + i < n ? sh[j + i] : -INFINITY;
        const __m256 sj = _mm256_loadu_ps(tail), dj = _mm256_sub_ps(sj, vm);
        const __m256 e = _mm256_and_ps(specdec_exp256(dj), _mm256_cmp_ps(dj, lowest, _CMP_GE_OQ));
        _mm256_storeu_ps(tail, _mm256_andnot_ps(_mm256_cmp_ps(sj, ninf, _CMP_EQ_OQ), e));
        for (int i = 0; j + i < n; i++) sh[j + i] = tail[i];
    }
    float sum = 0.0f;
    for (int jj = 0; jj < n; jj++) sum += sh[jj];
    return 1.0f / sum;
}

/* One task: rows r0 .. r0+nr-1 of one segment (consecutive, so row i has n0 + i keys) and the
 * `rep` query heads h0.. that share key/value head g. All nr * rep query vectors go through the
 * keys together, four at a time, so each key and value is fetched from memory once per task
 * rather than once per row and head. Each vector's numbers are those it gets alone. */
static void attend_task(const specdec_attn *A, int layer, const float *q, int r0, int nr, int g, int H, int rep,
                        int D, float *out, float *scratch) {
    const int s = A->seg[r0], row0 = A->t[r0], end = A->start[s] + A->T[s];
    const int n0 = A->start[s] + row0 + 1, nmax = n0 + nr - 1, ss = nmax + 8;
    const float *kb = A->k[s] + layer * A->stride[s] + (size_t)g * A->cap[s] * D;
    const float *vb = A->v[s] + layer * A->stride[s] + (size_t)g * A->cap[s] * D;
    const int nv = nr * rep;  /* vector v: row r0 + v / rep, head g * rep + v % rep */
    const float *qv[SPECDEC_ATTN_ROWS * SPECDEC_ATTN_MAXREP];
    float *sv[SPECDEC_ATTN_ROWS * SPECDEC_ATTN_MAXREP], *ov[SPECDEC_ATTN_ROWS * SPECDEC_ATTN_MAXREP];
    float inv[SPECDEC_ATTN_ROWS * SPECDEC_ATTN_MAXREP];
    for (int v = 0; v < nv; v++) {
        const size_t at = ((size_t)(r0 + v / rep) * H + g * rep + v % rep) * D;
        qv[v] = q + at, ov[v] = out + at, sv[v] = scratch + (size_t)v * ss;
    }
    /* scores: every vector against keys 0 .. nmax-1 (past a row's own keys they are unused) */
    for (int j = 0; j < nmax; j += 2) {
        const int nk = j + 1 < nmax ? 2 : 1;
        int v = 0;
        for (; v + 4 <= nv; v += 4) scores4(qv + v, 4, kb, j, nk, D, A->scale, sv + v);
        switch (nv - v) {
        case 1: scores4(qv + v, 1, kb, j, nk, D, A->scale, sv + v); break;
        case 2: scores4(qv + v, 2, kb, j, nk, D, A->scale, sv + v); break;
        case 3: scores4(qv + v, 3, kb, j, nk, D, A->scale, sv + v); break;
        default: break;
        }
    }
    for (int v = 0; v < nv; v++) {
        const int i = v / rep;
        const uint8_t *mrow = A->mask[s] ? A->mask[s] + (size_t)(row0 + i) * end : NULL;
        inv[v] = softmax_row(sv[v], n0 + i, nmax, mrow);
    }
    for (int d = 0; d < D; d += 16) {
        int v = 0;
        for (; v + 4 <= nv; v += 4) values4(sv + v, 4, vb, nmax, D, d, inv + v, ov + v);
        switch (nv - v) {
        case 1: values4(sv + v, 1, vb, nmax, D, d, inv + v, ov + v); break;
        case 2: values4(sv + v, 2, vb, nmax, D, d, inv + v, ov + v); break;
        case 3: values4(sv + v, 3, vb, nmax, D, d, inv + v, ov + v); break;
        default: break;
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
    /* tasks: up to SPECDEC_ATTN_ROWS consecutive rows of one segment, times the key/value heads
     * (a row block never spans two segments: it starts where the previous one of its segment
     * ended). Block b starts at the b-th row whose position in its segment is a multiple of
     * SPECDEC_ATTN_ROWS. */
    int blocks = 0;
    for (int r = 0; r < N; r++)
        if (A->t[r] % SPECDEC_ATTN_ROWS == 0) blocks++;
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < blocks * Hkv; task++) {
        const int b = task / Hkv, g = task % Hkv;
        int r0 = -1;
        for (int r = 0, seen = 0; r < N; r++)
            if (A->t[r] % SPECDEC_ATTN_ROWS == 0 && seen++ == b) {
                r0 = r;
                break;
            }
        int nr = 1;
        while (nr < SPECDEC_ATTN_ROWS && r0 + nr < N && A->seg[r0 + nr] == A->seg[r0] && A->t[r0 + nr] == A->t[r0] + nr) nr++;
        attend_task(A, layer, q, r0, nr, g, H, rep, D, out, scratch);
    }
}

/* Several sequences' new rows in one call (a packed batch): q, out [N, H, D]; new keys/values
 * knew, vnew [N, Hkv, D] (NULL: already in the caches); A as in specdec.h. Row t of segment s
 * attends to keys 0 .. start[s] + t of its own cache. Returns 0, or -1 if scratch memory ran
 * out. */
int specdec_attend(const specdec_attn *A, int layer, const float *q, const float *knew, const float *vnew, int N,
                   int H, int Hkv, int D, float *out, int nthreads) {
    if (H / Hkv > SPECDEC_ATTN_MAXREP) return -2;
    const size_t per_thread = specdec_attend_scratch(A->max_end, H / Hkv);
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)nthreads);
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nthreads)
    specdec_attend_team(A, layer, q, knew, vnew, N, H, Hkv, D, out, scratch + per_thread * (size_t)omp_get_thread_num());
    free(scratch);
    return 0;
}
