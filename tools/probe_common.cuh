// Shared by the CUDA probes in tools/ (gather_probe, parts_probe,
// tma_probe): the error check, and the baseline every figure of theirs is
// set against, one big pinned host-to-device copy in the same run.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
// GB/s of the best of five 256 MiB copies from pinned `src` to device `dst`
// on stream `s`.
inline float h2d_baseline(char* dst, const char* src, cudaStream_t s) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  float best = 0;
  for (int r = 0; r < 5; r++) {
    CK(cudaEventRecord(a, s));
    CK(cudaMemcpyAsync(dst, src, 256ull << 20, cudaMemcpyHostToDevice, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    best = std::max(best, (float)(256.0 * (1 << 20) / ms / 1e6));
  }
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  return best;
}
