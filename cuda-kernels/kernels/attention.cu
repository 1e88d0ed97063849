// Scaled dot-product attention, one warp per (query row, head), keys in chunks of 32 with an online
// softmax (running max and sum, rescaled as the max grows), so no score matrix is stored and any
// number of keys fits. Which keys a row sees comes from the host as a range per row
// (`key_begin[row]..key_end[row]`): a causal row sees up to its own position, a packed segment's
// row its segment's visible keys. Grouped-query attention: head h reads kv head h / (heads /
// kv_heads). Grid (q_rows, heads), block 32.

#define MMGATE_MAX_HEAD_DIM 256

extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, float* __restrict__ out,
                                     const unsigned* __restrict__ key_begin,
                                     const unsigned* __restrict__ key_end, unsigned heads,
                                     unsigned kv_heads, unsigned head_dim, float scale) {
  const unsigned row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  const unsigned kv_head = head / (heads / kv_heads);
  const unsigned long long q_stride = (unsigned long long)heads * head_dim;
  const unsigned long long kv_stride = (unsigned long long)kv_heads * head_dim;
  const float* query = q + row * q_stride + head * head_dim;
  float acc[MMGATE_MAX_HEAD_DIM / 32];
  for (unsigned t = 0; t < MMGATE_MAX_HEAD_DIM / 32; ++t) acc[t] = 0.0f;
  float running_max = MMGATE_NEG_MAX, running_sum = 0.0f;
  const unsigned end = key_end[row];
  for (unsigned first = key_begin[row]; first < end; first += 32) {
    const unsigned key = first + lane;
    float score = MMGATE_NEG_MAX;
    if (key < end) {
      const float* kr = k + key * kv_stride + kv_head * head_dim;
      float dot = 0.0f;
      for (unsigned d = 0; d < head_dim; ++d) dot += query[d] * kr[d];
      score = dot * scale;
    }
    const float new_max = fmaxf(running_max, mmgate_warp_max(score));
    const float p = key < end ? expf(score - new_max) : 0.0f;
    const float rescale = expf(running_max - new_max);
    running_sum = running_sum * rescale + mmgate_warp_sum(p);
    for (unsigned t = 0; t < MMGATE_MAX_HEAD_DIM / 32; ++t) acc[t] *= rescale;
    const unsigned count = end - first < 32 ? end - first : 32;
    for (unsigned j = 0; j < count; ++j) {
      const float pj = __shfl_sync(MMGATE_FULL_MASK, p, j);
      const float* vr = v + (first + j) * kv_stride + kv_head * head_dim;
      for (unsigned t = 0; t < MMGATE_MAX_HEAD_DIM / 32; ++t) {
        const unsigned d = lane + 32 * t;
        if (d < head_dim) acc[t] += pj * vr[d];
      }
    }
    running_max = new_max;
  }
  const float inv = 1.0f / running_sum;
  float* o = out + row * q_stride + head * head_dim;
  for (unsigned t = 0; t < MMGATE_MAX_HEAD_DIM / 32; ++t) {
    const unsigned d = lane + 32 * t;
    if (d < head_dim) o[d] = acc[t] * inv;
  }
}
