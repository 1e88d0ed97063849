// A small simulator of CUDA's execution model on the CPU, enough to run mmgate's kernels unchanged:
// the kernel sources compile as C++ against this header instead of under NVRTC.
//
// What it models: a launch's grid of blocks and each block's threads; `threadIdx`, `blockIdx`,
// `blockDim`, `gridDim`; `__shared__` memory per block; `__syncthreads()`; warps of 32 lanes with
// the shuffles the kernels use. Each CUDA thread of a block is a fiber (its own stack and
// registers) on the launching OS thread; a fiber runs until it reaches a barrier (`__syncthreads`,
// or the warp-wide exchange inside a shuffle) or exits, and a barrier opens when every live thread
// it concerns has arrived. So no thread ever reads shared memory a barrier should have protected
// before the others wrote it, exactly as on a GPU, without thousands of OS threads. Blocks run one
// after another (CUDA promises no order between blocks, so a kernel correct on a GPU is correct
// here), which lets a function-local `static` stand in for a block's `__shared__` variables.
//
// What it checks, failing the launch loudly instead of computing garbage: launch limits (threads
// per block, grid dimensions), a shuffle whose mask is not exactly the warp's live lanes (the rule
// of the `_sync` intrinsics), a shuffle reading an exited or absent lane, and threads waiting at
// barriers that can never open (some at `__syncthreads`, others of the same warp in a shuffle).
#pragma once

#include <barrier>
#include <math.h>
#include <cstdint>
#include <cstring>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace mmgate_sim {

unsigned current_lane();

[[noreturn]] void fail(const char* what);
void sync_block();
uint64_t exchange(unsigned mask, uint64_t bits, unsigned src_lane, bool clamp_to_self);

}  // namespace mmgate_sim

extern dim3 threadIdx;
extern dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
// One block runs at a time, so a static is the running block's shared memory.
#define __shared__ static

inline void __syncthreads() { mmgate_sim::sync_block(); }

template <typename T>
T mmgate_sim_shuffle(unsigned mask, T value, unsigned src_lane, bool clamp_to_self) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles move at most 64 bits");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  const uint64_t got = mmgate_sim::exchange(mask, bits, src_lane, clamp_to_self);
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32) {
  return mmgate_sim_shuffle(mask, value, (unsigned)src_lane % (unsigned)width, false);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  (void)width;
  return mmgate_sim_shuffle(mask, value, mmgate_sim::current_lane() ^ (unsigned)lane_mask, false);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  (void)width;
  return mmgate_sim_shuffle(mask, value, mmgate_sim::current_lane() + delta, true);
}

inline float __uint_as_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline unsigned __float_as_uint(float f) {
  unsigned bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}
