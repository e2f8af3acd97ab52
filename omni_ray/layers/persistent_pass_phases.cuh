// The persistent pass's phases: a GEMM over a block's column share (norm, gating and residual fused) and attention
// over a few cached positions. Included by persistent_pass.cu.
#pragma once

#include "persistent_pass_common.cuh"

// ------------------------------------------------------------------------------------------------------- GEMMs

// How a GEMM's input is normed: not at all; here (x is the residual stream: each block sums its rows' squares and
// scales them in its prologue); or ahead (x is already the residual stream times the norm's scale, written by the
// phase before with every block's sums of squares over its columns, which each block adds up here).
enum Norm { NO_NORM = 0, NORM_HERE = 1, NORM_AHEAD = 2 };

// Every block's sums of squares over its columns, [BLOCKS, MAX_ROWS]: x's row r sums at row r * step + offset.
struct RowSquares {
    const float* partials;
    int step, offset;
};

// A residual GEMM's output also written times the next norm's scale (`out`), with this block's sums of squares of
// its columns (`squares`, [BLOCKS, MAX_ROWS]), for the next GEMM to norm ahead; no norm: nothing written.
struct ScaledCopy {
    const bf16_t* norm;
    bf16_t* out;
    float* squares;
};

// 16-row tiles x 32-deep chunks of activation loads a warp issues together (a knob for measurements; served: 4).
#ifndef CHUNK_TILES_IN_FLIGHT
#define CHUNK_TILES_IN_FLIGHT 4
#endif

// The most chunks, up to `most`, whose loads a warp issues together: a divisor of `chunks` (whole batches).
__host__ __device__ constexpr int chunks_in_flight(int chunks, int most) {
    int count = chunks < most ? chunks : most;
    while (chunks % count) --count;
    return count;
}

