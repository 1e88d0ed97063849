// A plugin's 8-bit samples expanded to the f32 values they stand for, on the device that encodes
// them (a quarter of the bytes cross to it). Layout as the host contract's `ByteSamples`: each row
// is `channels` runs of `run` samples, sample v in channel c's run stands for table[c * 256 + v],
// and each run stands for `repeats` copies of itself (a still image's temporal copies).

extern "C" __global__ void expand_samples(const unsigned char* __restrict__ samples,
                                          const float* __restrict__ table,
                                          float* __restrict__ out, unsigned long long values,
                                          unsigned run, unsigned channels, unsigned repeats) {
  const unsigned long long values_per_run = (unsigned long long)run * repeats;
  MMGATE_FOR_EACH(i, values) {
    const unsigned long long which_run = i / values_per_run;
    const unsigned offset = (unsigned)(i % values_per_run % run);
    const unsigned sample = samples[which_run * run + offset];
    out[i] = table[(unsigned)(which_run % channels) * 256u + sample];
  }
}
