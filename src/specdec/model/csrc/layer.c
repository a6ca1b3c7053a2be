/* One decoder layer of a Llama/Qwen2/Qwen3-style model (pre-norm RMSNorm, rotate-half RoPE, GQA
 * attention, SiLU-gated MLP) over q4k weights, in one OpenMP parallel region:
 *
 *   h = rmsnorm(x) * w_attn;  q, k, v = h Wq, h Wk, h Wv (+ biases);  (Qwen3: q, k = rmsnorm per head)
 *   rope(q), rope(k)
 *   a = attention(q, k, v)                  (row by row over each sequence's cache)
 *   x' = x + a Wo;  h' = rmsnorm(x') * w_mlp;  y = x' + (silu(h' Wg) * h' Wu) Wd
 *
 * What runs around the matrix kernels (norms, rotary, residual adds, the activation) runs here
 * rather than as dozens of framework operations per layer, and the threads meet at barriers
 * instead of starting a parallel region per operation.
 *
 * Every step is per row (each row's norm, rotation, activation and quantization read that row
 * only; the matrix kernels and the attention are batch-invariant), so a row's result does not
 * depend on the other rows of the call. The float code is written with 256-bit intrinsics,
 * which every build (AVX2, AVX-512, AMX) compiles to the same operations, with fixed-order
 * sums and no contraction (-ffp-contract=off): all builds give the same bits.
 *
 * Three entry points share these steps: specdec_layer (the whole layer, when every row's
 * attention runs here), and specdec_layer_qkv / specdec_layer_out (the parts before and after
 * attention, when some rows attend through the framework: prefill, mixed batches), so a row
 * gets the same bits whichever way its batch is made up.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "specdec.h"

enum { WQ, WK, WV, WO, WG, WU, WD, N_WEIGHTS };

/* A layer's weights and shape (mirrored by specdec.model.fused._LayerStruct). */
typedef struct {
    int kind[N_WEIGHTS];             /* KIND_* (specdec.h) */
    const void *w[N_WEIGHTS];        /* packed tiles */
    const float *bias[N_WEIGHTS];    /* [N] or NULL */
    const float *norm_attn, *norm_mlp;  /* [D] */
    float eps;
    int D, H, Hkv, Dh, I;
    const float *q_norm, *k_norm;    /* [Dh] per-head RMSNorms of q and k before rotary (Qwen3), or NULL */
} specdec_layer_w;

/* Scratch of one call, for N rows: carved from one buffer the caller keeps between calls
 * (fresh memory every call would be page faults every call). */
typedef struct {
    xquant xd, xo, xi;  /* quantized activations: [N, D], [N, H*Dh], [N, I] */
    float *h;           /* [N, max(D, I)] a normed / activated row before quantizing */
    float *mid;         /* [N, D] x after attention */
    float *g, *u;       /* [N, I] */
    float *attn;        /* [N, H*Dh] */
    float *qkv;         /* [N, (H + 2 Hkv) * Dh] (the whole-layer call) */
    float *att;         /* per thread: attention scores (the whole-layer call) */
} scratch;

/* Lay the scratch out from `base` (NULL: only count); returns the bytes it takes. */
static size_t carve(scratch *s, const specdec_layer_w *L, int N, int max_end, int nthreads, char *base) {
    size_t at = 0;
#define TAKE(ptr, type, count) SPECDEC_TAKE(base, at, ptr, type, count)
    const int ks[3] = {L->D, L->H * L->Dh, L->I};
    xquant *xs[3] = {&s->xd, &s->xo, &s->xi};
    for (int i = 0; i < 3; i++) at += specdec_xquant_layout(xs[i], N, ks[i], base ? base + at : NULL);
    const int wide = L->D > L->I ? L->D : L->I;
    TAKE(s->h, float, (size_t)N * wide);
    TAKE(s->mid, float, (size_t)N * L->D);
    TAKE(s->g, float, (size_t)N * L->I);
    TAKE(s->u, float, (size_t)N * L->I);
    TAKE(s->attn, float, (size_t)N * L->H * L->Dh);
    TAKE(s->qkv, float, (size_t)N * (L->H + 2 * L->Hkv) * L->Dh);
    TAKE(s->att, float, specdec_attend_scratch(max_end, L->H / L->Hkv) * (size_t)nthreads);
#undef TAKE
    return at;
}

/* out = x * (1 / sqrt(mean(x^2) + eps)) * w for one row of D floats (D a multiple of 8): the
 * squares summed in 8 lanes, lanes added in a fixed order. */
static void rmsnorm_row(const float *x, const float *w, int D, float eps, float *out) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    const float r = 1.0f / sqrtf(specdec_hsum256(acc) / (float)D + eps);
    const __m256 vr = _mm256_set1_ps(r);
    for (int i = 0; i < D; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr), _mm256_loadu_ps(w + i)));
}

