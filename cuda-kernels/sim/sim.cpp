// The simulator's runtime (see sim.h) and the C entry point the Rust side launches kernels through,
// shaped like the driver's `cuLaunchKernel`: a kernel name, grid and block sizes, and an array of
// pointers to the arguments.
#include "sim.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace mmgate_sim {

struct Warp {
  explicit Warp(unsigned lanes) : lanes(lanes), barrier(lanes) {}
  const unsigned lanes;
  std::barrier<> barrier;
  uint64_t slots[32] = {};
  std::atomic<uint32_t> exited{0};
};

struct Block {
  explicit Block(unsigned threads) : barrier(threads) {}
  std::barrier<> barrier;
};

thread_local Warp* current_warp = nullptr;
thread_local Block* current_block = nullptr;
thread_local unsigned current_lane = 0;

void fail(const char* what) {
  std::fprintf(stderr,
               "CUDA simulator: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x,
               blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  std::abort();
}

void sync_block() { current_block->barrier.arrive_and_wait(); }

uint64_t exchange(unsigned mask, uint64_t bits, unsigned src_lane, bool clamp_to_self) {
  Warp* w = current_warp;
  const uint32_t live = (w->lanes == 32 ? 0xffffffffu : ((1u << w->lanes) - 1u)) & ~w->exited.load();
  if (mask != live) fail("a _sync shuffle's mask is not the warp's live lanes");
  w->slots[current_lane] = bits;
  w->barrier.arrive_and_wait();
  uint64_t got = bits;
  if (src_lane < w->lanes) {
    got = w->slots[src_lane];
  } else if (!clamp_to_self) {
    fail("a shuffle read a lane the warp does not have");
  }
  w->barrier.arrive_and_wait();
  return got;
}

using Entry = void (*)(void**);

template <typename... A, std::size_t... I>
void invoke(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<A*>(args[I])...);
}

template <typename... A>
void invoke(void (*kernel)(A...), void** args) {
  invoke(kernel, args, std::index_sequence_for<A...>{});
}

}  // namespace mmgate_sim

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

// The kernels themselves, compiled as C++ against sim.h.
#include "common.cuh"
#include "mmgate_sim_kernels.inc"

namespace {

struct Kernel {
  const char* name;
  mmgate_sim::Entry run;
};

#define MMGATE_SIM_KERNEL(name) {#name, [](void** args) { mmgate_sim::invoke(name, args); }},
const Kernel kernels[] = {
#include "mmgate_sim_registry.inc"
};

std::mutex one_launch_at_a_time;

int refuse(char* error, std::size_t error_len, const char* what) {
  std::snprintf(error, error_len, "%s", what);
  return 1;
}

}  // namespace

// Runs `name` over the grid; 0 on success, otherwise 1 with the reason in `error`. The arguments
// must match the kernel's parameters in number and type (the caller's contract, as with the driver).
extern "C" int mmgate_sim_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                                 unsigned shared_bytes, void** args, char* error,
                                 std::size_t error_len) {
  mmgate_sim::Entry run = nullptr;
  for (const Kernel& k : kernels) {
    if (std::strcmp(k.name, name) == 0) run = k.run;
  }
  if (run == nullptr) return refuse(error, error_len, "no such kernel");
  const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
  if (threads == 0 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0)
    return refuse(error, error_len, "a launch dimension is zero");
  if (threads > 1024 || block[2] > 64) return refuse(error, error_len, "more than 1024 threads per block");
  if (grid[0] > 2147483647u || grid[1] > 65535u || grid[2] > 65535u)
    return refuse(error, error_len, "grid dimensions over CUDA's limits");
  if (shared_bytes != 0)
    return refuse(error, error_len, "dynamic shared memory is not simulated (no kernel uses it)");

  std::lock_guard<std::mutex> lock(one_launch_at_a_time);
  gridDim = dim3{grid[0], grid[1], grid[2]};
  blockDim = dim3{block[0], block[1], block[2]};
  const unsigned n = (unsigned)threads;
  for (unsigned bz = 0; bz < grid[2]; ++bz)
    for (unsigned by = 0; by < grid[1]; ++by)
      for (unsigned bx = 0; bx < grid[0]; ++bx) {
        mmgate_sim::Block block_state(n);
        std::vector<std::unique_ptr<mmgate_sim::Warp>> warps;
        for (unsigned first = 0; first < n; first += 32)
          warps.push_back(std::make_unique<mmgate_sim::Warp>(n - first < 32 ? n - first : 32));
        std::vector<std::thread> workers;
        workers.reserve(n);
        for (unsigned t = 0; t < n; ++t) {
          workers.emplace_back([&, t] {
            blockIdx = dim3{bx, by, bz};
            threadIdx = dim3{t % block[0], t / block[0] % block[1], t / (block[0] * block[1])};
            mmgate_sim::current_block = &block_state;
            mmgate_sim::current_warp = warps[t / 32].get();
            mmgate_sim::current_lane = t % 32;
            run(args);
            // An exited thread no longer takes part in barriers (as on Volta and later).
            mmgate_sim::current_warp->exited.fetch_or(1u << (t % 32));
            mmgate_sim::current_warp->barrier.arrive_and_drop();
            block_state.barrier.arrive_and_drop();
          });
        }
        for (std::thread& w : workers) w.join();
      }
  return 0;
}

// 1 when the simulator has a kernel of that name.
extern "C" int mmgate_sim_has_kernel(const char* name) {
  for (const Kernel& k : kernels) {
    if (std::strcmp(k.name, name) == 0) return 1;
  }
  return 0;
}
