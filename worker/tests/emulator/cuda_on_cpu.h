// The CUDA builtins kernels.cu uses, on the CPU, for the test suite's emulator: each CUDA
// thread of a block is an OS thread; __syncthreads and warp shuffles are barriers, atomics
// std::atomic_ref. Float arithmetic is IEEE single precision with no contraction
// (-ffp-contract=off), as the kernels are compiled for the device (--fmad=false), so the
// emulator gives the device's bits.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define KVGATE_EMULATED 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
extern thread_local Dim3 threadIdx, blockIdx;
extern Dim3 blockDim, gridDim;

struct BlockSync {
    std::barrier<>* block;
    std::vector<std::barrier<>*> warps;
    std::vector<uint64_t> exchange;
};
extern BlockSync* block_sync;

inline void __syncthreads() { block_sync->block->arrive_and_wait(); }

template <class T> T __shfl_sync(unsigned, T v, int src) {
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint64_t* slots = &block_sync->exchange[warp * 32];
    std::memcpy(&slots[lane], &v, sizeof(T));
    block_sync->warps[warp]->arrive_and_wait();
    T out;
    std::memcpy(&out, &slots[((unsigned)src) % 32], sizeof(T));
    block_sync->warps[warp]->arrive_and_wait();
    return out;
}

template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return __shfl_sync(mask, v, (int)((threadIdx.x % 32) ^ (unsigned)lane_mask));
}

template <class T> T atomicAdd(T* at, T v) { return std::atomic_ref<T>(*at).fetch_add(v); }

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float v) { unsigned u; std::memcpy(&u, &v, 4); return u; }

inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}

inline int __vsub4(int a, int b) {
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)(uint8_t)((a >> (8 * i)) - (b >> (8 * i))) << (8 * i);
    return (int)r;
}

inline unsigned short to_f16(float x) {
    _Float16 h = (_Float16)x;
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

inline float from_f16(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}

#include <algorithm>
using std::fmaf;
using std::max;
using std::min;
using std::fmaxf;
using std::fminf;
