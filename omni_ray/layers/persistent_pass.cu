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
// by difference (`benchmarks/persistent_pass_probe.py`), SKIP_ATTENTION, SKIP_GEMMS and SKIP_WEIGHTS leave one part
// out and NO_WAIT computes without waiting for the weights' copies (the results are then wrong); CP_ASYNC_COPIES
// copies the weights as the first version did. A served build sets none of them.
// No system headers: NVRTC (or nvcc) builds it with this folder as the include path.

#include "persistent_pass_common.cuh"
#include "persistent_pass_phases.cuh"
#include "persistent_pass_draw.cuh"

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
    static_assert(sizeof(DrawShared) <= PARTIAL_FLOATS * sizeof(float), "the draw's scratch fits the partial sums'");

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
    const RowSquares no_squares = {nullptr, 0, 0}, ahead = {p.row_squares, 1, 0};
    const ScaledCopy no_copy = {nullptr, nullptr, nullptr};
    ask_weights(p, 0, buffer0, buffer1, barriers);
    for (int l = 0; l < layers; ++l) {
        const LayerPointers& layer = p.layers[l];
        const bf16_t* x = l == 0 ? p.embeds : p.x_a;
        ask_weights(p, 4 * l + 1, buffer0, buffer1, barriers);
        wait_weights(4 * l, barriers);
        if (l == 0)  // the embeddings come unnormed; every later layer's input was scaled by the down phase before
            gemm_rows<QKV_C / 8, HIDDEN, NORM_HERE, false, false>(x, HIDDEN, rows, buffer0, layer.input_norm, eps,
                                                                 no_squares, nullptr, p.qkv_out, QKV_N,
                                                                 blockIdx.x * QKV_C, partial, partial_squares, no_copy);
        else
            gemm_rows<QKV_C / 8, HIDDEN, NORM_AHEAD, false, false>(p.x_a_scaled, HIDDEN, rows, buffer0, nullptr, eps,
                                                                  ahead, nullptr, p.qkv_out, QKV_N, blockIdx.x * QKV_C,
                                                                  partial, partial_squares, no_copy);
        grid_barrier(p.counters, ++generation);
        ask_weights(p, 4 * l + 2, buffer0, buffer1, barriers);  // gate/up streams in during attention and o
        attention(p, layer);
        grid_barrier(p.counters, ++generation);
        wait_weights(4 * l + 1, barriers);
        const ScaledCopy post_normed = {layer.post_norm, p.x_b_scaled, p.row_squares};
        gemm_rows<O_C / 8, ATTN_W, NO_NORM, false, true>(p.attn_out, ATTN_W, rows, buffer1, nullptr, 0.0f, no_squares,
                                                         x, p.x_b, HIDDEN, blockIdx.x * O_C, partial, partial_squares,
                                                         post_normed);
        grid_barrier(p.counters, ++generation);
        ask_weights(p, 4 * l + 3, buffer0, buffer1, barriers);
        wait_weights(4 * l + 2, barriers);
        gemm_rows<2 * GU_C / 8, HIDDEN, NORM_AHEAD, true, false>(p.x_b_scaled, HIDDEN, rows, buffer0, nullptr, eps,
                                                                ahead, nullptr, p.hidden, INTER, blockIdx.x * GU_C,
                                                                partial, partial_squares, no_copy);
        grid_barrier(p.counters, ++generation);
        ask_weights(p, 4 * l + 4, buffer0, buffer1, barriers);
        wait_weights(4 * l + 3, barriers);
        const ScaledCopy next_normed = {l + 1 < layers ? p.layers[l + 1].input_norm : p.final_norm, p.x_a_scaled,
                                        p.row_squares};
        gemm_rows<DOWN_C / 8, INTER, NO_NORM, false, true>(p.hidden, INTER, rows, buffer1, nullptr, 0.0f, no_squares,
                                                           p.x_b, p.x_a, HIDDEN, blockIdx.x * DOWN_C, partial,
                                                           partial_squares, next_normed);
        grid_barrier(p.counters, ++generation);
    }
    // the final norm (scaled ahead by the last down phase) and the head, over each row's last token
    ask_weights(p, 4 * layers + 1, buffer0, buffer1, barriers);  // nothing left
    wait_weights(4 * layers, barriers);
    const RowSquares last_tokens = {p.row_squares, (int)p.tokens, (int)p.tokens - 1};
    gemm_rows<HEAD_C / 8, HIDDEN, NORM_AHEAD, false, false>(p.x_a_scaled + (p.tokens - 1) * HIDDEN,
                                                           p.tokens * HIDDEN, (int)p.rows, buffer0, nullptr,
                                                           (float)p.final_eps, last_tokens, nullptr, p.logits, VOCAB,
                                                           blockIdx.x * HEAD_C, partial, partial_squares, no_copy);
    if (p.draw_cap > 0) {  // every row's code from its logits, a block a row
        grid_barrier(p.counters, ++generation);
        for (int row = blockIdx.x; row < (int)p.rows; row += gridDim.x)
            draw_row(p, row, *reinterpret_cast<DrawShared*>(partial));
    }
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
