// A dense decoder stack's decode pass at up to 32 rows, its final norm and its head, as one persistent kernel.
//
// Every block owns a share of each GEMM's output columns and keeps that share of the weights in shared memory. It
// asks for the next GEMM's share (bulk copies) before it computes the current one, so the weights stream in
// while the blocks wait for each other at grid barriers; after a barrier only the activations (at most 32 rows) are
// read, from L2. Phases per layer: input norm + q/k/v | q/k norm + rotary + KV write + attention | o + residual |
// post-attention norm + gate/up + SiLU(gate) * up | down + residual; then the final norm + the head for each row's
// last token. Sums run in fp32 and each phase rounds its output to bf16 once, as `small_batch`'s kernels do.
//
// Shapes come in as -D defines: HIDDEN, HEADS, KV_HEADS, HEAD_DIM (128), INTER, VOCAB, BLOCKS, WARPS. For timing
// by difference (`benchmarks/persistent_pass_probe.py`), SKIP_ATTENTION, SKIP_GEMMS and SKIP_WEIGHTS leave one part
// out and NO_WAIT computes without waiting for the weights' copies (the results are then wrong); CP_ASYNC_COPIES
// copies the weights as the first version did. A served build sets none of them.
// No #include: compiled by NVRTC (or nvcc) on its own.

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define MAX_LAYERS 8
#define MAX_TOKENS 2
#define MAX_KEYS 32
#define MAX_ROWS 32
#define NEG_INF __int_as_float(0xff800000)
#define PAD 32  // bf16 elements after each weight row in shared memory: 16-byte reads of 8 rows x 4 lanes hit distinct banks

#define THREADS (WARPS * 32)
#define QKV_N ((HEADS + 2 * KV_HEADS) * HEAD_DIM)
#define ATTN_W (HEADS * HEAD_DIM)
#define QKV_C (QKV_N / BLOCKS)
#define O_C (HIDDEN / BLOCKS)
#define GU_C (INTER / BLOCKS)
#define DOWN_C (HIDDEN / BLOCKS)
#define HEAD_C (VOCAB / BLOCKS)

static_assert(HEAD_DIM == 128, "a warp holds a head's 128 dims, four a lane");
static_assert(QKV_C % 8 == 0 && O_C % 8 == 0 && GU_C % 8 == 0 && DOWN_C % 8 == 0 && HEAD_C % 8 == 0,
              "every block's column share is whole 8-column MMA tiles");
static_assert(HIDDEN % (WARPS * 16) == 0 && ATTN_W % (WARPS * 16) == 0 && INTER % (WARPS * 16) == 0,
              "every warp's depth share is whole 16-deep MMA steps");

struct LayerPointers {
    const bf16_t* qkv;         // [QKV_N, HIDDEN]
    const bf16_t* o;           // [HIDDEN, ATTN_W]
    const bf16_t* gate_up;     // [2 * INTER, HIDDEN]: gate rows, then up rows
    const bf16_t* down;        // [HIDDEN, INTER]
    const bf16_t* input_norm;  // [HIDDEN]
    const bf16_t* post_norm;   // [HIDDEN]
    const bf16_t* q_norm;      // [HEAD_DIM]
    const bf16_t* k_norm;      // [HEAD_DIM]
    bf16_t* k_cache;           // [slots, positions, KV_HEADS, HEAD_DIM]
    bf16_t* v_cache;
};

// Every field eight bytes wide: the host packs it as an array of 64-bit words.
struct Params {
    LayerPointers layers[MAX_LAYERS];
    const bf16_t* embeds;          // [rows * tokens, HIDDEN]
    const bf16_t* cos;             // [rows * tokens, HEAD_DIM]
    const bf16_t* sin;
    const long long* write_index;  // [rows * tokens]: each token's cache position
    const long long* slots;        // [rows], or null: row b is slot b
    const bf16_t* final_norm;      // [HIDDEN]
    const bf16_t* head;            // [VOCAB, HIDDEN]
    bf16_t* logits;                // [rows, VOCAB]
    bf16_t* x_a;                   // scratch [MAX_ROWS, HIDDEN]: a layer's output
    bf16_t* x_b;                   // scratch [MAX_ROWS, HIDDEN]: after attention
    bf16_t* qkv_out;               // scratch [MAX_ROWS, QKV_N]
    bf16_t* attn_out;              // scratch [MAX_ROWS, ATTN_W]
    bf16_t* hidden;                // scratch [MAX_ROWS, INTER]
    u32* counters;                 // [2], zero between launches
    long long num_layers, rows, tokens, kv_len, slot_stride, position_stride;
    double eps, final_eps, qk_eps, scale;
};

