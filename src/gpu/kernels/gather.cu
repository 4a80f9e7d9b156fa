// kvfs gather kernel: copies n groups of `bytes` bytes, each from its own
// source to its own destination, in 16-byte words.
// Regenerate gather.ptx with (or, with no nvcc, NVRTC: compute_80, no other options):
//   nvcc -ptx -arch=compute_80 -O3 -o src/gpu/kernels/gather.ptx src/gpu/kernels/gather.cu
// (compute_80 PTX is JIT-compiled by the driver for Ampere, Hopper and later.)
//
// The words of all groups form one range; each block takes a chunk of
// KVFS_UNROLL × blockDim.x consecutive words, and each thread issues its
// KVFS_UNROLL loads before any store, so many reads across PCIe are in
// flight per thread. Consecutive threads read consecutive words of one
// group: a warp reads 512 contiguous bytes.
//
// The descriptors may live in pinned host memory (the table the host
// filled): each block first reads the few it needs into shared memory,
// once, so no copy of the table precedes the kernel and no word's load
// waits on a descriptor read of its own across PCIe.

#define KVFS_UNROLL 4
// Threads per block (GATHER_THREADS in cuda.rs).
#define KVFS_THREADS 256
// Descriptors a block may need: its words span at most this many groups
// (groups of at least 16 bytes; one more where a chunk straddles).
#define KVFS_BLOCK_DESCS (KVFS_UNROLL * KVFS_THREADS + 1)

struct Desc {
    unsigned long long src;  // device address of the source (0: skip this entry)
    unsigned long long dst;  // device address of the destination
};

// Waiting for the descriptors is done by the stream (cuStreamWaitValue32),
// so they are complete when this runs. A block past the last word has
// nothing to do (the grid is rounded up).
// Reads the descriptors of groups [g0, g0 + count) into `out`, all threads.
__device__ __forceinline__ void load_descs(Desc* out, const Desc* __restrict__ descs,
                                           unsigned long long g0, unsigned int count) {
    for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) out[i] = descs[g0 + i];
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(KVFS_THREADS)
kvfs_gather(const Desc* __restrict__ descs, unsigned int n, unsigned long long bytes) {
    __shared__ Desc sd[KVFS_BLOCK_DESCS];
    const unsigned long long per = bytes / 16;  // words per group
    const unsigned long long total = per * n;
    const unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * KVFS_UNROLL;
    const unsigned long long first = base + threadIdx.x;
    const unsigned long long last = min(base + blockDim.x * KVFS_UNROLL, total) - 1;
    const unsigned long long g0 = base / per;
    load_descs(sd, descs, g0, (unsigned int)(last / per - g0 + 1));
    uint4 v[KVFS_UNROLL];
    uint4* to[KVFS_UNROLL];
#pragma unroll
    for (int k = 0; k < KVFS_UNROLL; k++) {
        to[k] = 0;
        unsigned long long w = first + (unsigned long long)k * blockDim.x;
        if (w < total) {
            unsigned long long g = w / per;
            unsigned long long o = w - g * per;
            Desc d = sd[g - g0];
            if (d.src != 0) {
                v[k] = reinterpret_cast<const uint4*>(d.src)[o];
                to[k] = reinterpret_cast<uint4*>(d.dst) + o;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < KVFS_UNROLL; k++) {
        if (to[k] != 0) *to[k] = v[k];
    }
}

// Strided groups: the same copy, with one side of every descriptor laid
// out as rows of `row` bytes, `pitch` bytes apart (an engine's layout;
// the other side, a T1 or staging slot, contiguous): the destination
// with `strided_dst` (a restore), else the source (a store). Row and pitch
// are the launch's (the caller launches a batch of one shape this way),
// both multiples of 16; the division is 32-bit (a group's words fit).
extern "C" __global__ void __launch_bounds__(KVFS_THREADS)
kvfs_gather_rows(const Desc* __restrict__ descs, unsigned int n, unsigned long long bytes,
                 unsigned long long row, unsigned long long pitch, unsigned int strided_dst) {
    __shared__ Desc sd[KVFS_BLOCK_DESCS];
    const unsigned int per = (unsigned int)(bytes / 16);
    const unsigned int rw = (unsigned int)(row / 16);
    const unsigned long long pw = pitch / 16;
    const unsigned long long total = (unsigned long long)per * n;
    const unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * KVFS_UNROLL;
    const unsigned long long first = base + threadIdx.x;
    const unsigned long long last = min(base + blockDim.x * KVFS_UNROLL, total) - 1;
    const unsigned long long g0 = base / per;
    load_descs(sd, descs, g0, (unsigned int)(last / per - g0 + 1));
    uint4 v[KVFS_UNROLL];
    uint4* to[KVFS_UNROLL];
#pragma unroll
    for (int k = 0; k < KVFS_UNROLL; k++) {
        to[k] = 0;
        unsigned long long w = first + (unsigned long long)k * blockDim.x;
        if (w < total) {
            unsigned long long g = w / per;
            unsigned int o = (unsigned int)(w - g * per);
            unsigned int r = o / rw;
            unsigned long long s = (unsigned long long)r * pw + (o - r * rw);
            Desc d = sd[g - g0];
            if (d.src != 0) {
                unsigned long long from = strided_dst ? o : s;
                unsigned long long into = strided_dst ? s : o;
                v[k] = reinterpret_cast<const uint4*>(d.src)[from];
                to[k] = reinterpret_cast<uint4*>(d.dst) + into;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < KVFS_UNROLL; k++) {
        if (to[k] != 0) *to[k] = v[k];
    }
}
