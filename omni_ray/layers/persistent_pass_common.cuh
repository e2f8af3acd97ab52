// The persistent pass's shapes, parameters and plumbing: bf16 helpers, the grid barrier, the weights' copies.
// Included by persistent_pass.cu (NVRTC gets this folder as its include path).
#pragma once

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
    bf16_t* x_a_scaled;            // scratch [MAX_ROWS, HIDDEN]: x_a times the next norm's scale
    bf16_t* x_b_scaled;            // scratch [MAX_ROWS, HIDDEN]: x_b times the post-attention norm's scale
    float* row_squares;            // scratch [BLOCKS, MAX_ROWS]: each block's sums of squares of x_a's or x_b's rows
    u32* counters;                 // [4] after GUARD_WORDS: arrivals, exits, blocks in flight (0), CANARY
    u32* stall_report;             // [16] in host-mapped memory: a wait that stalled (`report_stall`)
    // the draw after the head (`persistent_pass_draw.cuh`), when draw_cap > 0
    const float* temperature;      // [rows]
    const long long* top_k;        // [rows]
    const float* top_p;            // [rows]
    const long long* noise_keys;   // [rows, 2]
    const bf16_t* table;           // [VOCAB, HIDDEN]: the code embedding
    const bf16_t* feedback;        // [rows, HIDDEN]
    long long* codes;              // [rows]
    bf16_t* embedded;              // [rows, HIDDEN]
    bf16_t* summed;                // [rows, HIDDEN]
    long long num_layers, rows, tokens, kv_len, slot_stride, position_stride, draw_cap, noise_offset;
    double eps, final_eps, qk_eps, scale;
};

// ---------------------------------------------------------------------------------------------------- helpers

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

// A wait that stalls: after STALL_NS of spinning, the block writes what it waited for into the host-mapped report
// ([1]: 1 a grid barrier, 2 a weight copy, 3 a launch whose counters were not at rest; [2] the block; [3] the
// barrier's generation, the fill, or the blocks already in flight; [4] the arrivals seen or the phase parity; [5] the
// arrivals awaited or the exits; [6..9] the counters then; [10..13] the guard words before them; [0] 1 once written)
// and traps, so that the launch fails with an error the host can read the report after, instead of spinning for
// ever (the pass takes about 150 us).
#ifndef STALL_NS
#define STALL_NS 2000000000ull
#endif
// The counters' own word [3] and the four guard words before them ([-4..-1]) hold CANARY, written by the host: any
// other value there was written over them by something else.
#define CANARY 0xC0DE5EEDu
#define GUARD_WORDS 4

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __noinline__ void report_stall(u32* report, const u32* counters, u32 where, u32 generation, u32 seen,
                                          u32 target) {
    volatile u32* out = report;
    const volatile u32* now = counters;
    if (out[0] == 0u) {  // the first to stall (racing blocks may overwrite each other: any one report will do)
        out[1] = where, out[2] = blockIdx.x, out[3] = generation, out[4] = seen, out[5] = target;
        for (int i = 0; i < 4; ++i) out[6 + i] = now[i];
        for (int i = 0; i < GUARD_WORDS; ++i) out[10 + i] = now[i - GUARD_WORDS];
        __threadfence_system();
        out[0] = 1u;
        __threadfence_system();
    }
    __trap();
}

// A launch starts on counters at rest: no arrivals past this launch's first barrier, no exits, no other launch's
// blocks in flight, every canary in place. Anything else means two launches share the counters at once, or something
// wrote over them: the block reports it (where 3) and traps rather than pass barriers it should not.
__device__ __forceinline__ void enter_launch(u32* counters, u32* report) {
    if (threadIdx.x == 0) {
        const u32 in_flight = atomicAdd(counters + 2, 1u);  // this launch's blocks that started before: < gridDim.x
        const volatile u32* now = counters;
        bool guarded = now[3] == CANARY;
        for (int i = 1; i <= GUARD_WORDS; ++i) guarded = guarded && now[-i] == CANARY;
        const u32 arrivals = now[0], exits = now[1];
        if (in_flight >= gridDim.x || arrivals >= gridDim.x || exits != 0u || !guarded)
            report_stall(report, counters, 3u, in_flight, arrivals, exits);
    }
}

// Whether a wait that began at `*since` (0: not yet timed, set now) has gone on past STALL_NS.
__device__ __forceinline__ bool stalled(unsigned long long& since) {
    const unsigned long long now = global_ns();
    if (since == 0) since = now;
    return now - since > STALL_NS;
}

