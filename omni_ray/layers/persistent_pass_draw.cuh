// The persistent pass's optional last phase: each row's code drawn from its logits, as `engine/top_k_draw.py`'s
// Triton kernel draws it (top-k, top-p, counter noise, greedy rows), then looked up in the code embedding table and
// added to the row's feedback vector. One block a row, after a grid barrier (every block's logit columns written).
// Included by persistent_pass.cu.
//
// The top `cap` logits come from a radix select (four 8-bit digits of each logit's ordered bits, a shared histogram
// a round), ties at the threshold taken by lower token id as aten's top-k takes them; the candidates are ranked by
// counting. The same float operations as Triton's kernel (division rounded as it rounds, ex2.approx, libdevice's
// logf), so the draws agree unless a top-p sum, added in another order, lands within an ulp of its threshold.
//
// Opt-in (`engine.persistent_code_predictor_draws`): on an H100 the phase took about 25 us at one row
// against 20 for the Triton kernel and its launch gap. It is a chain of dependent steps (13 block barriers, shared
// atomics, a one-warp tail) in one block alone on its multiprocessor, not much work: 12k warp instructions a row.
#pragma once

#include "persistent_pass_common.cuh"

#define DRAW_MAX_CAP 256  // `top_k_draw.MAX_CAP`
// For measurements only (the results are then wrong): DRAW_STOP_AFTER 1 / 2 / 3 / 4 ends
// the phase after the loads and greedy argmax / the radix select / the candidates ranked / the draw.
#ifndef DRAW_STOP_AFTER
#define DRAW_STOP_AFTER 5
#endif
#define DRAW_PER_THREAD (VOCAB / THREADS)
#define DRAW_PER_LANE (DRAW_MAX_CAP / 32)

static_assert(THREADS >= DRAW_MAX_CAP && THREADS >= 256, "a thread per candidate and per histogram bin");
static_assert(VOCAB % THREADS == 0, "every thread holds as many of a row's logits");

// The draw's scratch, laid over the block's partial-sum area (free once the head's GEMM is done).
struct DrawShared {
    unsigned long long candidates[DRAW_MAX_CAP];  // (ordered logit, VOCAB - 1 - token) of the selected, any order
    float value[DRAW_MAX_CAP];       // by rank: the temperature-scaled logit (-inf past the row's top_k)
    float noise_term[DRAW_MAX_CAP];  // by rank: log(noise), subtracted from the value to score it
    int token_at[DRAW_MAX_CAP];      // by rank: the token id
    u32 histogram[2][256];  // a round's counts, and the next round's, zeroed meanwhile
    u32 ties[VOCAB / 32];  // a bit a token whose ordered logit equals the threshold
    u32 warp_taken[WARPS];
    u32 prefix, remaining;
    int greedy_col[WARPS];
    float greedy_value[WARPS];
    long long token;
};