/* Team: each row of x [N, D] normed (into h) and quantized (into xq). */
static void norm_quantize_team(const float *x, const float *w, const specdec_layer_w *L, int N, float *h, xquant *xq) {
    #pragma omp master
    {
        xq->x = h;  /* the float rows, for float-row weights (read after the loop's barrier) */
        xq->ld = L->D;
    }
    #pragma omp for schedule(static)
    for (int r = 0; r < N; r++) {
        rmsnorm_row(x + (size_t)r * L->D, w, L->D, L->eps, h + (size_t)r * L->D);
        specdec_quantize_row(h + (size_t)r * L->D, r, L->D, xq);
    }
}

/* Rotate-half RoPE of one head in place: x * cos + (x2, x1) * sin, where the tables already
 * hold (cos, cos) and (-sin, sin) (see transformer.Rotary.tables): the same operations the
 * framework path runs. */
static void rope_head(float *x, const float *cos, const float *sin, int Dh) {
    const int half = Dh / 2;
    float rot[512];
    memcpy(rot, x + half, sizeof(float) * half);
    memcpy(rot + half, x, sizeof(float) * half);
    for (int d = 0; d < Dh; d++) x[d] = x[d] * cos[d] + rot[d] * sin[d];
}

/* Team: norm, q/k/v projections, rotary. q [N, H*Dh], k/v [N, Hkv*Dh]. */
static void qkv_team(const specdec_layer_w *L, const float *x, int N, const float *cos, const float *sin,
                     float *q, float *k, float *v, scratch *s) {
    norm_quantize_team(x, L->norm_attn, L, N, s->h, &s->xd);
    const int Ns[3] = {L->H * L->Dh, L->Hkv * L->Dh, L->Hkv * L->Dh};
    float *ys[3] = {q, k, v};
    specdec_linears_team(3, L->kind + WQ, L->w + WQ, L->bias + WQ, Ns, &s->xd, N, ys, NULL);
    const int heads = L->H + L->Hkv;
    #pragma omp for schedule(static)
    for (int task = 0; task < N * heads; task++) {
        const int r = task / heads, h = task % heads;
        float *p = h < L->H ? q + ((size_t)r * L->H + h) * L->Dh : k + ((size_t)r * L->Hkv + h - L->H) * L->Dh;
        const float *qk_norm = h < L->H ? L->q_norm : L->k_norm;
        if (qk_norm) rmsnorm_row(p, qk_norm, L->Dh, L->eps, p);  /* Qwen3: each head normed, then rotated */
        rope_head(p, cos + (size_t)r * L->Dh, sin + (size_t)r * L->Dh, L->Dh);
    }
}

/* silu(g) * u over n floats (n a multiple of 8): silu(g) = g / (1 + e^-g), with e = exp(-|g|)
 * so the exponential never overflows: g / (1 + e) for g >= 0, g * e / (1 + e) below. */
static void silu_mul(const float *g, const float *u, int n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = specdec_exp256(_mm256_or_ps(gv, sign));  /* exp(-|g|) */
        const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(gv, e), gv, _mm256_cmp_ps(gv, zero, _CMP_GE_OQ));
        const __m256 act = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
    }
}

/* Team: out = x + attn Wo, then out += mlp(norm(out)). */
static void out_team(const specdec_layer_w *L, const float *x, const float *attn, int N, float *out, scratch *s) {
    const int HD = L->H * L->Dh;
    specdec_quantize_team(attn, N, HD, &s->xo);
    float *mid[1] = {s->mid};
    const float *res[1] = {x};
    specdec_linears_team(1, L->kind + WO, L->w + WO, L->bias + WO, &L->D, &s->xo, N, mid, res);
    norm_quantize_team(s->mid, L->norm_mlp, L, N, s->h, &s->xd);
    const int Ns[2] = {L->I, L->I};
    float *gu[2] = {s->g, s->u};
    specdec_linears_team(2, L->kind + WG, L->w + WG, L->bias + WG, Ns, &s->xd, N, gu, NULL);
    /* the activation in 1024-float pieces, so one row's is shared among the threads */
    const int pieces = (L->I + 1023) / 1024;
    #pragma omp for schedule(static)
    for (int task = 0; task < N * pieces; task++) {
        const int r = task / pieces, p = task % pieces, i0 = p * 1024, n = L->I - i0 < 1024 ? L->I - i0 : 1024;
        const size_t o = (size_t)r * L->I + i0;
        silu_mul(s->g + o, s->u + o, n, s->h + o);
    }
    specdec_quantize_team(s->h, N, L->I, &s->xi);
    float *y[1] = {out};
    const float *res2[1] = {s->mid};
    specdec_linears_team(1, L->kind + WD, L->w + WD, L->bias + WD, &L->D, &s->xi, N, y, res2);
}

