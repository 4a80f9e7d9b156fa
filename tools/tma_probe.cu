// TMA probe: can Hopper's bulk-copy engine (cp.async.bulk, the TMA unit
// of each SM) read scattered groups out of pinned, device-mapped host
// memory nearer the bus limit than kvfs's gather kernel
// (src/gpu/kernels/gather.cu, loads by every thread)? Same run, same
// groups: 64 tickets of 16 MiB, 4 KiB or 16 KiB groups picked at random
// from a 4 GiB buffer allocated as kvfs's T1 is (cuMemHostAlloc,
// portable, mapped, 256 MiB chunks), on one stream or four, against one
// big pinned H2D copy. Every variant's bytes are checked against the
// host's.
// On a GPU machine (CUDA toolkit, sm_90 or later; no cargo needed):
//   nvcc -O3 -arch=sm_90 -o /tmp/tma_probe tools/tma_probe.cu && /tmp/tma_probe [CHUNKS]
// CHUNKS: 256 MiB chunks of host buffer (default 16: 4 GiB).
// First run (an H100, PCI 00:06.0, 2026-12-07, baseline 55.2 GB/s): every
// variant's bytes right; 4 KiB groups: kvfs_gather 49.9 / 50.4 GB/s (1 / 4
// streams), U=8 49.7 / 50.2, U=16 49.3 / 48.9, TMA in 4 KiB pieces
// 47.6–48.7 / 49.2–49.3; 16 KiB groups: kvfs_gather 49.5 / 50.4, TMA in
// 16 KiB pieces 49.5–50.0 / 50.2–50.4. The TMA reads host memory no
// faster than the threads' loads: both stop at ~0.91 of the bus.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include "probe_common.cuh"
#include "../src/gpu/kernels/gather.cu"

// The gather kernel with U loads in flight a thread (kvfs's is U = 4).
template <int U>
__global__ void __launch_bounds__(KVFS_THREADS)
gather_u(const Desc* __restrict__ descs, unsigned int n, unsigned long long bytes) {
  const unsigned long long per = bytes / 16, total = per * n;
  const unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * U;
  uint4 v[U];
  uint4* to[U];
#pragma unroll
  for (int k = 0; k < U; k++) {
    to[k] = 0;
    unsigned long long w = base + threadIdx.x + (unsigned long long)k * blockDim.x;
    if (w < total) {
      unsigned long long g = w / per, o = w - g * per;
      Desc d = descs[g];
      v[k] = reinterpret_cast<const uint4*>(d.src)[o];
      to[k] = reinterpret_cast<uint4*>(d.dst) + o;
    }
  }
#pragma unroll
  for (int k = 0; k < U; k++)
    if (to[k]) *to[k] = v[k];
}