// ---------------------------------------------------------------------------------------------------- helpers

__device__ __forceinline__ float bf16_to_float(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float low_half(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_half(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }

__device__ __forceinline__ u32 pack_bf16(float low, float high) {  // round to nearest even, as Triton rounds
    u32 out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(high), "f"(low));
    return out;
}

__device__ __forceinline__ float round_bf16(float x) { return low_half(pack_bf16(x, 0.0f)); }

// Plain loads: after a grid barrier (thread 0's acquire, then the block's barrier) they see every block's writes,
// and the compiler may batch them (an asm volatile load could not be moved past another).
__device__ __forceinline__ u32 load_u32(const void* p) { return *reinterpret_cast<const u32*>(p); }

__device__ __forceinline__ void store_x2(void* p, u32 a, u32 b) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(shared_address(shared)), "l"(global) : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// All blocks wait here until each has arrived `generation` times. Thread 0 releases the block's writes and acquires
// the others'; the block's barriers order its other threads around that.
__device__ __forceinline__ void grid_barrier(u32* arrived, u32 generation) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(arrived) : "memory");
        const u32 target = generation * gridDim.x;
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------ weight shares

// The weights' copies: by default bulk copies of whole rows on the multiprocessor's copy engine (one instruction a
// row, issued by thread 0), counted on the buffer's mbarrier; CP_ASYNC_COPIES: 16-byte cp.async copies spread over
// every thread (measured slower, session 35), counted in cp.async groups.

__device__ __forceinline__ void bulk_copy(void* shared, const void* global, u32 bytes, u32 barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(barrier) : "memory");
}

// `count` weight rows from `first` of a [*, K] weight into shared rows of K + PAD.
template <int K>
__device__ __forceinline__ void copy_rows(bf16_t* shared, const bf16_t* weight, long long first, int count,
                                          u32 barrier) {
#ifdef CP_ASYNC_COPIES
    constexpr int CHUNKS = K / 8;
    for (int i = threadIdx.x; i < count * CHUNKS; i += THREADS) {
        const int row = i / CHUNKS, chunk = i % CHUNKS;
        copy_async_16(shared + row * (K + PAD) + chunk * 8, weight + (first + row) * K + chunk * 8);
    }
#else
    if (threadIdx.x == 0)
        for (int row = 0; row < count; ++row)
            bulk_copy(shared + row * (K + PAD), weight + (first + row) * K, K * 2, barrier);
#endif
}

// GEMM `index` of the pass: 4 per layer (q/k/v, o, gate/up, down), then the head; even ones in buffer 0.
__device__ __forceinline__ u32 share_bytes(const Params& p, int index) {
    if (index == 4 * p.num_layers) return HEAD_C * HIDDEN * 2;
    switch (index % 4) {
        case 0: return QKV_C * HIDDEN * 2;
        case 1: return O_C * ATTN_W * 2;
        case 2: return 2 * GU_C * HIDDEN * 2;
        default: return DOWN_C * INTER * 2;
    }
}