// out[:, col0 : col0 + width] = epilogue(prologue(x) @ w_share.T) for `rows` rows of x [rows, K] (row stride
// x_stride). NT 8-column tiles of the share sit in `w` (gated: NT / 2 gate tiles, then as many up tiles); MT 16-row
// tiles cover the rows. Each warp multiplies one K / WARPS deep stretch; the warps' partial sums meet in `partial`.
template <int MT, int NT, int K, int NORM, bool GATED, bool RESIDUAL>
__device__ void gemm(const bf16_t* x, long long x_stride, int rows, const bf16_t* w, const bf16_t* norm, float eps,
                     RowSquares ahead, const bf16_t* residual, bf16_t* out, long long out_stride, int col0,
                     float* partial, float* partial_squares, ScaledCopy scaled) {
#ifdef SKIP_GEMMS
    return;
#endif
    // The MMA's 16-deep steps read k in any order both operands agree on: lane (group, pair) takes the 8
    // consecutive k at 8 * pair of each 32-deep chunk, as a 16-byte load of x's row and of the weight's row, and
    // feeds the first four to one step (its k 2p, 2p+1, 2p+8, 2p+9) and the last four to the next.
    constexpr int CHUNKS = K / WARPS / 32;
    // chunks whose loads a warp issues together, as 16-row tiles x chunks (CHUNK_TILES_IN_FLIGHT: a knob for
    // measurements; 8 or 16 a 16-row tile measured no faster, nor 8 / 16 / 32 at 32 rows)
    constexpr int IN_FLIGHT = chunks_in_flight(CHUNKS, CHUNK_TILES_IN_FLIGHT / MT);
    static_assert(CHUNKS % IN_FLIGHT == 0, "whole batches of chunks");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, pair = lane % 4;
    float acc[MT][NT][4];
    float squares[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        squares[m][0] = squares[m][1] = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
    }
    const int k_first = warp * (K / WARPS) + 8 * pair;
    const uint4 zero = {0u, 0u, 0u, 0u};
    // the residual this thread adds in the epilogue, asked for now (an output unit a thread: see the epilogue)
    static_assert(!RESIDUAL || (GATED ? NT / 2 : NT) * MT * 64 <= THREADS, "a residual GEMM's units fit one pass");
    static_assert(!RESIDUAL || NT == 1, "a residual GEMM's block holds one 8-column tile (its scaled copy's sums)");
    u32 residual_pair = 0, scale_pair = 0;
    if (RESIDUAL) {
        const int unit = threadIdx.x, h = unit % 2, unit_lane = (unit / 2) % 32, m = unit / 64,
                  row = m * 16 + unit_lane / 4 + 8 * h, col = col0 + 2 * (unit_lane % 4);
        if (m < MT && row < rows) residual_pair = load_u32(residual + row * HIDDEN + col);
        if (m < MT && scaled.norm) scale_pair = load_u32(scaled.norm + col);
    }
    // normed ahead: each warp adds up its stretch of the blocks' sums of squares for row `lane`, after its products
    constexpr int SQUARE_BLOCKS = NORM == NORM_AHEAD ? BLOCKS / WARPS : 1;
    float block_squares[SQUARE_BLOCKS];
    if (NORM == NORM_AHEAD) {
        static_assert(BLOCKS % WARPS == 0 && MAX_ROWS == 32, "a warp's share of the blocks; a lane a row");
#pragma unroll
        for (int i = 0; i < SQUARE_BLOCKS; ++i)
            block_squares[i] = lane < rows ? ahead.partials[(warp * SQUARE_BLOCKS + i) * MAX_ROWS + lane * ahead.step +
                                                            ahead.offset] : 0.0f;
    }
#pragma unroll 1
    for (int batch = 0; batch < CHUNKS; batch += IN_FLIGHT) {
        uint4 xs[IN_FLIGHT][MT][2];  // rows group and group + 8 of each row tile
        uint4 scales[IN_FLIGHT];
#pragma unroll
        for (int c = 0; c < IN_FLIGHT; ++c) {
            const int k = k_first + (batch + c) * 32;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m * 16 + group + 8 * h;
#ifdef ONE_ROW_LOADS  // probe only (wrong products): every row reads row 0, so a warp's load is one L2 request
                    xs[c][m][h] = row < rows ? *reinterpret_cast<const uint4*>(x + k) : zero;
#else
                    xs[c][m][h] = row < rows ? *reinterpret_cast<const uint4*>(x + row * x_stride + k) : zero;
#endif
                }
            }
            if (NORM == NORM_HERE) scales[c] = *reinterpret_cast<const uint4*>(norm + k);
        }