__device__ __forceinline__ u32 mix32(u32 x) {  // `sampler.mix32`
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

// A float's bits as an unsigned that orders as the floats do (Triton's `_orderable`, its sign bit flipped), and back.
__device__ __forceinline__ u32 ordered_bits(float x) {
    const int bits = __float_as_int(x);
    return (u32)(bits ^ ((bits >> 31) & 0x7FFFFFFF)) ^ 0x80000000u;
}

__device__ __forceinline__ float from_ordered_bits(u32 ordered) {
    const int bits = (int)(ordered ^ 0x80000000u);
    return __int_as_float(bits ^ ((bits >> 31) & 0x7FFFFFFF));
}

// Triton's lowerings: tl.math.div_rn, `/` on fp32, tl.exp.
__device__ __forceinline__ float divide_rn_ftz(float a, float b) {
    float r;
    asm("div.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float divide_full(float a, float b) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float exp_approx(float x) {
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(__fmul_rn(x, 1.44269502f)));
    return r;
}

// Row `row`'s token into p.codes, its embedding into p.embedded and that plus its feedback into p.summed.
__device__ void draw_row(const Params& p, int row, DrawShared& s) {
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, cap = (int)p.draw_cap;
    const bf16_t* logits = p.logits + (long long)row * VOCAB;
    // the row's sampling, asked for first (used only after the select)
    const float temperature = p.temperature[row], dropped = 1.0f - p.top_p[row];
    const long long top_k = min(max(p.top_k[row], 1LL), (long long)cap);
    const u32 key0 = (u32)p.noise_keys[2 * row], key1 = (u32)p.noise_keys[2 * row + 1];
    for (int i = t; i < VOCAB / 32; i += THREADS) s.ties[i] = 0;
    if (t < 256) s.histogram[0][t] = 0;

    // greedy: the first of equal maxima of the logits as they are; the rest sees them divided by the temperature
    u32 key[DRAW_PER_THREAD];
    float best = NEG_INF;
    int best_col = VOCAB;
#pragma unroll
    for (int e = 0; e < DRAW_PER_THREAD; ++e) {
        const int col = t + e * THREADS;
        const float x = __uint_as_float((u32)logits[col] << 16);
        if (x > best || best_col == VOCAB) best = x, best_col = col;  // columns rise with e: ties keep the first
        key[e] = ordered_bits(divide_rn_ftz(x, fmaxf(temperature, 1e-5f)));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_col = __shfl_xor_sync(0xffffffffu, best_col, offset);
        if (other > best || (other == best && other_col < best_col)) best = other, best_col = other_col;
    }
    if (lane == 0) s.greedy_value[warp] = best, s.greedy_col[warp] = best_col;
    __syncthreads();
    if (DRAW_STOP_AFTER == 1) return;

    // the cap-th largest ordered logit, a byte at a time from the top
    u32 prefix = 0, mask = 0, remaining = (u32)cap;
    for (int round = 0; round < 4; ++round) {
        const int shift = 24 - 8 * round;
        u32* histogram = s.histogram[round & 1];
        if (t < 256) s.histogram[(round + 1) & 1][t] = 0;  // last read before the previous round's second barrier
        // (one atomic per distinct byte a warp, aggregated by __match_any_sync, measured 4 us slower on an H100)
#pragma unroll
        for (int e = 0; e < DRAW_PER_THREAD; ++e)
            if ((key[e] & mask) == prefix) atomicAdd(&histogram[(key[e] >> shift) & 255], 1u);
        __syncthreads();
        if (warp == 0) {  // lane l holds digits 255 - 8l down to 248 - 8l
            u32 counts[8], total = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) counts[j] = histogram[255 - 8 * lane - j], total += counts[j];
            u32 above = total;  // the counts of this lane's digits and every higher one
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const u32 other = __shfl_up_sync(0xffffffffu, above, offset);
                if (lane >= offset) above += other;
            }
            above -= total;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (above < remaining && above + counts[j] >= remaining) {
                    s.prefix = prefix | ((u32)(255 - 8 * lane - j) << shift);
                    s.remaining = remaining - above;
                }
                above += counts[j];
            }
        }
        __syncthreads();
        prefix = s.prefix, remaining = s.remaining, mask |= 255u << shift;
    }
    if (DRAW_STOP_AFTER == 2) return;

    // keep every logit above the threshold, and of those equal to it the `remaining` of lowest token id
#pragma unroll
    for (int e = 0; e < DRAW_PER_THREAD; ++e) {
        const int col = t + e * THREADS;
        if (key[e] == prefix) atomicOr(&s.ties[col >> 5], 1u << (col & 31));
    }
    __syncthreads();
    u32 taken = 0;  // a bit an element
#pragma unroll
    for (int e = 0; e < DRAW_PER_THREAD; ++e) {
        const int col = t + e * THREADS;
        bool take = key[e] > prefix;
        if (key[e] == prefix) {
            u32 below = __popc(s.ties[col >> 5] & ((1u << (col & 31)) - 1u));
            for (int w = 0; w < (col >> 5); ++w) below += __popc(s.ties[w]);
            take = below < remaining;
        }
        taken |= (u32)take << e;
    }
    // each thread's slots: the taken elements of the threads before it (a scan in the warp, then over the warps)
    const u32 count = __popc(taken);
    u32 before = count;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const u32 other = __shfl_up_sync(0xffffffffu, before, offset);
        if (lane >= offset) before += other;
    }
    if (lane == 31) s.warp_taken[warp] = before;
    before -= count;
    __syncthreads();
    for (int w = 0; w < warp; ++w) before += s.warp_taken[w];
