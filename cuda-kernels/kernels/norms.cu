// Row norms: one block per row, its threads striding over the row, sums reduced over the block.

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                    float* __restrict__ out, unsigned dim, float eps) {
  const float* row = x + (unsigned long long)blockIdx.x * dim;
  float* o = out + (unsigned long long)blockIdx.x * dim;
  float squares = 0.0f;
  for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) squares += row[i] * row[i];
  const float inv = 1.0f / sqrtf(mmgate_block_sum(squares) / (float)dim + eps);
  for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) o[i] = weight[i] * (row[i] * inv);
}

// Two passes (mean, then the biased variance around it), as `nn.LayerNorm` and the CPU backend.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                      const float* __restrict__ bias, float* __restrict__ out,
                                      unsigned dim, float eps) {
  const float* row = x + (unsigned long long)blockIdx.x * dim;
  float* o = out + (unsigned long long)blockIdx.x * dim;
  float sum = 0.0f;
  for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i];
  const float mean = mmgate_block_sum(sum) / (float)dim;
  float squares = 0.0f;
  for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) {
    const float d = row[i] - mean;
    squares += d * d;
  }
  const float inv = 1.0f / sqrtf(mmgate_block_sum(squares) / (float)dim + eps);
  for (unsigned i = threadIdx.x; i < dim; i += blockDim.x)
    o[i] = (row[i] - mean) * inv * weight[i] + bias[i];
}
