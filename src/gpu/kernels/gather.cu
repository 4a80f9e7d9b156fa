// kvfs gather kernel: one block per group, 16-byte loads and stores.
// Regenerate gather.ptx with:
//   nvcc -ptx -arch=compute_80 -O3 -o src/gpu/kernels/gather.ptx src/gpu/kernels/gather.cu
// (compute_80 PTX is JIT-compiled by the driver for Ampere, Hopper and later.)

struct Desc {
    unsigned long long src;  // device address of the source (0: skip this entry)
    unsigned long long dst;  // device address of the destination
};

// Waits for `*ready` to become nonzero is done by the stream (cuStreamWaitValue32),
// so the descriptors are complete when this runs.
extern "C" __global__ void kvfs_gather(const Desc* __restrict__ descs, unsigned int n,
                                       unsigned long long bytes) {
    unsigned int i = blockIdx.x;
    if (i >= n) return;
    Desc d = descs[i];
    if (d.src == 0) return;
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(d.src);
    uint4* __restrict__ t = reinterpret_cast<uint4*>(d.dst);
    unsigned long long words = bytes / 16;
    for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) {
        t[w] = s[w];
    }
}
