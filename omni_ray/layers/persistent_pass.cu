// A dense decoder stack's decode pass at up to 32 rows, its final norm and its head, as one persistent kernel.
//
// Every block owns a share of each GEMM's output columns and keeps that share of the weights in shared memory. It
// asks for the next GEMM's share (bulk copies) before it computes the current one, so the weights stream in
// while the blocks wait for each other at grid barriers; after a barrier only the activations (at most 32 rows) are
// read, from L2. Phases per layer: input norm + q/k/v | q/k norm + rotary + KV write + attention | o + residual
// (also written times the post-attention norm's scale, with each block's sums of squares) | that norm + gate/up +
// SiLU(gate) * up | down + residual (also written times the next norm's scale); then the final norm + the head for
// each row's last token, and optionally each row's code drawn from those logits (a block a row). So only the first
// layer's input norm scales and squares its rows in every block. Sums run in fp32 and each phase rounds its output to
// bf16 once, as `small_batch`'s kernels do.
//
// Shapes come in as -D defines: HIDDEN, HEADS, KV_HEADS, HEAD_DIM (128), INTER, VOCAB, BLOCKS, WARPS. For timing
// by difference, SKIP_ATTENTION, SKIP_GEMMS and SKIP_WEIGHTS leave one part out and NO_WAIT computes without waiting
// for the weights' copies (the results are then wrong); CP_ASYNC_COPIES copies the weights as the first version did.
// PASSES_IN_LAUNCH (for measurements; default 1) runs that many passes in one
// launch, each after the last: a later pass reads the codes the pass before drew (when drawing), or the same inputs
// again; its q/k/v share streams in while the rows draw. STALL_TEST (tests) holds block 0 before the first grid
// barrier for good, so the others stall there and report it (`report_stall`). A served build sets none of them.
// No system headers: NVRTC (or nvcc) builds it with this folder as the include path.

#include "persistent_pass_common.cuh"
#include "persistent_pass_phases.cuh"
#include "persistent_pass_draw.cuh"

// ------------------------------------------------------------------------------------------------------ kernel

#ifndef PASSES_IN_LAUNCH
#define PASSES_IN_LAUNCH 1
#endif
#if PASSES_IN_LAUNCH > 1 && defined(CP_ASYNC_COPIES)
#error "cp.async groups count one ask per wait: a launch of several passes asks for the next q/k/v after the head"
#endif

// The block's dynamic shared memory: two weight buffers (q/k/v, gate/up and the head in the first; o and down in the
// other), the warps' partial sums, then their partial sums of squares. Addressed from the array, so that no register
// holds a pointer through the phases.
extern __shared__ __align__(16) unsigned char shared[];
constexpr int BUFFER0_BYTES = (2 * GU_C > QKV_C ? 2 * GU_C : QKV_C) * (HIDDEN + PAD) * 2;
constexpr int BUFFER1_BYTES = (DOWN_C * (INTER + PAD) > O_C * (ATTN_W + PAD) ? DOWN_C * (INTER + PAD)
                                                                             : O_C * (ATTN_W + PAD)) * 2;
constexpr int PARTIAL_FLOATS = WARPS * 2 * (2 * GU_C / 8 > QKV_C / 8 ? 2 * GU_C / 8 : QKV_C / 8) * 128;
static_assert(sizeof(DrawShared) <= PARTIAL_FLOATS * sizeof(float), "the draw's scratch fits the partial sums'");
__device__ __forceinline__ bf16_t* buffer0() { return reinterpret_cast<bf16_t*>(shared); }
__device__ __forceinline__ bf16_t* buffer1() { return reinterpret_cast<bf16_t*>(shared + BUFFER0_BYTES); }
__device__ __forceinline__ float* partial() { return reinterpret_cast<float*>(shared + BUFFER0_BYTES + BUFFER1_BYTES); }
__device__ __forceinline__ float* partial_squares() { return partial() + PARTIAL_FLOATS; }

// A pass's grid barriers in a launch of several: five a layer, one past the head (before the rows draw) when
// drawing, then one before the next pass (the last pass's is never passed: no pass follows it).
__device__ __forceinline__ u32 grid_barriers_a_pass(const Params& p) {
    return 5 * (u32)p.num_layers + (p.draw_cap > 0 ? 1u : 0u) + 1u;
}