#pragma unroll
        for (int c = 0; c < IN_FLIGHT; ++c) {
            const int k = k_first + (batch + c) * 32;
            if (NORM == NORM_HERE) {  // (x * scale) in bf16 now, each row times its inverse RMS after the products
                const u32 scale[4] = {scales[c].x, scales[c].y, scales[c].z, scales[c].w};
#pragma unroll
                for (int m = 0; m < MT; ++m) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        u32 words[4] = {xs[c][m][h].x, xs[c][m][h].y, xs[c][m][h].z, xs[c][m][h].w};
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float lo = low_half(words[i]), hi = high_half(words[i]);
                            squares[m][h] += lo * lo + hi * hi;
                            words[i] = pack_bf16(lo * low_half(scale[i]), hi * high_half(scale[i]));
                        }
                        xs[c][m][h] = {words[0], words[1], words[2], words[3]};
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const uint4 wb = *reinterpret_cast<const uint4*>(w + (n * 8 + group) * (K + PAD) + k);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const u32 first[4] = {xs[c][m][0].x, xs[c][m][1].x, xs[c][m][0].y, xs[c][m][1].y};
                    const u32 second[4] = {xs[c][m][0].z, xs[c][m][1].z, xs[c][m][0].w, xs[c][m][1].w};
                    mma_bf16(acc[m][n], first, wb.x, wb.y);
                    mma_bf16(acc[m][n], second, wb.z, wb.w);
                }
            }
        }
    }
    // the warps' partial sums, in fragment order, then added up in warp order (the same sums in every run)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float* at = partial + (((warp * MT + m) * NT + n) * 32 + lane) * 4;
            at[0] = acc[m][n][0]; at[1] = acc[m][n][1]; at[2] = acc[m][n][2]; at[3] = acc[m][n][3];
        }
        if (NORM == NORM_HERE) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float s = squares[m][h];
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                if (pair == 0) partial_squares[warp * MAX_ROWS + m * 16 + group + 8 * h] = s;
            }
        }
    }
    if (NORM == NORM_AHEAD) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < SQUARE_BLOCKS; ++i) sum += block_squares[i];
        partial_squares[warp * MAX_ROWS + lane] = sum;
    }
    __syncthreads();
    constexpr int OUT_TILES = GATED ? NT / 2 : NT;
    for (int unit = threadIdx.x; unit < MT * OUT_TILES * 64; unit += THREADS) {
        const int h = unit % 2, unit_lane = (unit / 2) % 32, tile = (unit / 64) % OUT_TILES, m = unit / 64 / OUT_TILES;
        const int row = m * 16 + unit_lane / 4 + 8 * h;
        const bool valid = row < rows;  // the others still take part in the scaled copy's shuffles
        if (!valid && !(RESIDUAL && scaled.norm)) continue;
        float v0 = 0.0f, v1 = 0.0f, up0 = 0.0f, up1 = 0.0f, row_squares = 0.0f;
        for (int wp = 0; wp < WARPS; ++wp) {
            const float* at = partial + (((wp * MT + m) * NT + tile) * 32 + unit_lane) * 4 + 2 * h;
            v0 += at[0];
            v1 += at[1];
            if (GATED) {
                const float* up = at + OUT_TILES * 32 * 4;
                up0 += up[0];
                up1 += up[1];
            }
            if (NORM != NO_NORM) row_squares += partial_squares[wp * MAX_ROWS + row];
        }
        if (NORM != NO_NORM) {
            const float inverse_rms = 1.0f / sqrtf(row_squares / K + eps);
            v0 *= inverse_rms; v1 *= inverse_rms; up0 *= inverse_rms; up1 *= inverse_rms;
        }
        if (GATED) {
            v0 = v0 / (1.0f + expf(-v0)) * up0;
            v1 = v1 / (1.0f + expf(-v1)) * up1;
        }
        const int col = col0 + tile * 8 + 2 * (unit_lane % 4);
        if (RESIDUAL) {
            v0 += low_half(residual_pair);
            v1 += high_half(residual_pair);
        }
        const u32 stored = pack_bf16(v0, v1);
        if (valid) *reinterpret_cast<u32*>(out + row * out_stride + col) = stored;
        if (RESIDUAL && scaled.norm) {  // one unit a thread (see the residual's load): the row's 4 units in 8 lanes
            const float r0 = low_half(stored), r1 = high_half(stored);
            if (valid)
                *reinterpret_cast<u32*>(scaled.out + row * HIDDEN + col) =
                    pack_bf16(r0 * low_half(scale_pair), r1 * high_half(scale_pair));
            float sum = valid ? r0 * r0 + r1 * r1 : 0.0f;
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            sum += __shfl_xor_sync(0xffffffffu, sum, 4);
            if (valid && unit_lane % 4 == 0) scaled.squares[blockIdx.x * MAX_ROWS + row] = sum;
        }
    }
}

// The two row-tile counts, chosen at run time (one or two 16-row tiles).
template <int NT, int K, int NORM, bool GATED, bool RESIDUAL>
__device__ __forceinline__ void gemm_rows(const bf16_t* x, long long x_stride, int rows, const bf16_t* w,
                                          const bf16_t* norm, float eps, RowSquares ahead, const bf16_t* residual,
                                          bf16_t* out, long long out_stride, int col0, float* partial,
                                          float* partial_squares, ScaledCopy scaled) {
    if (rows > 16)
        gemm<2, NT, K, NORM, GATED, RESIDUAL>(x, x_stride, rows, w, norm, eps, ahead, residual, out, out_stride, col0,
                                              partial, partial_squares, scaled);
    else
        gemm<1, NT, K, NORM, GATED, RESIDUAL>(x, x_stride, rows, w, norm, eps, ahead, residual, out, out_stride, col0,
                                              partial, partial_squares, scaled);
}