// All blocks wait here until each has arrived `generation` times. Thread 0 releases the block's writes and acquires
// the others'; the block's barriers order its other threads around that. (A flag per block, each released by its
// block and acquired by thread t for block t, measured 2.4 times as slow.)
__device__ __forceinline__ void grid_barrier(u32* arrived, u32 generation, u32* report) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(arrived) : "memory");
        const u32 target = generation * gridDim.x;
        u32 seen;
        unsigned long long since = 0;
        while (true) {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
            if (seen >= target) break;
            if (stalled(since)) report_stall(report, arrived, 1u, generation, seen, target);
        }
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------ weight shares

// The weights' copies: by default bulk copies of whole rows on the multiprocessor's copy engine (a row a lane of the
// first warp), counted on the buffer's mbarrier; CP_ASYNC_COPIES: 16-byte cp.async copies spread over
// every thread (measured slower), counted in cp.async groups.

// L2_KEEP_PERCENT (`engine.persistent_code_predictor_l2_keep_percent`; 0 or unset: off): that share of the weights'
// lines (by address) asked of L2 as evict_last, the rest evict_first, so the kept share stays in L2 from one pass to
// the next (a frame runs 15 passes over the same 157 MB, more than L2 holds: plain reads keep nothing).
// L2_EVICT_FIRST (for measurements): every weight line asked of L2 as evict_first (keeps none; leaves L2 to the rest).
#ifndef L2_KEEP_PERCENT
#define L2_KEEP_PERCENT 0
#endif

__device__ __forceinline__ void bulk_copy(void* shared, const void* global, u32 bytes, u32 barrier) {
#if L2_KEEP_PERCENT > 0 || defined(L2_EVICT_FIRST)
    unsigned long long policy;
#if L2_KEEP_PERCENT > 0
    asm volatile("createpolicy.fractional.L2::evict_last.L2::evict_first.b64 %0, %1;"
                 : "=l"(policy) : "f"(L2_KEEP_PERCENT / 100.0f));
#else
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(barrier), "l"(policy) : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(barrier) : "memory");
#endif
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
    if (threadIdx.x < 32)  // the first warp's lanes a row each: one instruction issues 32 rows' copies
        for (int row = threadIdx.x; row < count; row += 32)
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

// The mbarrier that counts the launch's fill `fill` of a weight buffer: fills alternate between two adjacent mbarriers
// (the first at `mbarriers`), whichever buffer they fill.
__device__ __forceinline__ u32 fill_barrier(u32 mbarriers, int fill) { return mbarriers + 8 * (fill & 1); }

// This block's share of the pass's GEMM `index` copied into its buffer (nothing past the last GEMM), counted on the
// mbarrier of the launch's fill `fill`.
__device__ __forceinline__ void ask_weights(const Params& p, int index, int fill, bf16_t* buffer0, bf16_t* buffer1,
                                            u32 mbarriers) {
    const long long block = blockIdx.x;
    const u32 barrier = fill_barrier(mbarriers, fill);
#ifndef SKIP_WEIGHTS
    if (index <= 4 * p.num_layers) {
#ifndef CP_ASYNC_COPIES
        if (threadIdx.x < 32) {  // the buffer's last reads (before a block barrier) come before the copies' writes
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            if (threadIdx.x == 0)  // the bytes expected, before any copy of them completes
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                             :: "r"(barrier), "r"(share_bytes(p, index)) : "memory");
            __syncwarp();
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

// Wait until the launch's fill `fill` is in its buffer (the next fill already asked for), then the block's barrier.
__device__ __forceinline__ void wait_weights(int fill, u32 mbarriers, u32* report, const u32* counters) {
#if !defined(NO_WAIT) && !defined(SKIP_WEIGHTS)
#ifdef CP_ASYNC_COPIES
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#else
    const u32 barrier = fill_barrier(mbarriers, fill), parity = (fill >> 1) & 1;  // its (fill / 2)-th phase
    u32 done = 0;
    unsigned long long since = 0;
    while (true) {
        asm volatile("{ .reg .pred full; mbarrier.try_wait.parity.shared::cta.b64 full, [%1], %2; selp.u32 %0, 1, 0, full; }"
                     : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
        if (done) break;
        if (stalled(since)) report_stall(report, counters, 2u, (u32)fill, parity, 0u);
    }
#endif
#endif
    __syncthreads();
}
