// The simulator's runtime (see sim.h) and the C entry point the Rust side launches kernels through,
// shaped like the driver's `cuLaunchKernel`: a kernel name, grid and block sizes, and an array of
// pointers to the arguments.
//
// Scheduling: the threads of a block are fibers (ucontext) on the launching OS thread. The
// scheduler runs every runnable fiber in turn until it waits at a barrier or exits; then it opens
// the barriers everyone concerned has reached (the block's, a warp's) and goes round again.
#include "sim.h"

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace mmgate_sim {
namespace {

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
  ucontext_t context;
  dim3 index;
  unsigned warp = 0, lane = 0;
  State state = State::Runnable;
};

struct WarpSlots {
  uint64_t values[32] = {};
  unsigned lanes = 0;
};

// One launch at a time (the statics below, and `__shared__` statics, are the running block's).
std::mutex one_launch_at_a_time;
ucontext_t scheduler;
std::vector<Fiber> fibers;
std::vector<WarpSlots> warps;
Fiber* running = nullptr;
void (*kernel_entry)(void**) = nullptr;
void** kernel_args = nullptr;
// Fiber stacks, reused across launches. Kernels use little stack; 256 KiB leaves room for libm.
constexpr std::size_t stack_bytes = 256 * 1024;
std::vector<std::unique_ptr<char[]>> stacks;

void wait(State at) {
  running->state = at;
  swapcontext(&running->context, &scheduler);
}

void fiber_main() {
  kernel_entry(kernel_args);
  running->state = State::Done;
  // Returning resumes `scheduler` (uc_link).
}

uint32_t live_lanes(unsigned warp) {
  uint32_t live = 0;
  const unsigned first = warp * 32;
  for (unsigned lane = 0; lane < warps[warp].lanes; ++lane) {
    if (fibers[first + lane].state != State::Done) live |= 1u << lane;
  }
  return live;
}

// Runs one block of `threads` fibers to completion.
void run_block(unsigned threads) {
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = fibers[t];
    f.index = dim3{t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y)};
    f.warp = t / 32;
    f.lane = t % 32;
    f.state = State::Runnable;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks[t].get();
    f.context.uc_stack.ss_size = stack_bytes;
    f.context.uc_link = &scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  for (;;) {
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = fibers[t];
      if (f.state != State::Runnable) continue;
      running = &f;
      threadIdx = f.index;
      swapcontext(&scheduler, &f.context);
    }
    bool all_done = true, block_barrier_full = true, any_at_block_barrier = false;
    for (unsigned t = 0; t < threads; ++t) {
      const State s = fibers[t].state;
      all_done = all_done && s == State::Done;
      any_at_block_barrier = any_at_block_barrier || s == State::AtBlockBarrier;
      block_barrier_full = block_barrier_full && (s == State::Done || s == State::AtBlockBarrier);
    }
    if (all_done) return;
    bool opened = false;
    if (block_barrier_full && any_at_block_barrier) {
      for (unsigned t = 0; t < threads; ++t) {
        if (fibers[t].state == State::AtBlockBarrier) fibers[t].state = State::Runnable;
      }
      opened = true;
    }
    for (unsigned w = 0; w * 32 < threads; ++w) {
      bool full = true, any = false;
      for (unsigned lane = 0; lane < warps[w].lanes; ++lane) {
        const State s = fibers[w * 32 + lane].state;
        any = any || s == State::AtWarpBarrier;
        full = full && (s == State::Done || s == State::AtWarpBarrier);
      }
      if (full && any) {
        for (unsigned lane = 0; lane < warps[w].lanes; ++lane) {
          Fiber& f = fibers[w * 32 + lane];
          if (f.state == State::AtWarpBarrier) f.state = State::Runnable;
        }
        opened = true;
      }
    }
    if (!opened) fail("threads wait at barriers that can never open (divergent __syncthreads/shuffle)");
  }
}

}  // namespace

unsigned current_lane() { return running->lane; }

void fail(const char* what) {
  std::fprintf(stderr, "CUDA simulator: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x,
               blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  std::abort();
}

void sync_block() { wait(State::AtBlockBarrier); }

uint64_t exchange(unsigned mask, uint64_t bits, unsigned src_lane, bool clamp_to_self) {
  WarpSlots& w = warps[running->warp];
  if (mask != live_lanes(running->warp)) fail("a _sync shuffle's mask is not the warp's live lanes");
  w.values[running->lane] = bits;
  wait(State::AtWarpBarrier);
  uint64_t got = bits;
  if (src_lane < w.lanes && (live_lanes(running->warp) >> src_lane & 1u)) {
    got = w.values[src_lane];
  } else if (!clamp_to_self) {
    fail("a shuffle read a lane the warp does not have");
  }
  // Nobody overwrites a slot (the next shuffle) before every lane has read this one.
  wait(State::AtWarpBarrier);
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

dim3 threadIdx;
dim3 blockIdx;
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
  if (threads > 1024 || block[2] > 64)
    return refuse(error, error_len, "more than 1024 threads per block");
  if (grid[0] > 2147483647u || grid[1] > 65535u || grid[2] > 65535u)
    return refuse(error, error_len, "grid dimensions over CUDA's limits");
  if (shared_bytes != 0)
    return refuse(error, error_len, "dynamic shared memory is not simulated (no kernel uses it)");

  std::lock_guard<std::mutex> lock(mmgate_sim::one_launch_at_a_time);
  const unsigned n = (unsigned)threads;
  while (mmgate_sim::stacks.size() < n)
    mmgate_sim::stacks.push_back(std::make_unique<char[]>(mmgate_sim::stack_bytes));
  mmgate_sim::fibers.assign(n, mmgate_sim::Fiber{});
  mmgate_sim::warps.assign((n + 31) / 32, mmgate_sim::WarpSlots{});
  for (unsigned w = 0; w < mmgate_sim::warps.size(); ++w)
    mmgate_sim::warps[w].lanes = n - w * 32 < 32 ? n - w * 32 : 32;
  mmgate_sim::kernel_entry = run;
  mmgate_sim::kernel_args = args;
  gridDim = dim3{grid[0], grid[1], grid[2]};
  blockDim = dim3{block[0], block[1], block[2]};
  for (unsigned bz = 0; bz < grid[2]; ++bz)
    for (unsigned by = 0; by < grid[1]; ++by)
      for (unsigned bx = 0; bx < grid[0]; ++bx) {
        blockIdx = dim3{bx, by, bz};
        mmgate_sim::run_block(n);
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