// --------------------------------------------------------------------------------------------------- attention

// One head's 128 dims (four a lane, from `at`) RMS-normed by `norm` and rotated (rotate-half), each step rounded to
// bf16 as the eager layer rounds it.
__device__ __forceinline__ void unpack4(uint2 v, float (&out)[4]) {
    out[0] = low_half(v.x); out[1] = high_half(v.x); out[2] = low_half(v.y); out[3] = high_half(v.y);
}

__device__ __forceinline__ uint2 load8(const bf16_t* at) { return *reinterpret_cast<const uint2*>(at); }

__device__ __forceinline__ void head_norm_rope(const bf16_t* at, const bf16_t* norm, float eps, const bf16_t* cos,
                                               const bf16_t* sin, float (&out)[4]) {
    const int lane = threadIdx.x % 32, d = lane * 4, turned = (d + HEAD_DIM / 2) % HEAD_DIM;
    float x[4], t[4], scale[4], turned_scale[4], c[4], s[4];
    unpack4(load8(at + d), x);
    unpack4(load8(at + turned), t);
    unpack4(load8(norm + d), scale);
    unpack4(load8(norm + turned), turned_scale);
    unpack4(load8(cos + d), c);
    unpack4(load8(sin + d), s);
    const float inverse_rms = 1.0f / sqrtf(warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]) /
                                           HEAD_DIM + eps);
    const float sign = d < HEAD_DIM / 2 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float normed = round_bf16(x[i] * inverse_rms * scale[i]);
        const float other = sign * round_bf16(t[i] * inverse_rms * turned_scale[i]);
        out[i] = round_bf16(normed * c[i] + other * s[i]);
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// One step of a reduce-scatter over the warp: each lane keeps the half of partial[0 : 2 * OFFSET] its lane bit OFFSET
// picks, adds the other lane's sums of it, and holds them in partial[0 : OFFSET].
template <int OFFSET>
__device__ __forceinline__ void reduce_scatter(float (&partial)[MAX_KEYS]) {
    const bool upper = (threadIdx.x & OFFSET) != 0;
#pragma unroll
    for (int i = 0; i < OFFSET; ++i) {
        const float send = upper ? partial[i] : partial[i + OFFSET];
        const float keep = upper ? partial[i + OFFSET] : partial[i];
        partial[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFFSET);
    }
}