// This block's share of GEMM `index` copied into its buffer (nothing past the last GEMM).
__device__ __forceinline__ void ask_weights(const Params& p, int index, bf16_t* buffer0, bf16_t* buffer1,
                                            const u32 (&barriers)[2]) {
    const long long block = blockIdx.x;
    const u32 barrier = barriers[index & 1];
#ifndef SKIP_WEIGHTS
    if (index <= 4 * p.num_layers) {
#ifndef CP_ASYNC_COPIES
        if (threadIdx.x == 0) {  // the buffer's last reads (before a block barrier) come before the copies' writes
            unsigned long long state;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                         : "=l"(state) : "r"(barrier), "r"(share_bytes(p, index)) : "memory");
        }
#endif
        if (index == 4 * p.num_layers) {
            copy_rows<HIDDEN>(buffer0, p.head, block * HEAD_C, HEAD_C, barrier);
        } else {
            const LayerPointers& layer = p.layers[index / 4];
            switch (index % 4) {
                case 0: copy_rows<HIDDEN>(buffer0, layer.qkv, block * QKV_C, QKV_C, barrier); break;
                case 1: copy_rows<ATTN_W>(buffer1, layer.o, block * O_C, O_C, barrier); break;
                case 2:
                    copy_rows<HIDDEN>(buffer0, layer.gate_up, block * GU_C, GU_C, barrier);
                    copy_rows<HIDDEN>(buffer0 + GU_C * (HIDDEN + PAD), layer.gate_up, INTER + block * GU_C, GU_C,
                                      barrier);
                    break;
                default: copy_rows<INTER>(buffer1, layer.down, block * DOWN_C, DOWN_C, barrier); break;
            }
        }
    }
#endif
#ifdef CP_ASYNC_COPIES
    copy_async_commit();  // a group each call, empty past the last GEMM: "all but the last" is the current GEMM's
#endif
}

// Wait until GEMM `index`'s share is in its buffer (the next GEMM's copies already asked for), then the block's barrier.
__device__ __forceinline__ void wait_weights(int index, const u32 (&barriers)[2]) {
#if !defined(NO_WAIT) && !defined(SKIP_WEIGHTS)
#ifdef CP_ASYNC_COPIES
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#else
    const u32 barrier = barriers[index & 1], parity = (index >> 1) & 1;  // the buffer's (index / 2)-th fill
    u32 done = 0;
    while (!done) {
        asm volatile("{ .reg .pred full; mbarrier.try_wait.parity.shared::cta.b64 full, [%1], %2; selp.u32 %0, 1, 0, full; }"
                     : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
    }
#endif
#endif
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------------- GEMMs

// out[:, col0 : col0 + width] = epilogue(prologue(x) @ w_share.T) for `rows` rows of x [rows, K] (row stride
// x_stride). NT 8-column tiles of the share sit in `w` (gated: NT / 2 gate tiles, then as many up tiles); MT 16-row
// tiles cover the rows. Each warp multiplies one K / WARPS deep stretch; the warps' partial sums meet in `partial`.
template <int MT, int NT, int K, bool NORM, bool GATED, bool RESIDUAL>
__device__ void gemm(const bf16_t* x, long long x_stride, int rows, const bf16_t* w, const bf16_t* norm, float eps,
                     const bf16_t* residual, bf16_t* out, long long out_stride, int col0, float* partial,
                     float* partial_squares) {
#ifdef SKIP_GEMMS
    return;
#endif
    // The MMA's 16-deep steps read k in any order both operands agree on: lane (group, pair) takes the 8
    // consecutive k at 8 * pair of each 32-deep chunk, as a 16-byte load of x's row and of the weight's row, and
    // feeds the first four to one step (its k 2p, 2p+1, 2p+8, 2p+9) and the last four to the next.
    constexpr int CHUNKS = K / WARPS / 32;
    constexpr int IN_FLIGHT = CHUNKS < 4 / MT ? CHUNKS : 4 / MT;  // chunks whose loads are issued together
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
                    xs[c][m][h] = row < rows ? *reinterpret_cast<const uint4*>(x + row * x_stride + k) : zero;
                }
            }
            if (NORM) scales[c] = *reinterpret_cast<const uint4*>(norm + k);
        }
