// Helpers every kernel module shares. NVRTC compiles each module with this text in front of it (no
// CUDA headers are needed, so the kernels compile with NVRTC alone); the CPU simulator compiles it
// once, before all modules.
//
// Conventions: every buffer is row-major; lengths and dimensions are unsigned 32-bit unless an
// element count may pass 2^32 (then `unsigned long long`); element-wise kernels loop grid-stride,
// so any grid size is correct and the host picks one for occupancy.

#define MMGATE_FULL_MASK 0xffffffffu
// The most negative finite float: a score no real key has, without needing INFINITY.
#define MMGATE_NEG_MAX (-3.402823466e38f)

__device__ __forceinline__ float mmgate_warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(MMGATE_FULL_MASK, v, offset);
  return v;
}

__device__ __forceinline__ float mmgate_warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(MMGATE_FULL_MASK, v, offset));
  return v;
}

// The sum of `v` over the block, returned to every thread. blockDim.x must be a multiple of 32 (at
// most 1024) and every thread of the block must call it.
__device__ float mmgate_block_sum(float v) {
  __shared__ float partial[32];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = mmgate_warp_sum(v);
  // A previous call's readers may still be reading `partial`.
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const float mine = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
  return mmgate_warp_sum(mine);
}

// The activations of the backend's `Activation`, in its order, each as PyTorch computes it.
__device__ __forceinline__ float mmgate_activate(float x, int act) {
  switch (act) {
    case 0:  // SiLU
      return x / (1.0f + expf(-x));
    case 1:  // GELU, exact
      return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case 2:  // QuickGELU
      return x / (1.0f + expf(-1.702f * x));
    default: {  // GELU, tanh approximation
      const float inner = 0.7978846f * (x + 0.044715f * x * x * x);
      return 0.5f * x * (1.0f + tanhf(inner));
    }
  }
}

// Grid-stride loop over `n` elements.
#define MMGATE_FOR_EACH(i, n)                                                           \
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
       i < (n); i += (unsigned long long)gridDim.x * blockDim.x)
