/* Row-wise bucketing of a score block among each row's sorted thresholds (bigrank.losses.buckets).
 *
 * The thresholds are one flat table: row r's 2^depth[r] entries (ascending, padded with +inf, 2^depth[r] greater
 * than its number of thresholds) start at table[start[r]], and its buckets at counts[start[r]], sums[start[r]],
 * prefix[start[r]]. Each row is searched at its own depth and touches only its own 2^depth[r] buckets: a user with
 * many positives costs its own row more, not every row of the batch.
 *
 * bucket_stats: for every score z[r][c], k = |{j : t_r[j] < z}| (with AVX-512 a branchless binary search of
 * depth[r] levels; elsewhere the row's cell table, bucket_cells);
 * counts[start[r] + k] += 1, sums[start[r] + k] += z (in column order, as torch's scatter_add_ adds them), and k is
 * written to idx.
 * bucket_gather: out[r][c] = prefix[start[r] + idx[r][c]].
 *
 * Scores are float32 or bfloat16 (the upper half of a float32). With AVX-512 sixteen scores are searched at once
 * (one gather per level); elsewhere each score is placed by its row's cell table in O(1) expected. Rows are split
 * over `threads` OpenMP threads when built with OpenMP. bucket_stats returns 0; -1 when a thread could not
 * allocate its counters; -2 when a score is NaN (it has no bucket: the caller raises, and counts, sums and idx are
 * then undefined).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define FAILED_ALLOC 1
#define FAILED_NAN 2
#define LANES 16 /* scores placed together by the cell-table loop */

static inline float load_score(const void *z, int bf16, int64_t i) {
    if (bf16) {
        uint32_t bits = ((uint32_t)((const uint16_t *)z)[i]) << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    return ((const float *)z)[i];
}

static inline int32_t search(const float *t, int m, float v) {
    int32_t k = 0;
    for (int s = m - 1; s >= 0; s--) {
        int32_t half = (int32_t)1 << s;
        k = (v > t[k + half - 1]) ? k + half : k;
    }
    return k;
}

/* A NaN score is above no threshold: it falls in bucket 0 and makes that bucket's sum NaN. So a row's scores are
 * looked at again only when its sums[0] is NaN (also when +inf and -inf met in it: not an error). */
static int row_has_nan(const void *z, int bf16, int64_t base, int64_t cols) {
    for (int64_t c = 0; c < cols; c++) {
        float v = load_score(z, bf16, base + c);
        if (v != v) return 1;
    }
    return 0;
}

static inline void store_index(int16_t *idx16, int32_t *idx32, int64_t at, int32_t k) {
    if (idx16) idx16[at] = (int16_t)k;
    else idx32[at] = k;
}

/* Each row's cell table, for bucket_stats without AVX-512: G = cell_count[r] cells of equal width over the row's
 * thresholds [t_0, t_{P-1}] (P = lengths[r] real ones, the rest of the row +inf). A value x is in cell
 * c(x) = (int)clamp((x - lo) * scale, -1, G), a non-decreasing function of x, so a threshold in an earlier cell than
 * a score's is below it and one in a later cell is above it: with arr[i] = |{j : c(t_j) < i - 1}| (i = 0 .. G + 2),
 * the score's bucket lies in [arr[c + 1], arr[c + 2]], settled by comparing it with the thresholds in its own cell
 * (exactly: the comparisons are the search's own). All thresholds equal: scale +inf (every score below, at or above
 * them); no threshold: lo +inf (bucket 0). */
int bucket_cells(int64_t rows, const float *table, const int64_t *start, const int64_t *lengths, int32_t *cells,
                 const int64_t *cell_start, const int32_t *cell_count, float *cell_lo, float *cell_scale,
                 int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *t = table + start[r];
        const int32_t P = (int32_t)lengths[r], G = cell_count[r];
        int32_t *arr = cells + cell_start[r];
        float lo = __builtin_inff(), scale = 1.0f;
        if (P > 0) {
            lo = t[0];
            const float span = t[P - 1] - lo;
            scale = span > 0 ? (float)G / span : __builtin_inff();
        }
        cell_lo[r] = lo;
        cell_scale[r] = scale;
        const float last = (float)G;
        int32_t j = 0;
        for (int32_t i = 0; i <= G + 2; i++) { /* arr[i]: thresholds in cells below i - 1 */
            while (j < P) {
                float f = (t[j] - lo) * scale;
                f = f > -1.0f ? f : -1.0f;
                f = f < last ? f : last;
                if ((int32_t)f >= i - 1) break;
                j++;
            }
            arr[i] = j;
        }
    }
    return 0;
}

