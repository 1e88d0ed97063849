// Element-wise kernels (grid-stride).

extern "C" __global__ void add_assign(float* __restrict__ acc, const float* __restrict__ x,
                                      unsigned long long n) {
  MMGATE_FOR_EACH(i, n) acc[i] += x[i];
}

extern "C" __global__ void activate(float* x, unsigned long long n, int act) {
  MMGATE_FOR_EACH(i, n) x[i] = mmgate_activate(x[i], act);
}

extern "C" __global__ void gated_activate(float* __restrict__ gate, const float* __restrict__ up,
                                          unsigned long long n, int act) {
  MMGATE_FOR_EACH(i, n) gate[i] = mmgate_activate(gate[i], act) * up[i];
}

// Every row of `out` ([rows, dim]) set to `row`: a linear's bias, before the GEMM adds into it.
extern "C" __global__ void fill_rows(float* __restrict__ out, const float* __restrict__ row,
                                     unsigned rows, unsigned dim) {
  MMGATE_FOR_EACH(i, (unsigned long long)rows * dim) out[i] = row[i % dim];
}

// f32 to bf16 (the bits), rounding to nearest even as PyTorch does; NaN stays a quiet NaN. The
// input side of a bf16 GEMM.
extern "C" __global__ void to_bf16(const float* __restrict__ x, unsigned short* __restrict__ out,
                                   unsigned long long n) {
  MMGATE_FOR_EACH(i, n) {
    const unsigned bits = __float_as_uint(x[i]);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      out[i] = (unsigned short)((bits >> 16) | 0x0040u);
    } else {
      out[i] = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}