#pragma unroll
        for (int c = 0; c < IN_FLIGHT; ++c) {
            const int k = k_first + (batch + c) * 32;
            if (NORM) {  // (x * scale) in bf16 now, each row times its inverse RMS after the products
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
        if (NORM) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float s = squares[m][h];
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                if (pair == 0) partial_squares[warp * MAX_ROWS + m * 16 + group + 8 * h] = s;
            }
        }
    }
    __syncthreads();
    constexpr int OUT_TILES = GATED ? NT / 2 : NT;
    for (int unit = threadIdx.x; unit < MT * OUT_TILES * 64; unit += THREADS) {
        const int h = unit % 2, unit_lane = (unit / 2) % 32, tile = (unit / 64) % OUT_TILES, m = unit / 64 / OUT_TILES;
        const int row = m * 16 + unit_lane / 4 + 8 * h;
        if (row >= rows) continue;
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
            if (NORM) row_squares += partial_squares[wp * MAX_ROWS + row];
        }
        if (NORM) {
            const float inverse_rms = 1.0f / sqrtf(row_squares / K + eps);
            v0 *= inverse_rms; v1 *= inverse_rms; up0 *= inverse_rms; up1 *= inverse_rms;
        }
        if (GATED) {
            v0 = v0 / (1.0f + expf(-v0)) * up0;
            v1 = v1 / (1.0f + expf(-v1)) * up1;
        }
        const int col = col0 + tile * 8 + 2 * (unit_lane % 4);
        if (RESIDUAL) {
            const u32 r = load_u32(residual + row * HIDDEN + col);
            v0 += low_half(r);
            v1 += high_half(r);
        }
        *reinterpret_cast<u32*>(out + row * out_stride + col) = pack_bf16(v0, v1);
    }
}