int bucket_stats(const void *z, int bf16, int64_t rows, int64_t cols, int64_t z_ld, const float *table,
                 const int64_t *start, const int32_t *depth, int max_depth, const int32_t *cells,
                 const int64_t *cell_start, const int32_t *cell_count, const float *cell_lo, const float *cell_scale,
                 double *counts, double *sums, int16_t *idx16, int32_t *idx32, int64_t idx_ld, int threads) {
    const int64_t max_width = (int64_t)1 << max_depth;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
#endif
    {
        /* Two count arrays, alternating, so that runs of one bucket do not chain every increment; sized for the
         * deepest row, of which each row clears and reads back only its own 2^depth entries. */
        int64_t *count = (int64_t *)malloc(sizeof(int64_t) * 2 * max_width);
        if (!count) failed |= FAILED_ALLOC;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < rows; r++) {
            if (!count) continue;
            const int m = depth[r];
            const int64_t width = (int64_t)1 << m;
            const float *t = table + start[r];
            double *row_sums = sums + start[r];
            memset(count, 0, sizeof(int64_t) * 2 * width);
            const int64_t base = r * z_ld, out = r * idx_ld;
            int64_t c = 0;
#ifdef __AVX512F__
            for (; c + 16 <= cols; c += 16) {
                __m512 v;
                if (bf16) {
                    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)z + base + c));
                    v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
                } else {
                    v = _mm512_loadu_ps((const float *)z + base + c);
                }
                __m512i k = _mm512_setzero_si512();
                for (int s = m - 1; s >= 0; s--) {
                    __m512i probe = _mm512_add_epi32(k, _mm512_set1_epi32((1 << s) - 1));
                    __mmask16 above = _mm512_cmp_ps_mask(v, _mm512_i32gather_ps(probe, t, 4), _CMP_GT_OQ);
                    k = _mm512_mask_add_epi32(k, above, k, _mm512_set1_epi32(1 << s));
                }
                int32_t ks[16];
                float vs[16];
                _mm512_storeu_si512(ks, k);
                _mm512_storeu_ps(vs, v);
                if (idx16) _mm256_storeu_si256((__m256i *)(idx16 + out + c), _mm512_cvtepi32_epi16(k));
                else _mm512_storeu_si512(idx32 + out + c, k);
                for (int j = 0; j < 16; j++) {
                    count[(j & 1) * width + ks[j]] += 1;
                    row_sums[ks[j]] += vs[j];
                }
            }
#else
            /* The row's cell table (bucket_cells): a score's cell bounds its bucket, and the few thresholds inside
             * that cell settle it; no search. */
            const int32_t *arr = cells + cell_start[r];
            const float lo = cell_lo[r], scale = cell_scale[r], last = (float)cell_count[r];
            for (; c + LANES <= cols; c += LANES) {
                float v[LANES];
                int32_t k[LANES];
                for (int j = 0; j < LANES; j++) {
                    v[j] = load_score(z, bf16, base + c + j);
                    float f = (v[j] - lo) * scale;
                    f = f > -1.0f ? f : -1.0f; /* below the first cell, and NaN: bucket 0 */
                    f = f < last ? f : last;
                    /* From the first threshold of the score's cell, step past those below it: two steps without a
                     * branch (a cell holds under one threshold on average), then a loop for a crowded cell. t[k]
                     * exists for every k <= P (the row's entries past its thresholds are +inf), and the first
                     * threshold of a later cell is above the score, so no end is needed. */
                    int32_t kj = arr[(int32_t)f + 1];
                    kj += t[kj] < v[j];
                    kj += t[kj] < v[j];
                    while (t[kj] < v[j]) kj++;
                    k[j] = kj;
                }
                for (int j = 0; j < LANES; j++) {
                    store_index(idx16, idx32, out + c + j, k[j]);
                    count[(j & 1) * width + k[j]] += 1;
                    row_sums[k[j]] += v[j];
                }
            }
#endif
            for (; c < cols; c++) {
                float v = load_score(z, bf16, base + c);
                int32_t k = search(t, m, v);
                store_index(idx16, idx32, out + c, k);
                count[k] += 1;
                row_sums[k] += v;
            }
            if (row_sums[0] != row_sums[0] && row_has_nan(z, bf16, base, cols)) failed |= FAILED_NAN;
            double *row_counts = counts + start[r];
            for (int64_t j = 0; j < width; j++) row_counts[j] += (double)(count[j] + count[width + j]);
        }
        free(count);
    }
    if (failed & FAILED_ALLOC) return -1;
    return (failed & FAILED_NAN) ? -2 : 0;
}

int bucket_gather(int64_t rows, int64_t cols, const int16_t *idx16, const int32_t *idx32, int64_t idx_ld,
                  const float *prefix, const int64_t *start, float *out, int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *p = prefix + start[r];
        float *o = out + r * cols;
        if (idx16) {
            const int16_t *ix = idx16 + r * idx_ld;
            for (int64_t c = 0; c < cols; c++) o[c] = p[ix[c]];
        } else {
            const int32_t *ix = idx32 + r * idx_ld;
            for (int64_t c = 0; c < cols; c++) o[c] = p[ix[c]];
        }
    }
    return 0;
}