// One warp per (row, new token, query head), in two rounds of loads: first the row's slot, the cache positions of the
// token and the row's tokens before it, and their new q/k/v heads (normed and rotated); then this lane's four dims of
// every cached key and value the token sees. A reduce-scatter across the warp (31 shuffles) leaves position p's score
// in lane p; the new keys' scores are warp sums put in their positions' lanes; the softmax's weights go back to every
// lane for the values, the new tokens' values added last. The first query head of each KV head writes the token's
// new key and value.
__device__ void attention(const Params& p, const LayerPointers& layer) {
#ifdef SKIP_ATTENTION
    return;
#endif
    constexpr int GROUP = HEADS / KV_HEADS;
    static_assert(MAX_KEYS == 32 && MAX_TOKENS == 2, "a lane a key position; at most two new tokens a row");
    const int lane = threadIdx.x % 32, d = lane * 4, kv_len = (int)p.kv_len, tokens = (int)p.tokens;
    const float scale = (float)p.scale, eps = (float)p.qk_eps;
    for (int item = blockIdx.x * WARPS + threadIdx.x / 32; item < p.rows * tokens * HEADS;
         item += gridDim.x * WARPS) {
        const int head = item % HEADS, kv_head = head / GROUP, row = item / HEADS, b = row / tokens,
                  t = row % tokens;
        const long long slot = p.slots ? p.slots[b] : b;
        float new_keys[MAX_TOKENS][4], new_values[MAX_TOKENS][4], query[4];
        int written[MAX_TOKENS] = {-1, -1};
#pragma unroll
        for (int n = 0; n < MAX_TOKENS; ++n) {  // this token and the row's tokens before it
            if (n > t) break;
            const int source = b * tokens + n;
            written[n] = (int)p.write_index[source];
            const bf16_t* qkv = p.qkv_out + (long long)source * QKV_N;
            head_norm_rope(qkv + (HEADS + kv_head) * HEAD_DIM, layer.k_norm, eps, p.cos + source * HEAD_DIM,
                           p.sin + source * HEAD_DIM, new_keys[n]);
            unpack4(load8(qkv + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + d), new_values[n]);
        }
        head_norm_rope(p.qkv_out + (long long)row * QKV_N + head * HEAD_DIM, layer.q_norm, eps,
                       p.cos + row * HEAD_DIM, p.sin + row * HEAD_DIM, query);
        const int horizon = t == 0 ? written[0] : written[1];
        bf16_t* k_at = layer.k_cache + slot * p.slot_stride + kv_head * HEAD_DIM + d;
        bf16_t* v_at = layer.v_cache + slot * p.slot_stride + kv_head * HEAD_DIM + d;
        uint2 cached_keys[MAX_KEYS], cached_values[MAX_KEYS];  // one batch of loads; zeros at the new positions
        const uint2 zero = {0u, 0u};
#pragma unroll
        for (int pos = 0; pos < MAX_KEYS; ++pos) {
            const bool load = pos < kv_len && pos <= horizon && pos != written[0] && pos != written[1];
            cached_keys[pos] = load ? load8(k_at + pos * p.position_stride) : zero;
            cached_values[pos] = load ? load8(v_at + pos * p.position_stride) : zero;
        }
        float partial[MAX_KEYS];
#pragma unroll
        for (int pos = 0; pos < MAX_KEYS; ++pos) {
            float key[4];
            unpack4(cached_keys[pos], key);
            partial[pos] = key[0] * query[0] + key[1] * query[1] + key[2] * query[2] + key[3] * query[3];
        }
        reduce_scatter<16>(partial);
        reduce_scatter<8>(partial);
        reduce_scatter<4>(partial);
        reduce_scatter<2>(partial);
        reduce_scatter<1>(partial);
        float score = partial[0];
#pragma unroll
        for (int n = 0; n < MAX_TOKENS; ++n) {
            if (n > t) break;
            const float dot = warp_sum(new_keys[n][0] * query[0] + new_keys[n][1] * query[1] +
                                       new_keys[n][2] * query[2] + new_keys[n][3] * query[3]);
            score = lane == written[n] ? dot : score;
        }
        const bool visible = lane < kv_len && lane <= horizon;
        score = visible ? score * scale : NEG_INF;
        const float top = warp_max(score);
        const float e = visible ? expf(score - top) : 0.0f;
        const float weight = e / warp_sum(e);
        float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int pos = 0; pos < MAX_KEYS; ++pos) {
            const float w = __shfl_sync(0xffffffffu, weight, pos);
            float value[4];
            unpack4(cached_values[pos], value);
#pragma unroll
            for (int i = 0; i < 4; ++i) out[i] += w * value[i];
        }
#pragma unroll
        for (int n = 0; n < MAX_TOKENS; ++n) {
            if (n > t) break;
            const float w = __shfl_sync(0xffffffffu, weight, written[n]);
#pragma unroll
            for (int i = 0; i < 4; ++i) out[i] += w * new_values[n][i];
        }
        store_x2(p.attn_out + (long long)row * ATTN_W + head * HEAD_DIM + d, pack_bf16(out[0], out[1]),
                 pack_bf16(out[2], out[3]));
        if (head % GROUP == 0) {
            float key[4], value[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                key[i] = t == 0 ? new_keys[0][i] : new_keys[1][i];
                value[i] = t == 0 ? new_values[0][i] : new_values[1][i];
            }
            const long long at = (long long)horizon * p.position_stride;
            store_x2(k_at + at, pack_bf16(key[0], key[1]), pack_bf16(key[2], key[3]));
            store_x2(v_at + at, pack_bf16(value[0], value[1]), pack_bf16(value[2], value[3]));
        }
    }
}