// The two row-tile counts, chosen at run time (one or two 16-row tiles).
template <int NT, int K, bool NORM, bool GATED, bool RESIDUAL>
__device__ __forceinline__ void gemm_rows(const bf16_t* x, long long x_stride, int rows, const bf16_t* w,
                                          const bf16_t* norm, float eps, const bf16_t* residual, bf16_t* out,
                                          long long out_stride, int col0, float* partial, float* partial_squares) {
    if (rows > 16)
        gemm<2, NT, K, NORM, GATED, RESIDUAL>(x, x_stride, rows, w, norm, eps, residual, out, out_stride, col0,
                                              partial, partial_squares);
    else
        gemm<1, NT, K, NORM, GATED, RESIDUAL>(x, x_stride, rows, w, norm, eps, residual, out, out_stride, col0,
                                              partial, partial_squares);
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

// One warp per (row, query head): the row's new keys and values (written by the first query head of each KV head),
// then each new token's attention over the slot's positions up to its own. Every lane holds four dims: it loads them
// for every cached position in one batch, forms its partial dot products, and a reduce-scatter across the warp (31
// shuffles) leaves position p's score in lane p; the softmax's weights go back to every lane for the values.
__device__ void attention(const Params& p, const LayerPointers& layer) {
#ifdef SKIP_ATTENTION
    return;
#endif
    constexpr int GROUP = HEADS / KV_HEADS;
    static_assert(MAX_KEYS == 32, "a lane a key position");
    const int lane = threadIdx.x % 32, d = lane * 4;
    const int tokens = (int)p.tokens, kv_len = (int)p.kv_len;
    const float scale = (float)p.scale, eps = (float)p.qk_eps;
    const uint2 zero = {0u, 0u};
    for (int item = blockIdx.x * WARPS + threadIdx.x / 32; item < p.rows * HEADS; item += gridDim.x * WARPS) {
        const int b = item / HEADS, head = item % HEADS, kv_head = head / GROUP;
        const long long slot = p.slots ? p.slots[b] : b;
        const bf16_t* k_at = layer.k_cache + slot * p.slot_stride + kv_head * HEAD_DIM + d;
        const bf16_t* v_at = layer.v_cache + slot * p.slot_stride + kv_head * HEAD_DIM + d;
        float new_keys[MAX_TOKENS][4], new_values[MAX_TOKENS][4];
        int written[MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            written[t] = -1;
            if (t >= tokens) continue;
            const int row = b * tokens + t;
            written[t] = (int)p.write_index[row];
            const bf16_t* qkv = p.qkv_out + (long long)row * QKV_N;
            head_norm_rope(qkv + (HEADS + kv_head) * HEAD_DIM, layer.k_norm, eps, p.cos + row * HEAD_DIM,
                           p.sin + row * HEAD_DIM, new_keys[t]);
            unpack4(load8(qkv + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + d), new_values[t]);
            if (head % GROUP == 0) {
                const long long at = (long long)written[t] * p.position_stride;
                store_x2(layer.k_cache + slot * p.slot_stride + kv_head * HEAD_DIM + d + at,
                         pack_bf16(new_keys[t][0], new_keys[t][1]), pack_bf16(new_keys[t][2], new_keys[t][3]));
                store_x2(layer.v_cache + slot * p.slot_stride + kv_head * HEAD_DIM + d + at,
                         pack_bf16(new_values[t][0], new_values[t][1]), pack_bf16(new_values[t][2], new_values[t][3]));
            }
        }
#pragma unroll 1
        for (int t = 0; t < tokens; ++t) {
            const int row = b * tokens + t, horizon = t == 0 ? written[0] : written[1];
            float query[4];
            head_norm_rope(p.qkv_out + (long long)row * QKV_N + head * HEAD_DIM, layer.q_norm, eps,
                           p.cos + row * HEAD_DIM, p.sin + row * HEAD_DIM, query);
            uint2 cached[MAX_KEYS];  // this lane's dims of every cached key it may see, one batch of loads
#pragma unroll
            for (int pos = 0; pos < MAX_KEYS; ++pos) {
                const bool load = pos < kv_len && pos <= horizon && pos != written[0] && pos != written[1];
                cached[pos] = load ? load8(k_at + (long long)pos * p.position_stride) : zero;
            }
            float partial[MAX_KEYS];
#pragma unroll
            for (int pos = 0; pos < MAX_KEYS; ++pos) {
                float key[4];
                unpack4(cached[pos], key);
#pragma unroll
                for (int i = 0; i < 4; ++i) key[i] = pos == written[0] ? new_keys[0][i] : (pos == written[1] ? new_keys[1][i] : key[i]);
                partial[pos] = key[0] * query[0] + key[1] * query[1] + key[2] * query[2] + key[3] * query[3];
            }
            reduce_scatter<16>(partial);
            reduce_scatter<8>(partial);
            reduce_scatter<4>(partial);
            reduce_scatter<2>(partial);
            reduce_scatter<1>(partial);
            const bool visible = lane < kv_len && lane <= horizon;
            const float score = visible ? partial[0] * scale : NEG_INF;
            const float top = warp_max(score);
            const float e = visible ? expf(score - top) : 0.0f;
            const float weight = e / warp_sum(e);
            uint2 values[MAX_KEYS];
#pragma unroll
            for (int pos = 0; pos < MAX_KEYS; ++pos) {
                const bool load = pos < kv_len && pos <= horizon && pos != written[0] && pos != written[1];
                values[pos] = load ? load8(v_at + (long long)pos * p.position_stride) : zero;
            }
            float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int pos = 0; pos < MAX_KEYS; ++pos) {
                const float w = __shfl_sync(0xffffffffu, weight, pos);
                float value[4];
                unpack4(values[pos], value);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    value[i] = pos == written[0] ? new_values[0][i] : (pos == written[1] ? new_values[1][i] : value[i]);
                    out[i] += w * value[i];
                }
            }
            store_x2(p.attn_out + (long long)row * ATTN_W + head * HEAD_DIM + d, pack_bf16(out[0], out[1]),
                     pack_bf16(out[2], out[3]));
        }
    }
}

// ------------------------------------------------------------------------------------------------------ kernel

