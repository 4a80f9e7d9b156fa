// Parts probe: one 16 MiB restore alone (as one ticket at a time is),
// host-timed from its launch until a host waiting on its event sees it
// done: kvfs's gather kernel (src/gpu/kernels/gather.cu) as one launch, as
// the parts kvfs launches a restore pinned on admission in (64 groups,
// then each twice the last) on one stream, and those parts alternating
// over two streams; against one 16 MiB pinned cudaMemcpyAsync and the rate
// of one 256 MiB copy in the same run. 4 KiB and 16 KiB groups picked at
// random from 6 GiB of pinned, mapped host memory (as T1 is allocated).
// On a GPU machine (CUDA toolkit; no cargo needed):
//   nvcc -O3 -arch=sm_90 -o /tmp/parts_probe tools/parts_probe.cu && /tmp/parts_probe
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <chrono>
#include "probe_common.cuh"
#include "../src/gpu/kernels/gather.cu"
using clk = std::chrono::steady_clock;
int main() {
  size_t chunk = 256ull << 20; int nchunks = 24;
  std::vector<char*> ch(nchunks);
  for (int i = 0; i < nchunks; i++) { CK(cudaHostAlloc((void**)&ch[i], chunk, cudaHostAllocMapped | cudaHostAllocPortable)); memset(ch[i], i, chunk); }
  size_t tick = 16ull << 20; char* dst; CK(cudaMalloc(&dst, tick));
  char* big; CK(cudaMalloc(&big, 256ull << 20));
  cudaStream_t st[2]; for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t b, j; CK(cudaEventCreate(&b)); CK(cudaEventCreateWithFlags(&j, cudaEventDisableTiming));
  float best = h2d_baseline(big, ch[0], st[0]);
  printf("baseline H2D 256 MiB: %.2f GB/s (16 MiB at that rate: %.0f us)\n", best, tick / best / 1e3);
  std::mt19937_64 rng(1);
  for (size_t gb : {4096ul, 16384ul}) {
    size_t n = tick / gb, groups = (size_t)nchunks * chunk / gb;
    const int T = 64;
    std::vector<Desc*> hd(T), dd(T);
    for (int t = 0; t < T; t++) {
      CK(cudaHostAlloc((void**)&hd[t], n * sizeof(Desc), cudaHostAllocMapped));
      for (size_t i = 0; i < n; i++) { size_t off = (rng() % groups) * gb; void* dp; CK(cudaHostGetDevicePointer(&dp, ch[off / chunk] + off % chunk, 0));
        hd[t][i].src = (unsigned long long)dp; hd[t][i].dst = (unsigned long long)(dst + i * gb); }
      CK(cudaHostGetDevicePointer((void**)&dd[t], hd[t], 0));
    }
    std::vector<size_t> ends; { size_t at = 0, sz = 64; while (at < n) { size_t e = (at + 2 * sz >= n || ends.size() + 1 == 8) ? n : at + sz; ends.push_back(e); at = e; sz *= 2; } }
    auto launch = [&](int t, size_t from, size_t to, cudaStream_t s) { size_t words = (to - from) * gb / 16; unsigned bl = (unsigned)((words + KVFS_THREADS * KVFS_UNROLL - 1) / (KVFS_THREADS * KVFS_UNROLL));
      kvfs_gather<<<bl, KVFS_THREADS, 0, s>>>(dd[t] + from, (unsigned)(to - from), gb); };
    for (int mode = 0; mode < 4; mode++) {
      std::vector<double> lat;
      for (int rep = 0; rep < 3; rep++) for (int t = 0; t < T; t++) {
        CK(cudaDeviceSynchronize());
        auto t0 = clk::now();
        if (mode == 0) { launch(t, 0, n, st[0]); CK(cudaEventRecord(b, st[0])); }
        else if (mode == 1) { size_t at = 0; for (size_t e : ends) { launch(t, at, e, st[0]); at = e; } CK(cudaEventRecord(b, st[0])); }
        else if (mode == 2) { size_t at = 0; int k = 0; for (size_t e : ends) { launch(t, at, e, st[k % 2]); at = e; k++; } CK(cudaEventRecord(j, st[1])); CK(cudaStreamWaitEvent(st[0], j, 0)); CK(cudaEventRecord(b, st[0])); }
        else { CK(cudaMemcpyAsync(dst, ch[1], tick, cudaMemcpyHostToDevice, st[0])); CK(cudaEventRecord(b, st[0])); }
        CK(cudaEventSynchronize(b));
        lat.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
      }
      std::sort(lat.begin(), lat.end());
      const char* name[] = {"one kernel", "parts, 1 stream", "parts, 2 streams", "one 16 MiB memcpy"};
      printf("gb %5zu %-18s launch..seen median %6.0f us p10 %6.0f  (%.2f of the 256 MiB rate) parts %zu\n", gb, name[mode], lat[lat.size() / 2], lat[lat.size() / 10], tick / best / 1e3 / lat[lat.size() / 2], ends.size());
    }
  }
}
