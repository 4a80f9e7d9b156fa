// Gather probe: how fast kvfs's gather kernel (src/gpu/kernels/gather.cu)
// reads scattered groups out of pinned, device-mapped host memory, against
// one big pinned H2D copy in the same run: 16 MiB tickets of 4 KiB and
// 16 KiB groups picked from a span of 64 MiB, 1 GiB or all of the buffer,
// in random order or upwards, descriptors in host or device memory, 64
// tickets on one stream or four. The buffer is allocated as kvfs's T1 is
// (cuMemHostAlloc, portable, mapped, in 256 MiB chunks).
// On a GPU machine (CUDA toolkit; no cargo needed):
//   nvcc -O3 -arch=sm_90 -o /tmp/gather_probe tools/gather_probe.cu && /tmp/gather_probe [CHUNKS]
// CHUNKS: 256 MiB chunks of host buffer (default 48: 12 GiB).
// PROBE_ALLOC: how the buffer is allocated: `driver` (the default, as
// above), `thp` (mmap aligned to 2 MiB, MADV_HUGEPAGE, then
// cudaHostRegister: what KVFS_T1_PAGES=huge does) or `hugetlb`
// (MAP_HUGETLB 2 MiB pages, registered the same way; needs
// /proc/sys/vm/nr_hugepages). The run prints how much of the buffer the
// kernel gave huge pages (AnonHugePages / HugePages_Free).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <string>
#include <fstream>
#include <sys/mman.h>
#include "probe_common.cuh"
#include "../src/gpu/kernels/gather.cu"
int main(int argc, char** argv) {
  size_t chunk = 256ull << 20; int nchunks = argc > 1 ? atoi(argv[1]) : 48;  // 12 GiB
  std::vector<char*> ch(nchunks);
  const char* how = getenv("PROBE_ALLOC") ? getenv("PROBE_ALLOC") : "driver";
  for (int i = 0; i < nchunks; i++) {
    if (!strcmp(how, "driver")) { CK(cudaHostAlloc((void**)&ch[i], chunk, cudaHostAllocMapped | cudaHostAllocPortable)); continue; }
    bool tlb = !strcmp(how, "hugetlb");
    size_t huge = 2ull << 20, whole = tlb ? chunk : chunk + huge;
    void* m = mmap(nullptr, whole, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (tlb ? MAP_HUGETLB : 0), -1, 0);
    if (m == MAP_FAILED) { perror("mmap"); exit(1); }
    char* p = (char*)m + (tlb ? 0 : (huge - (size_t)m % huge) % huge);
    if (!tlb) madvise(p, chunk, MADV_HUGEPAGE);
    memset(p, 0, chunk);
    CK(cudaHostRegister(p, chunk, cudaHostRegisterMapped | cudaHostRegisterPortable));
    ch[i] = p;
  }
  { std::ifstream f("/proc/self/smaps_rollup"); std::string l; while (std::getline(f, l)) if (l.find("AnonHuge") == 0) printf("alloc %s: %s\n", how, l.c_str()); }
  { std::ifstream f("/proc/meminfo"); std::string l; while (std::getline(f, l)) if (l.find("HugePages_") == 0) printf("alloc %s: %s\n", how, l.c_str()); }
  { std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled"); std::string l; std::getline(f, l); printf("thp: %s\n", l.c_str()); }
  for (int i = 0; i < nchunks; i++) memset(ch[i], i, chunk);
  size_t tick = 16ull << 20; char* dst; CK(cudaMalloc(&dst, 4 * tick));
  char* big; CK(cudaMalloc(&big, 256ull << 20));
  cudaStream_t st[4]; for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  auto base = [&]() { return h2d_baseline(big, ch[0], st[0]); };
  printf("baseline H2D 256 MiB: %.2f GB/s\n", base());
  std::mt19937_64 rng(1);
  const int T = 64;  // tickets per trial
  for (size_t gb : {4096ul, 16384ul}) {
    size_t n = tick / gb;
    for (size_t span_mb : {64ul, 1024ul, (size_t)nchunks * 256}) {
      for (int order = 0; order < 2; order++) {   // 0 random, 1 ascending
        for (int descs_dev = 0; descs_dev < 2; descs_dev++) {
          size_t groups = (span_mb << 20) / gb;
          std::vector<Desc*> hd(T), dd(T);
          for (int t = 0; t < T; t++) {
            CK(cudaHostAlloc((void**)&hd[t], n * sizeof(Desc), cudaHostAllocMapped));
            std::vector<size_t> pick(n);
            for (auto& p : pick) p = rng() % groups;
            if (order) std::sort(pick.begin(), pick.end());
            for (size_t i = 0; i < n; i++) {
              size_t off = pick[i] * gb; char* h = ch[off / chunk] + off % chunk; void* dp;
              CK(cudaHostGetDevicePointer(&dp, h, 0));
              hd[t][i].src = (unsigned long long)dp; hd[t][i].dst = (unsigned long long)(dst + (t % 4) * tick + i * gb);
            }
            if (descs_dev) { CK(cudaMalloc(&dd[t], n * sizeof(Desc))); CK(cudaMemcpy(dd[t], hd[t], n * sizeof(Desc), cudaMemcpyHostToDevice)); }
            else CK(cudaHostGetDevicePointer((void**)&dd[t], hd[t], 0));
          }
          unsigned blocks = (unsigned)((tick / 16 + KVFS_THREADS * KVFS_UNROLL - 1) / (KVFS_THREADS * KVFS_UNROLL));
          float res[2];
          for (int streams : {1, 4}) {
            float best = 0;
            for (int r = 0; r < 5; r++) {
              CK(cudaDeviceSynchronize()); CK(cudaEventRecord(a, 0));
              for (int t = 0; t < T; t++) kvfs_gather<<<blocks, KVFS_THREADS, 0, st[t % streams]>>>(dd[t], (unsigned)n, gb);
              CK(cudaDeviceSynchronize()); CK(cudaEventRecord(b, 0)); CK(cudaEventSynchronize(b));
              float ms; CK(cudaEventElapsedTime(&ms, a, b)); best = std::max(best, (float)(T * tick / ms / 1e6));
            }
            res[streams == 4] = best;
          }
          printf("gb %5zu span %6zu MiB %s descs %s: 1 stream %.2f GB/s, 4 streams %.2f GB/s\n", gb, span_mb,
                 order ? "ascending" : "random   ", descs_dev ? "device" : "host  ", res[0], res[1]);
          for (int t = 0; t < T; t++) { if (descs_dev) cudaFree(dd[t]); cudaFreeHost(hd[t]); }
        }
      }
    }
  }
  printf("baseline H2D 256 MiB again: %.2f GB/s\n", base());
}