// A layer's input: the row's embeddings for the first (in a later pass of a launch, the codes' embeddings the pass
// before drew, or, not drawing, the same inputs again), else the last layer's output.
__device__ __forceinline__ const bf16_t* layer_input(const Params& p, int l, int pass) {
    return l > 0 ? p.x_a : pass > 0 && p.draw_cap > 0 ? p.embedded : p.embeds;
}

// Which of a launch's passes runs: the only one (a served build, so that every count below folds to a constant), or
// the one shared memory holds (several a launch: no register holds it through the phases).
struct OnlyPass {
    __device__ __forceinline__ int operator*() const { return 0; }
};
struct PassInShared {
    const volatile int* at;
    __device__ __forceinline__ int operator*() const { return *at; }
};

// The launch's pass `*pass`: the layers, the final norm and the head, then (drawing) every row's code. Its first
// GEMM's copies were asked for before; `ask_next`: ask for the next pass's first share once the head has read its
// buffer. A pass's GEMM g is the launch's fill pass * (4 * layers + 1) + g.
template <class Pass>
__device__ __forceinline__ void one_pass(const Params& p, Pass pass, bool ask_next, u32 mbarriers) {
    const int rows = (int)(p.rows * p.tokens), layers = (int)p.num_layers, fills = 4 * layers + 1;
    u32 generation = *pass * grid_barriers_a_pass(p);  // the grid barriers the launch's passes before passed
    const float eps = (float)p.eps;
    const RowSquares no_squares = {nullptr, 0, 0}, ahead = {p.row_squares, 1, 0};
    const ScaledCopy no_copy = {nullptr, nullptr, nullptr};
    for (int l = 0; l < layers; ++l) {
        const LayerPointers& layer = p.layers[l];
        const int g = 4 * l;  // the pass's GEMM, and below the launch's fill of GEMM g + k
        const auto fill = [&](int k) { return *pass * fills + g + k; };
        ask_weights(p, g + 1, fill(1), buffer0(), buffer1(), mbarriers);
        wait_weights(fill(0), mbarriers, p.stall_report, p.counters);
        if (l == 0)  // the embeddings come unnormed; every later layer's input was scaled by the down phase before
            gemm_rows<QKV_C / 8, HIDDEN, NORM_HERE, false, false>(layer_input(p, 0, *pass), HIDDEN, rows, buffer0(),
                                                                 layer.input_norm, eps, no_squares, nullptr,
                                                                 p.qkv_out, QKV_N, blockIdx.x * QKV_C, partial(),
                                                                 partial_squares(), no_copy);
        else
            gemm_rows<QKV_C / 8, HIDDEN, NORM_AHEAD, false, false>(p.x_a_scaled, HIDDEN, rows, buffer0(), nullptr,
                                                                  eps, ahead, nullptr, p.qkv_out, QKV_N,
                                                                  blockIdx.x * QKV_C, partial(), partial_squares(),
                                                                  no_copy);
        grid_barrier(p.counters, ++generation, p.stall_report);
        ask_weights(p, g + 2, fill(2), buffer0(), buffer1(), mbarriers);  // gate/up streams in during attention and o
        attention(p, layer);
        grid_barrier(p.counters, ++generation, p.stall_report);
        wait_weights(fill(1), mbarriers, p.stall_report, p.counters);
        const ScaledCopy post_normed = {layer.post_norm, p.x_b_scaled, p.row_squares};
        gemm_rows<O_C / 8, ATTN_W, NO_NORM, false, true>(p.attn_out, ATTN_W, rows, buffer1(), nullptr, 0.0f,
                                                         no_squares, layer_input(p, l, *pass), p.x_b, HIDDEN,
                                                         blockIdx.x * O_C, partial(), partial_squares(), post_normed);
        grid_barrier(p.counters, ++generation, p.stall_report);
        ask_weights(p, g + 3, fill(3), buffer0(), buffer1(), mbarriers);
        wait_weights(fill(2), mbarriers, p.stall_report, p.counters);
        gemm_rows<2 * GU_C / 8, HIDDEN, NORM_AHEAD, true, false>(p.x_b_scaled, HIDDEN, rows, buffer0(), nullptr, eps,
                                                                ahead, nullptr, p.hidden, INTER, blockIdx.x * GU_C,
                                                                partial(), partial_squares(), no_copy);
        grid_barrier(p.counters, ++generation, p.stall_report);
        ask_weights(p, g + 4, fill(4), buffer0(), buffer1(), mbarriers);
        wait_weights(fill(3), mbarriers, p.stall_report, p.counters);
        const ScaledCopy next_normed = {l + 1 < layers ? p.layers[l + 1].input_norm : p.final_norm, p.x_a_scaled,
                                        p.row_squares};
        gemm_rows<DOWN_C / 8, INTER, NO_NORM, false, true>(p.hidden, INTER, rows, buffer1(), nullptr, 0.0f,
                                                           no_squares, p.x_b, p.x_a, HIDDEN, blockIdx.x * DOWN_C,
                                                           partial(), partial_squares(), next_normed);
        grid_barrier(p.counters, ++generation, p.stall_report);
    }
    // the final norm (scaled ahead by the last down phase) and the head, over each row's last token
    const int g = 4 * layers;
    const auto fill = [&](int k) { return *pass * fills + g + k; };
    if (!ask_next) ask_weights(p, g + 1, fill(1), buffer0(), buffer1(), mbarriers);  // nothing left
    wait_weights(fill(0), mbarriers, p.stall_report, p.counters);
    const RowSquares last_tokens = {p.row_squares, (int)p.tokens, (int)p.tokens - 1};
    gemm_rows<HEAD_C / 8, HIDDEN, NORM_AHEAD, false, false>(p.x_a_scaled + (p.tokens - 1) * HIDDEN,
                                                           p.tokens * HIDDEN, (int)p.rows, buffer0(), nullptr,
                                                           (float)p.final_eps, last_tokens, nullptr, p.logits, VOCAB,
                                                           blockIdx.x * HEAD_C, partial(), partial_squares(), no_copy);
    if (ask_next) {  // the next pass's q/k/v share goes where the head's was: it streams in while the rows draw
        __syncthreads();
        ask_weights(p, 0, fill(1), buffer0(), buffer1(), mbarriers);
    }
    if (p.draw_cap > 0) {  // every row's code from its logits, a block a row
        grid_barrier(p.counters, ++generation, p.stall_report);
        for (int row = blockIdx.x; row < (int)p.rows; row += gridDim.x)
            draw_row(p, row, *reinterpret_cast<DrawShared*>(partial()));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) decoder_pass(const Params p) {
    __shared__ __align__(8) unsigned long long fills[2];  // the weight copies' mbarriers (`fill_barrier`)
    const u32 mbarriers = shared_address(&fills[0]);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mbarriers) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mbarriers + 8) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#ifdef STALL_TEST
    if (blockIdx.x == 0)
        while (true) asm volatile("nanosleep.u32 1000;" ::: "memory");
#endif

    ask_weights(p, 0, 0, buffer0(), buffer1(), mbarriers);
    enter_launch(p.counters, p.stall_report);  // while the first weights stream in
#if PASSES_IN_LAUNCH == 1
    one_pass(p, OnlyPass{}, false, mbarriers);
#else
    __shared__ int pass;
#pragma unroll 1
    for (int next = 0; next < PASSES_IN_LAUNCH; ++next) {
        if (threadIdx.x == 0) pass = next;
        __syncthreads();
        one_pass(p, PassInShared{&pass}, next + 1 < PASSES_IN_LAUNCH, mbarriers);
        if (next + 1 < PASSES_IN_LAUNCH)  // every row's code drawn, every block past the head
            grid_barrier(p.counters, (next + 1) * grid_barriers_a_pass(p), p.stall_report);
    }
#endif
    // the last block past every barrier zeroes the counters for the next launch
    if (threadIdx.x == 0) {
        atomicSub(p.counters + 2, 1u);
        __threadfence();
        if (atomicAdd(p.counters + 1, 1u) == gridDim.x - 1) {
            p.counters[0] = 0;
            p.counters[1] = 0;
            __threadfence();
        }
    }
}