/* Where these steps can run: sizes the vector code handles. */
static int supported(const specdec_layer_w *L) {
    return L->D % 8 == 0 && L->I % 8 == 0 && L->Dh % 8 == 0 && L->Dh <= 512 && L->Hkv > 0 && L->H % L->Hkv == 0
           && L->H / L->Hkv <= SPECDEC_ATTN_MAXREP;
}

/* Bytes of scratch a call over N rows needs (max_end: the attention's longest row, see
 * specdec_attn; 0 for the split calls). */
int64_t specdec_layer_scratch(const specdec_layer_w *L, int N, int max_end, int nthreads) {
    scratch s;
    return (int64_t)carve(&s, L, N, max_end, nthreads, NULL);
}

/* Layers Ls[0..n-1] (the model's layers first .. first+n-1, all of one shape) in one parallel
 * region, every row's attention native (A, over its caches): the same steps as n calls of
 * specdec_layer, without a call and a thread start per layer. x, out [N, D] (out may not alias
 * x); cos, sin [N, Dh]; tmp [N, D] holds the rows between layers (unused when n == 1); buf:
 * specdec_layer_scratch bytes for Ls[0]. Returns 0, or -2 for sizes it does not handle. */
int specdec_layers(const specdec_layer_w *const *Ls, int n, int first, const float *x, float *out, float *tmp, int N,
                   const float *cos, const float *sin, const specdec_attn *A, void *buf, int nthreads) {
    for (int l = 0; l < n; l++) {
        const specdec_layer_w *L = Ls[l], *L0 = Ls[0];
        if (!supported(L) || L->D != L0->D || L->H != L0->H || L->Hkv != L0->Hkv || L->Dh != L0->Dh || L->I != L0->I)
            return -2;
    }
    scratch s;
    carve(&s, Ls[0], N, A->max_end, nthreads, buf);
    const int HD = Ls[0]->H * Ls[0]->Dh, KD = Ls[0]->Hkv * Ls[0]->Dh;
    float *q = s.qkv, *k = q + (size_t)N * HD, *v = k + (size_t)N * KD;
    #pragma omp parallel num_threads(nthreads)
    {
        float *att = s.att + specdec_attend_scratch(A->max_end, Ls[0]->H / Ls[0]->Hkv) * (size_t)omp_get_thread_num();
        const float *in = x;
        for (int l = 0; l < n; l++) {
            float *o = (n - 1 - l) % 2 == 0 ? out : tmp;  /* the last layer writes `out` */
            qkv_team(Ls[l], in, N, cos, sin, q, k, v, &s);
            specdec_attend_team(A, first + l, q, k, v, N, Ls[l]->H, Ls[l]->Hkv, Ls[l]->Dh, s.attn, att);
            out_team(Ls[l], in, s.attn, N, o, &s);  /* ends at a barrier: `o` is whole before it is read */
            in = o;
        }
    }
    return 0;
}

/* One layer, `layer` of the model: specdec_layers with n = 1. */
int specdec_layer(const specdec_layer_w *L, const float *x, float *out, int N, const float *cos, const float *sin,
                  const specdec_attn *A, int layer, void *buf, int nthreads) {
    return specdec_layers(&L, 1, layer, x, out, out, N, cos, sin, A, buf, nthreads);
}

/* out [N, D] = rmsnorm of each row of x [N, D] times w (D a multiple of 8): the model's final
 * norm in the native modes, on the calling thread (a few rows: a parallel region, or the
 * framework's operation right after a pass that streamed the weights through every cache,
 * costs more than the arithmetic). */
void specdec_rmsnorm_rows(const float *x, const float *w, int N, int D, float eps, float *out) {
    for (int r = 0; r < N; r++) rmsnorm_row(x + (size_t)r * D, w, D, eps, out + (size_t)r * D);
}

/* The part before attention: q [N, H*Dh], k, v [N, Hkv*Dh] (rotated). */
int specdec_layer_qkv(const specdec_layer_w *L, const float *x, int N, const float *cos, const float *sin, float *q,
                      float *k, float *v, void *buf, int nthreads) {
    if (!supported(L)) return -2;
    scratch s;
    carve(&s, L, N, 0, nthreads, buf);
    #pragma omp parallel num_threads(nthreads)
    qkv_team(L, x, N, cos, sin, q, k, v, &s);
    return 0;
}

/* The part after attention: attn [N, H*Dh] -> out [N, D]. */
int specdec_layer_out(const specdec_layer_w *L, const float *x, const float *attn, float *out, int N, void *buf,
                      int nthreads) {
    if (!supported(L)) return -2;
    scratch s;
    carve(&s, L, N, 0, nthreads, buf);
    #pragma omp parallel num_threads(nthreads)
    out_team(L, x, attn, N, out, &s);
    return 0;
}