__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Bulk copies: one thread a block moves pieces of `piece` bytes (a group,
// or a part of one), each host -> shared memory by cp.async.bulk (the
// TMA), then shared -> the destination by cp.async.bulk, STAGES pieces in
// flight a block.
template <int STAGES>
__global__ void tma_gather(const Desc* __restrict__ descs, unsigned int n, unsigned long long bytes, unsigned piece) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) unsigned long long bar[STAGES];
  if (threadIdx.x != 0) return;
  const unsigned per = (unsigned)(bytes / piece);
  const unsigned long long total = (unsigned long long)per * n;
  for (int s = 0; s < STAGES; s++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&bar[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const unsigned long long first = blockIdx.x, step = gridDim.x;
  const unsigned long long m = first < total ? (total - first + step - 1) / step : 0;
  auto load = [&](unsigned long long j) {
    unsigned long long i = first + j * step;
    unsigned g = (unsigned)(i / per), o = (unsigned)(i % per);
    const char* src = (const char*)descs[g].src + (unsigned long long)o * piece;
    int s = (int)(j % STAGES);
    unsigned b = smem(&bar[s]), d = smem(buf + (size_t)s * piece);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(piece) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(d), "l"(src), "r"(piece), "r"(b) : "memory");
  };
  for (unsigned long long j = 0; j < m && j < STAGES; j++) load(j);
  for (unsigned long long j = 0; j < m; j++) {
    int s = (int)(j % STAGES);
    unsigned parity = (unsigned)((j / STAGES) & 1), b = smem(&bar[s]), ok = 0;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok) : "r"(b), "r"(parity) : "memory");
    unsigned long long i = first + j * step;
    unsigned g = (unsigned)(i / per), o = (unsigned)(i % per);
    char* dst = (char*)descs[g].dst + (unsigned long long)o * piece;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst), "r"(smem(buf + (size_t)s * piece)), "r"(piece) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j + STAGES < m) {
      // Stage s is read by the store just issued before the next load fills it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(j + STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main(int argc, char** argv) {
  size_t chunk = 256ull << 20; int nchunks = argc > 1 ? atoi(argv[1]) : 16;
  std::vector<char*> ch(nchunks);
  for (int i = 0; i < nchunks; i++) {
    CK(cudaHostAlloc((void**)&ch[i], chunk, cudaHostAllocMapped | cudaHostAllocPortable));
    for (size_t k = 0; k < chunk / 8; k++) ((unsigned long long*)ch[i])[k] = ((unsigned long long)i << 40) ^ (k * 0x9E3779B97F4A7C15ull);
  }
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t tick = 16ull << 20; char* dst; CK(cudaMalloc(&dst, 4 * tick));
  char* big; CK(cudaMalloc(&big, 256ull << 20));
  cudaStream_t st[4]; for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  auto base = [&]() { return h2d_baseline(big, ch[0], st[0]); };
  printf("%d SMs; baseline H2D 256 MiB: %.2f GB/s\n", sms, base());
  std::mt19937_64 rng(1);
  const int T = 64;
  std::vector<char> host(tick), got(tick);
  for (size_t gb : {4096ul, 16384ul}) {
    size_t n = tick / gb, groups = (size_t)nchunks * chunk / gb;
    std::vector<Desc*> dd(T);
    std::vector<std::vector<size_t>> picks(T);
    for (int t = 0; t < T; t++) {
      CK(cudaHostAlloc((void**)&dd[t], n * sizeof(Desc), cudaHostAllocMapped));
      picks[t].resize(n);
      for (size_t i = 0; i < n; i++) {
        size_t p = picks[t][i] = rng() % groups, off = p * gb;
        void* dp; CK(cudaHostGetDevicePointer(&dp, ch[off / chunk] + off % chunk, 0));
        dd[t][i].src = (unsigned long long)dp; dd[t][i].dst = (unsigned long long)(dst + (t % 4) * tick + i * gb);
      }
      Desc* dev; CK(cudaHostGetDevicePointer((void**)&dev, dd[t], 0)); dd[t] = dev;
    }
    auto check = [&](const char* what) {
      // The last ticket on slot 3 of dst: T - 1 (T is a multiple of 4).
      CK(cudaMemcpy(got.data(), dst + 3 * tick, tick, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < n; i++) {
        size_t off = picks[T - 1][i] * gb;
        if (memcmp(got.data() + i * gb, ch[off / chunk] + off % chunk, gb)) { printf("  %s: group %zu differs\n", what, i); return false; }
      }
      return true;
    };
    auto run = [&](const char* what, auto launch) {
      float res[2];
      for (int streams : {1, 4}) {
        float best = 0;
        for (int r = 0; r < 5; r++) {
          CK(cudaMemset(dst, 0, 4 * tick));
          CK(cudaDeviceSynchronize()); CK(cudaEventRecord(a, 0));
          for (int t = 0; t < T; t++) launch(dd[t], st[t % streams]);
          CK(cudaGetLastError());
          CK(cudaDeviceSynchronize()); CK(cudaEventRecord(b, 0)); CK(cudaEventSynchronize(b));
          float ms; CK(cudaEventElapsedTime(&ms, a, b)); best = std::max(best, (float)(T * tick / ms / 1e6));
        }
        res[streams == 4] = best;
      }
      bool ok = check(what);
      printf("gb %5zu %-28s 1 stream %6.2f GB/s, 4 streams %6.2f GB/s%s\n", gb, what, res[0], res[1], ok ? "" : "  WRONG BYTES");
    };
    unsigned blocks4 = (unsigned)((tick / 16 + KVFS_THREADS * KVFS_UNROLL - 1) / (KVFS_THREADS * KVFS_UNROLL));
    run("kvfs_gather (U=4)", [&](Desc* d, cudaStream_t s) { kvfs_gather<<<blocks4, KVFS_THREADS, 0, s>>>(d, (unsigned)n, gb); });
    run("gather U=8", [&](Desc* d, cudaStream_t s) { gather_u<8><<<blocks4 / 2, KVFS_THREADS, 0, s>>>(d, (unsigned)n, gb); });
    run("gather U=16", [&](Desc* d, cudaStream_t s) { gather_u<16><<<blocks4 / 4, KVFS_THREADS, 0, s>>>(d, (unsigned)n, gb); });
    for (unsigned piece : {4096u, 16384u}) {
      if (piece > gb) continue;
      for (int per_sm : {1, 2, 4}) {
        char what[64];
        if (piece == 4096) {
          CK(cudaFuncSetAttribute(tma_gather<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 4096));
          snprintf(what, sizeof what, "tma 4K x8 stages, %d/SM", per_sm);
          run(what, [&](Desc* d, cudaStream_t s) { tma_gather<8><<<sms * per_sm, 32, 8 * 4096, s>>>(d, (unsigned)n, gb, piece); });
        } else {
          CK(cudaFuncSetAttribute(tma_gather<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 16384));
          snprintf(what, sizeof what, "tma 16K x4 stages, %d/SM", per_sm);
          run(what, [&](Desc* d, cudaStream_t s) { tma_gather<4><<<sms * per_sm, 32, 4 * 16384, s>>>(d, (unsigned)n, gb, piece); });
        }
      }
    }
  }
  printf("baseline H2D 256 MiB again: %.2f GB/s\n", base());
}