#pragma unroll
    for (int e = 0; e < DRAW_PER_THREAD; ++e)
        if (taken >> e & 1u)
            s.candidates[before++] = ((unsigned long long)key[e] << 32) | (u32)(VOCAB - 1 - t - e * THREADS);
    __syncthreads();
    if (t < cap) {  // rank by counting (the keys are distinct: token ids in their low half), and the noise's term
        const unsigned long long mine = s.candidates[t];
        int rank = 0;
#pragma unroll 8
        for (int j = 0; j < cap; ++j) rank += s.candidates[j] > mine;
        const int token = VOCAB - 1 - (int)(u32)mine;
        const u32 hashed = mix32(mix32((u32)(token + (int)p.noise_offset) ^ key0) + key1);
        const float uniform = ((float)(hashed >> 8) + 0.5f) * (1.0f / 16777216.0f);
        s.value[rank] = rank < top_k ? from_ordered_bits((u32)(mine >> 32)) : NEG_INF;
        s.noise_term[rank] = logf(fmaxf(-logf(uniform), 1e-30f));
        s.token_at[rank] = token;
    }
    __syncthreads();
    if (DRAW_STOP_AFTER == 3) return;

    if (warp == 0) {  // lane l holds ranks l * per .. l * per + per - 1
        const int per = cap >= 32 ? cap / 32 : 1;
        float value[DRAW_PER_LANE], weight[DRAW_PER_LANE];
        float total = 0.0f;
        const float largest = s.value[0];
#pragma unroll
        for (int j = 0; j < DRAW_PER_LANE; ++j) {
            const int rank = lane * per + j;
            const bool valid = j < per && rank < cap;
            value[j] = valid ? s.value[rank] : NEG_INF;
            weight[j] = valid ? exp_approx(value[j] - largest) : 0.0f;
            total += weight[j];
        }
        total = warp_sum(total);
        // top-p: probability mass from the smallest kept up (each rank's own and every lower one's)
        float suffix = 0.0f, cumulative[DRAW_PER_LANE];
#pragma unroll
        for (int j = DRAW_PER_LANE - 1; j >= 0; --j) {
            suffix += divide_full(weight[j], total);
            cumulative[j] = suffix;
        }
        float later = suffix;  // this lane's sum, then the lanes above it added
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const float other = __shfl_down_sync(0xffffffffu, later, offset);
            if (lane + offset < 32) later += other;
        }
        later -= suffix;
        float best_score = NEG_INF;
        int best_rank = DRAW_MAX_CAP;
#pragma unroll
        for (int j = 0; j < DRAW_PER_LANE; ++j) {
            const int rank = lane * per + j;
            if (!(j < per && rank < cap)) continue;
            float v = value[j];
            if ((cumulative[j] + later <= dropped || v == NEG_INF) && rank > 0) v = NEG_INF;
            const float score = v - s.noise_term[rank];
            if (score > best_score || best_rank == DRAW_MAX_CAP) best_score = score, best_rank = rank;  // ties: the first
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best_score, offset);
            const int other_rank = __shfl_xor_sync(0xffffffffu, best_rank, offset);
            if (other > best_score || (other == best_score && other_rank < best_rank))
                best_score = other, best_rank = other_rank;
        }
        if (lane == 0) {
            const int drawn = min(best_rank < cap ? s.token_at[best_rank] : 0, VOCAB - 1);
            float greedy = s.greedy_value[0];
            int greedy_col = s.greedy_col[0];
            for (int w = 1; w < WARPS; ++w)
                if (s.greedy_value[w] > greedy || (s.greedy_value[w] == greedy && s.greedy_col[w] < greedy_col))
                    greedy = s.greedy_value[w], greedy_col = s.greedy_col[w];
            s.token = temperature > 0.0f ? drawn : greedy_col;
            p.codes[row] = s.token;
        }
    }
    __syncthreads();
    if (DRAW_STOP_AFTER == 4) return;

    // the code's embedding, and the row's feedback plus it (rounded once, as torch adds)
    const u32* vector = reinterpret_cast<const u32*>(p.table + s.token * HIDDEN);
    const u32* feedback = reinterpret_cast<const u32*>(p.feedback + (long long)row * HIDDEN);
    u32* embedded = reinterpret_cast<u32*>(p.embedded + (long long)row * HIDDEN);
    u32* summed = reinterpret_cast<u32*>(p.summed + (long long)row * HIDDEN);
    for (int i = t; i < HIDDEN / 2; i += THREADS) {
        const u32 pair = vector[i], previous = feedback[i];
        embedded[i] = pair;
        summed[i] = pack_bf16(low_half(previous) + low_half(pair), high_half(previous) + high_half(pair));
    }
}
