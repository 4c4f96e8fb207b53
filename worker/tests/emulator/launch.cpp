// kernels.cu built for the CPU, and one entry point that runs a kernel over a grid as CUDA
// would: every block in turn, its threads at once (see cuda_on_cpu.h).
#include "cuda_on_cpu.h"

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
BlockSync* block_sync;

#include "kernels.cu"

namespace {

template <typename... A, std::size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A> std::function<void(void**)> invoker(void (*f)(A...)) {
    return [f](void** args) { call(f, args, std::index_sequence_for<A...>{}); };
}

#define KERNEL(name) {#name, invoker(&name)}
const std::map<std::string, std::function<void(void**)>> kernels = {
    KERNEL(embed),       KERNEL(rms_norm_q8), KERNEL(silu_q8),      KERNEL(matmul_q),
    KERNEL(rope_store),  KERNEL(attn_scores), KERNEL(attn_softmax), KERNEL(attn_pv),
    KERNEL(argmax),      KERNEL(top_k),
};

}  // namespace

// Runs kernel `name` on (gx, gy, gz) blocks of `block` threads (a multiple of 32) with
// `args` as cuLaunchKernel takes them. Returns 0, or -1 for an unknown kernel.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                          unsigned block, void** args) {
    auto kernel = kernels.find(name);
    if (kernel == kernels.end() || block == 0 || block % 32 != 0) return -1;
    // One launch at a time: the grid's shape, the barriers and each kernel's __shared__
    // variables are global here.
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    gridDim = {gx, gy, gz};
    blockDim = {block, 1, 1};
    std::barrier<> block_barrier(block);
    std::vector<std::barrier<>*> warps;
    for (unsigned w = 0; w < block / 32; w++) warps.push_back(new std::barrier<>(32));
    BlockSync sync{&block_barrier, warps, std::vector<uint64_t>(block)};
    block_sync = &sync;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; t++) {
        threads.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (unsigned z = 0; z < gz; z++)
                for (unsigned y = 0; y < gy; y++)
                    for (unsigned x = 0; x < gx; x++) {
                        blockIdx = {x, y, z};
                        kernel->second(args);
                        block_barrier.arrive_and_wait();
                    }
        });
    }
    for (auto& t : threads) t.join();
    for (auto* w : warps) delete w;
    return 0;
}