extern "C" __global__ void __launch_bounds__(THREADS, 1) decoder_pass(const Params p) {
    extern __shared__ __align__(16) unsigned char shared[];
    constexpr int BUFFER0 = (2 * GU_C > QKV_C ? 2 * GU_C : QKV_C) * (HIDDEN + PAD) * 2;
    constexpr int BUFFER1 = (DOWN_C * (INTER + PAD) > O_C * (ATTN_W + PAD) ? DOWN_C * (INTER + PAD)
                                                                          : O_C * (ATTN_W + PAD)) * 2;
    bf16_t* buffer0 = reinterpret_cast<bf16_t*>(shared);
    bf16_t* buffer1 = reinterpret_cast<bf16_t*>(shared + BUFFER0);
    float* partial = reinterpret_cast<float*>(shared + BUFFER0 + BUFFER1);
    constexpr int PARTIAL_FLOATS = WARPS * 2 * (2 * GU_C / 8 > QKV_C / 8 ? 2 * GU_C / 8 : QKV_C / 8) * 128;
    float* partial_squares = partial + PARTIAL_FLOATS;

    __shared__ __align__(8) unsigned long long fills[2];  // an mbarrier a weight buffer
    const u32 barriers[2] = {shared_address(&fills[0]), shared_address(&fills[1])};
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(barriers[0]) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(barriers[1]) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int rows = (int)(p.rows * p.tokens), layers = (int)p.num_layers;
    const float eps = (float)p.eps;
    u32 generation = 0;
    ask_weights(p, 0, buffer0, buffer1, barriers);
    for (int l = 0; l < layers; ++l) {
        const LayerPointers& layer = p.layers[l];
        const bf16_t* x = l == 0 ? p.embeds : p.x_a;
        ask_weights(p, 4 * l + 1, buffer0, buffer1, barriers);
        wait_weights(4 * l, barriers);
        gemm_rows<QKV_C / 8, HIDDEN, true, false, false>(x, HIDDEN, rows, buffer0, layer.input_norm, eps, nullptr,
                                                         p.qkv_out, QKV_N, blockIdx.x * QKV_C, partial,
                                                         partial_squares);
        grid_barrier(p.counters, ++generation);
        ask_weights(p, 4 * l + 2, buffer0, buffer1, barriers);  // gate/up streams in during attention and o
        attention(p, layer);
        grid_barrier(p.counters, ++generation);
        wait_weights(4 * l + 1, barriers);
        gemm_rows<O_C / 8, ATTN_W, false, false, true>(p.attn_out, ATTN_W, rows, buffer1, nullptr, 0.0f, x, p.x_b,
                                                        HIDDEN, blockIdx.x * O_C, partial, partial_squares);
        grid_barrier(p.counters, ++generation);
        ask_weights(p, 4 * l + 3, buffer0, buffer1, barriers);
        wait_weights(4 * l + 2, barriers);
        gemm_rows<2 * GU_C / 8, HIDDEN, true, true, false>(p.x_b, HIDDEN, rows, buffer0, layer.post_norm, eps,
                                                           nullptr, p.hidden, INTER, blockIdx.x * GU_C, partial,
                                                           partial_squares);
        grid_barrier(p.counters, ++generation);
        ask_weights(p, 4 * l + 4, buffer0, buffer1, barriers);
        wait_weights(4 * l + 3, barriers);
        gemm_rows<DOWN_C / 8, INTER, false, false, true>(p.hidden, INTER, rows, buffer1, nullptr, 0.0f, p.x_b,
                                                         p.x_a, HIDDEN, blockIdx.x * DOWN_C, partial,
                                                         partial_squares);
        grid_barrier(p.counters, ++generation);
    }
    // the final norm and the head, over each row's last token
    ask_weights(p, 4 * layers + 1, buffer0, buffer1, barriers);  // nothing left
    wait_weights(4 * layers, barriers);
    gemm_rows<HEAD_C / 8, HIDDEN, true, false, false>(p.x_a + (p.tokens - 1) * HIDDEN, p.tokens * HIDDEN,
                                                      (int)p.rows, buffer0, p.final_norm, (float)p.final_eps,
                                                      nullptr, p.logits, VOCAB, blockIdx.x * HEAD_C, partial,
                                                      partial_squares);
    // the last block past every barrier zeroes the counters for the next launch
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(p.counters + 1, 1u) == gridDim.x - 1) {
            p.counters[0] = 0;
            p.counters[1] = 0;
            __threadfence();
        }
    }
}
