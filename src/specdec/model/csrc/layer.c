/* One decoder layer of a Llama/Qwen2/Qwen3/Gemma 3-style model (pre-norm RMSNorm, rotate-half
 * RoPE, GQA attention, gated MLP) over q4k weights, in one OpenMP parallel region:
 *
 *   h = rmsnorm(x) * w_attn;  q, k, v = h Wq, h Wk, h Wv (+ biases);  (Qwen3, Gemma 3: q, k = rmsnorm per head)
 *   rope(q), rope(k)
 *   a = attention(q, k, v)                  (row by row over each sequence's cache)
 *   x' = x + a Wo;  h' = rmsnorm(x') * w_mlp;  y = x' + (act(h' Wg) * h' Wu) Wd
 *
 * act is SiLU, or GELU's tanh form (Gemma). Gemma 3's "sandwich" also norms the attention's and
 * the MLP's outputs before each residual add: x' = x + rmsnorm(a Wo) * w_attn_out, and
 * y = x' + rmsnorm(mlp) * w_mlp_out. Gemma's norms multiply by (1 + w): the caller hands those
 * sums as the weights. A model whose layers alternate sliding-window and full attention (Gemma 3)
 * gives each layer its kind; specdec_layers takes both attentions and both rotary tables.
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
    const float *norm_attn_out, *norm_mlp_out;  /* [D] Gemma 3's norms of the attention's and the MLP's
                                                 * outputs before their residual adds, or NULL */
    int act;                         /* ACT_* */
    int sliding;                     /* attends through specdec_layers' sliding-window attention and tables */
} specdec_layer_w;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

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

/* gelu(g) * u over n floats (n a multiple of 8), GELU's tanh form: g/2 (1 + tanh(c (g + 0.044715 g^3))),
 * c = sqrt(2/pi); tanh(z) = sign(z) (1 - e) / (1 + e) with e = exp(-2|z|), which never overflows. */
static void gelu_mul(const float *g, const float *u, int n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), a = _mm256_set1_ps(0.044715f), m2 = _mm256_set1_ps(-2.0f);
    for (int i = 0; i < n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
        const __m256 z = _mm256_mul_ps(c, _mm256_add_ps(gv, _mm256_mul_ps(a, g3)));
        const __m256 e = specdec_exp256(_mm256_mul_ps(m2, _mm256_andnot_ps(sign, z)));  /* exp(-2|z|) */
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));   /* tanh(|z|) */
        const __m256 th = _mm256_or_ps(t, _mm256_and_ps(sign, z));                      /* sign of z */
        const __m256 act = _mm256_mul_ps(_mm256_mul_ps(half, gv), _mm256_add_ps(one, th));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
    }
}

/* Team: for each row, y = base + rmsnorm(y) * w (Gemma 3's norm of a block's output before its
 * residual add); h: [N, D] scratch. */
static void post_norm_add_team(const specdec_layer_w *L, const float *w, const float *base, float *y, int N, float *h) {
    #pragma omp for schedule(static)
    for (int r = 0; r < N; r++) {
        float *yr = y + (size_t)r * L->D, *hr = h + (size_t)r * L->D;
        const float *br = base + (size_t)r * L->D;
        rmsnorm_row(yr, w, L->D, L->eps, hr);
        for (int i = 0; i < L->D; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_add_ps(_mm256_loadu_ps(br + i), _mm256_loadu_ps(hr + i)));
    }
}

/* Team: out = x + attn Wo, then out += mlp(norm(out)) (Gemma 3: each output normed before its add). */
static void out_team(const specdec_layer_w *L, const float *x, const float *attn, int N, float *out, scratch *s) {
    const int HD = L->H * L->Dh;
    specdec_quantize_team(attn, N, HD, &s->xo);
    float *mid[1] = {s->mid};
    const float *res[1] = {x};
    specdec_linears_team(1, L->kind + WO, L->w + WO, L->bias + WO, &L->D, &s->xo, N, mid, L->norm_attn_out ? NULL : res);
    if (L->norm_attn_out) post_norm_add_team(L, L->norm_attn_out, x, s->mid, N, s->h);
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
        if (L->act == ACT_GELU_TANH)
            gelu_mul(s->g + o, s->u + o, n, s->h + o);
        else
            silu_mul(s->g + o, s->u + o, n, s->h + o);
    }
    specdec_quantize_team(s->h, N, L->I, &s->xi);
    float *y[1] = {out};
    const float *res2[1] = {s->mid};
    specdec_linears_team(1, L->kind + WD, L->w + WD, L->bias + WD, &L->D, &s->xi, N, y, L->norm_mlp_out ? NULL : res2);
    if (L->norm_mlp_out) post_norm_add_team(L, L->norm_mlp_out, s->mid, out, N, s->h);
}

