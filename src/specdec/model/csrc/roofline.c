/* Roofline probes for `specdec bench forward`: what this machine's memory and this build's
 * integer dot products can do, each measured alone, so a pass's time can be set against
 * max(bytes / bandwidth, work / rate) (see specdec.bench.roofline).
 *
 * - specdec_stream_read: threads stream their contiguous shares of a buffer with full-width
 *   loads, as the q4k kernel streams its tiles (each thread a run of whole tiles).
 * - specdec_dot_rate: independent accumulator chains of the build's integer dot product as the
 *   kernel issues it (one 512-bit vpdpbusd in the AVX-512 builds; in the AVX2 build maddubs +
 *   a 16-bit add on each 256-bit half, and per 8 of those one widening multiply-add and a
 *   32-bit add, as the q4k loop sums a group), no memory traffic: the compute roof.
 * Python times both calls; they return a value that depends on all the work, so none of it can
 * be optimised away.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* bytes: a multiple of 256. */
int64_t specdec_stream_read(const void *buf, int64_t bytes, int nthreads) {
    int64_t sink = 0;
    const int64_t blocks = bytes / 256;
    #pragma omp parallel num_threads(nthreads) reduction(^ : sink)
    {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        const char *p = (const char *)buf;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks; i++) {
            const char *q = p + 256 * i;
#ifdef SPECDEC_AVX512
            const __m512i x0 = _mm512_load_si512((const void *)q), x1 = _mm512_load_si512((const void *)(q + 64));
            const __m512i x2 = _mm512_load_si512((const void *)(q + 128)), x3 = _mm512_load_si512((const void *)(q + 192));
            const __m512i x = _mm512_xor_si512(_mm512_xor_si512(x0, x1), _mm512_xor_si512(x2, x3));
            a0 = _mm256_xor_si256(a0, _mm512_castsi512_si256(x));
            a1 = _mm256_xor_si256(a1, _mm512_extracti64x4_epi64(x, 1));
#else
            a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)q));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(q + 32)));
            a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(q + 64)));
            a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(q + 96)));
            a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(q + 128)));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(q + 160)));
            a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(q + 192)));
            a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(q + 224)));
#endif
        }
        const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
        sink ^= _mm256_extract_epi64(a, 0) ^ _mm256_extract_epi64(a, 1) ^ _mm256_extract_epi64(a, 2) ^ _mm256_extract_epi64(a, 3);
    }
    return sink;
}

/* rounds x 16 dot-product steps per thread, each 64 integer multiply-adds (16 output lanes x 4
 * byte products: one tile's chunk, as in csrc/kquant.c). Returns the multiply-adds done (the
 * caller divides by the time). The empty asm keeps the compiler from hoisting the products out
 * of the loop (the kernel's operands change every step). */
int64_t specdec_dot_rate(int64_t rounds, int nthreads, int seed) {
    int64_t sink = 0;
    #pragma omp parallel num_threads(nthreads) reduction(^ : sink)
    {
#ifdef SPECDEC_AVX512
        __m512i acc[16];
        __m512i u = _mm512_set1_epi8((char)(seed & 63)), s = _mm512_set1_epi8((char)(seed + 1));
        for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
        for (int64_t r = 0; r < rounds; r++) {
            __asm__ volatile("" : "+v"(u), "+v"(s));
            #pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
        }
        __m512i t = acc[0];
        for (int i = 1; i < 16; i++) t = _mm512_add_epi32(t, acc[i]);
        sink ^= _mm512_reduce_add_epi32(t);
#else
        __m256i acc[8], wide[4];
        __m256i u = _mm256_set1_epi8((char)(seed & 63)), s = _mm256_set1_epi8((char)(seed + 1));
        const __m256i sc = _mm256_set1_epi16(3);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_set1_epi16((short)i);
        for (int i = 0; i < 4; i++) wide[i] = _mm256_setzero_si256();
        for (int64_t r = 0; r < rounds; r++) {
            /* 16 steps, each both 8-output halves as the AVX2 kernel does them (2 x 32 products,
             * two maddubs into 16-bit sums), and the 4 widenings by the scale that 32 maddubs
             * need there (one per group of 8) */
            #pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                __asm__ volatile("" : "+x"(u), "+x"(s));
                acc[i % 8] = _mm256_add_epi16(acc[i % 8], _mm256_maddubs_epi16(u, s));
                acc[(i + 4) % 8] = _mm256_add_epi16(acc[(i + 4) % 8], _mm256_maddubs_epi16(s, u));
            }
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) wide[i] = _mm256_add_epi32(wide[i], _mm256_madd_epi16(acc[2 * i], sc));
        }
        __m256i t = wide[0];
        for (int i = 1; i < 4; i++) t = _mm256_add_epi32(t, wide[i]);
        for (int i = 0; i < 8; i++) t = _mm256_add_epi32(t, acc[i]);
        sink ^= _mm256_extract_epi32(t, 0);
#endif
    }
    return rounds * 16 * 64 * (int64_t)nthreads * (sink != 0x7fffffffffffffffLL);
}
