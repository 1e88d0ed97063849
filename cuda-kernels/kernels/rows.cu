// Row movement: embedding lookups, placing encoder outputs at placeholder rows, 1-D convolution
// patches and pooling over time (grid-stride, one thread per output element).

extern "C" __global__ void gather_rows(const float* __restrict__ table,
                                       const unsigned* __restrict__ ids, float* __restrict__ out,
                                       unsigned n, unsigned dim) {
  MMGATE_FOR_EACH(i, (unsigned long long)n * dim) {
    out[i] = table[(unsigned long long)ids[i / dim] * dim + i % dim];
  }
}

// The same lookup in a bf16 table (a checkpoint's embeddings kept at half the memory), widened to
// f32: a bf16 is the top half of the f32 with the same value.
extern "C" __global__ void gather_rows_bf16(const unsigned short* __restrict__ table,
                                            const unsigned* __restrict__ ids,
                                            float* __restrict__ out, unsigned n, unsigned dim) {
  MMGATE_FOR_EACH(i, (unsigned long long)n * dim) {
    const unsigned bits = table[(unsigned long long)ids[i / dim] * dim + i % dim];
    out[i] = __uint_as_float(bits << 16);
  }
}

extern "C" __global__ void scatter_rows(float* __restrict__ dst, const unsigned* __restrict__ rows,
                                        const float* __restrict__ src, unsigned n, unsigned dim) {
  MMGATE_FOR_EACH(i, (unsigned long long)n * dim) {
    dst[(unsigned long long)rows[i / dim] * dim + i % dim] = src[i];
  }
}

// Element (t, c * kernel + j) of segment s's patches is input step t * stride + j - padding of
// channel c, zero outside the segment.
extern "C" __global__ void im2col_1d(const float* __restrict__ x, float* __restrict__ out,
                                     unsigned segments, unsigned len, unsigned channels,
                                     unsigned kernel, unsigned stride, unsigned padding,
                                     unsigned out_len) {
  const unsigned width = channels * kernel;
  MMGATE_FOR_EACH(i, (unsigned long long)segments * out_len * width) {
    const unsigned long long row = i / width;
    const unsigned col = (unsigned)(i % width);
    const unsigned seg = (unsigned)(row / out_len), t = (unsigned)(row % out_len);
    const unsigned c = col / kernel, j = col % kernel;
    const long long step = (long long)t * stride + j - (long long)padding;
    out[i] = step < 0 || step >= (long long)len
                 ? 0.0f
                 : x[((unsigned long long)seg * len + (unsigned long long)step) * channels + c];
  }
}

// Means of consecutive groups of `window` rows, summed in row order then scaled (as the CPU).
extern "C" __global__ void mean_pool_rows(const float* __restrict__ x, float* __restrict__ out,
                                          unsigned out_rows, unsigned dim, unsigned window) {
  const float inv = 1.0f / (float)window;
  MMGATE_FOR_EACH(i, (unsigned long long)out_rows * dim) {
    const unsigned long long r = i / dim, d = i % dim;
    float sum = 0.0f;
    for (unsigned w = 0; w < window; ++w) sum += x[(r * window + w) * dim + d];
    out[i] = sum * inv;
  }
}