/* Where these steps can run: sizes the vector code handles. */
static int supported(const specdec_layer_w *L) {
    return L->D % 8 == 0 && L->I % 8 == 0 && L->Dh % 8 == 0 && L->Dh <= 512 && L->Hkv > 0 && L->H % L->Hkv == 0
           && L->H / L->Hkv <= SPECDEC_ATTN_MAXREP && (L->act == ACT_SILU || L->act == ACT_GELU_TANH);
}

/* Bytes of scratch a call over N rows needs (max_end: the attention's longest row, see
 * specdec_attn; 0 for the split calls). */
int64_t specdec_layer_scratch(const specdec_layer_w *L, int N, int max_end, int nthreads) {
    scratch s;
    return (int64_t)carve(&s, L, N, max_end, nthreads, NULL);
}

/* Layers Ls[0..n-1] (the model's layers first .. first+n-1, all of one shape) in one parallel
 * region, every row's attention native (over its caches: A[0] and the tables cos[0], sin[0] for
 * full-attention layers, A[1], cos[1], sin[1] for the sliding-window ones): the same steps as n
 * calls of specdec_layer, without a call and a thread start per layer. x, out [N, D] (out may
 * not alias x); cos, sin [N, Dh]; tmp [N, D] holds the rows between layers (unused when n == 1);
 * buf: specdec_layer_scratch bytes for Ls[0] and the longer attention's max_end. Returns 0, or
 * -2 for sizes it does not handle. */
int specdec_layers(const specdec_layer_w *const *Ls, int n, int first, const float *x, float *out, float *tmp, int N,
                   const float *const *cos, const float *const *sin, const specdec_attn *const *A, void *buf,
                   int nthreads) {
    for (int l = 0; l < n; l++) {
        const specdec_layer_w *L = Ls[l], *L0 = Ls[0];
        if (!supported(L) || L->D != L0->D || L->H != L0->H || L->Hkv != L0->Hkv || L->Dh != L0->Dh || L->I != L0->I)
            return -2;
    }
    const int max_end = A[0]->max_end > A[1]->max_end ? A[0]->max_end : A[1]->max_end;
    scratch s;
    carve(&s, Ls[0], N, max_end, nthreads, buf);
    const int HD = Ls[0]->H * Ls[0]->Dh, KD = Ls[0]->Hkv * Ls[0]->Dh;
    float *q = s.qkv, *k = q + (size_t)N * HD, *v = k + (size_t)N * KD;
    #pragma omp parallel num_threads(nthreads)
    {
        float *att = s.att + specdec_attend_scratch(max_end, Ls[0]->H / Ls[0]->Hkv) * (size_t)omp_get_thread_num();
        const float *in = x;
        for (int l = 0; l < n; l++) {
            float *o = (n - 1 - l) % 2 == 0 ? out : tmp;  /* the last layer writes `out` */
            const int kind = Ls[l]->sliding != 0;
            qkv_team(Ls[l], in, N, cos[kind], sin[kind], q, k, v, &s);
            specdec_attend_team(A[kind], first + l, q, k, v, N, Ls[l]->H, Ls[l]->Hkv, Ls[l]->Dh, s.attn, att);
            out_team(Ls[l], in, s.attn, N, o, &s);  /* ends at a barrier: `o` is whole before it is read */
            in = o;
        }
    }
    return 0;
}

/* One layer, `layer` of the model, with its own kind's attention and tables: specdec_layers with n = 1. */
int specdec_layer(const specdec_layer_w *L, const float *x, float *out, int N, const float *cos, const float *sin,
                  const specdec_attn *A, int layer, void *buf, int nthreads) {
    const float *cs[2] = {cos, cos}, *sn[2] = {sin, sin};
    const specdec_attn *As[2] = {A, A};
    return specdec_layers(&L, 1, layer, x, out, out, N, cs, sn, As, buf, nthreads);
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
