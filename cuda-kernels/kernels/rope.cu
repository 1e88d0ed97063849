// Rotary embedding in PyTorch's `rotate_half` convention, one thread per (row, head, pair): the
// pair (i, i + head_dim / 2) of each head turns by row `r`'s angles (`cos`/`sin` are
// `[rows, head_dim]`, so M-RoPE's per-section positions arrive already gathered).

extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ cos_table,
                                const float* __restrict__ sin_table, unsigned rows, unsigned heads,
                                unsigned head_dim) {
  const unsigned half = head_dim / 2;
  MMGATE_FOR_EACH(idx, (unsigned long long)rows * heads * half) {
    const unsigned i = (unsigned)(idx % half);
    const unsigned long long head_row = idx / half;  // row * heads + head
    const unsigned long long r = head_row / heads;
    float* h = x + head_row * head_dim;
    const float* c = cos_table + r * head_dim;
    const float* s = sin_table + r * head_dim;
    const float a = h[i], b = h[i + half];
    h[i] = a * c[i] - b * s[i];
    h[i + half] = b * c[i + half] + a * s[i + half];
  }
}
