//! The CUDA driver, found at run time or not at all.
//!
//! cudarc (dynamic loading) panics on first use where libcuda is absent, so
//! `probe` first opens the library itself with libloading, under the names
//! cudarc will try, and only then initialises the driver through cudarc.
//! Without a driver (or without a device) kvfs runs on plain host memory
//! and says so once. The primary context of device 0 is retained for the
//! process and made current on each thread before a driver call.

use cudarc::driver::{result, sys};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The driver's context of one device: device 0's pins kvfs's memory
/// (portable, so every context may use it); any device's serves the
/// CUDA regions of that device (see `cuda_on`).
pub struct Cuda {
    ctx: sys::CUcontext,
    pub device: i32,
    pub name: String,
    /// Devices the driver reports.
    pub count: i32,
    /// The NUMA node the device hangs off, where the machine has several
    /// (sysfs): pinned memory is taken there (see `alloc_pinned`).
    pub numa_node: Option<u32>,
    /// kvfs_gather and kvfs_gather_rows, loaded once in this context.
    gather: OnceLock<Result<[Kernel; 2], String>>,
}

// SAFETY: a CUcontext handle may be made current on any thread; the
// primary context is retained for the life of the process.
unsafe impl Send for Cuda {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Cuda {}

static CUDA: OnceLock<Option<Cuda>> = OnceLock::new();

/// Memory the driver holds for this process, for `.kvfs/stats`: pinned
/// host bytes (T1, staging, descriptor tables), device bytes (descriptor
/// copies) and open IPC mappings (clients' CUDA regions).
pub static PINNED_BYTES: AtomicU64 = AtomicU64::new(0);
pub static DEVICE_BYTES: AtomicU64 = AtomicU64::new(0);
pub static IPC_MAPPINGS: AtomicU64 = AtomicU64::new(0);

/// Streams of this process that may be waiting on a ready flag still
/// clear (`open`), and driver calls waiting to run while none is
/// (`pending`). See `quietly`.
struct Quiet {
    open: usize,
    pending: usize,
}

static QUIET: parking_lot::Mutex<Quiet> = parking_lot::const_mutex(Quiet {
    open: 0,
    pending: 0,
});
static QUIET_CHANGED: parking_lot::Condvar = parking_lot::Condvar::new();

/// Runs `f`, a driver call that may wait for the device to go idle while
/// holding the driver's own lock (allocating or freeing device or pinned
/// memory, opening or closing an IPC mapping), only while no stream waits
/// on a ready flag. Otherwise the device could be waiting on a flag that
/// only a thread blocked on that lock would set (a restore launching its
/// kernel right after its stream's wait): every driver call in the
/// process would stop. New flag waits hold off until `f` has run.
/// Never call it with a window of one's own open.
pub fn quietly<R>(f: impl FnOnce() -> R) -> R {
    let mut q = QUIET.lock();
    q.pending += 1;
    while q.open > 0 {
        QUIET_CHANGED.wait(&mut q);
    }
    // The lock is held while f runs: no window opens meanwhile.
    let r = f();
    q.pending -= 1;
    drop(q);
    QUIET_CHANGED.notify_all();
    r
}

/// Opens a window: the caller is about to make a stream wait on a ready
/// flag, and calls `close_window` once the flag is set.
pub fn open_window() {
    let mut q = QUIET.lock();
    while q.pending > 0 {
        QUIET_CHANGED.wait(&mut q);
    }
    q.open += 1;
}

/// Closes a window opened by `open_window` (its flag is set).
pub fn close_window() {
    let mut q = QUIET.lock();
    q.open -= 1;
    let idle = q.open == 0;
    drop(q);
    if idle {
        QUIET_CHANGED.notify_all();
    }
}

/// Names under which cudarc looks for the driver (a subset that covers Linux).
const LIB_NAMES: [&str; 2] = ["libcuda.so", "libcuda.so.1"];

fn library_present() -> bool {
    LIB_NAMES.iter().any(|n| {
        // SAFETY: loading the CUDA driver library runs its initialisers,
        // which is what using CUDA at all requires; the handle is dropped.
        unsafe { libloading::Library::new(*n) }.is_ok()
    })
}

/// Retains the primary context of `device`.
fn open_device(device: i32, count: i32) -> Result<Cuda, String> {
    let dev = result::device::get(device)
        .map_err(|e| format!("cannot open CUDA device {device}: {e:?}"))?;
    let name = result::device::get_name(dev).unwrap_or_else(|_| "?".into());
    // SAFETY: dev came from device::get.
    let ctx = unsafe { result::primary_ctx::retain(dev) }
        .map_err(|e| format!("cannot retain the context of CUDA device {device}: {e:?}"))?;
    Ok(Cuda {
        ctx,
        device,
        name,
        count,
        numa_node: numa_node_of(dev),
        gather: OnceLock::new(),
    })
}

/// The NUMA node of device `dev` (its PCI function's `numa_node` in
/// sysfs) where the machine has more than one node and
/// `KVFS_T1_NUMA` is not `off`; else None.
fn numa_node_of(dev: sys::CUdevice) -> Option<u32> {
    if std::env::var("KVFS_T1_NUMA").as_deref() == Ok("off") {
        return None;
    }
    let nodes = std::fs::read_dir("/sys/devices/system/node")
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("node"))
        .count();
    if nodes < 2 {
        return None;
    }
    let mut id = [0 as std::ffi::c_char; 32];
    // SAFETY: a buffer of the length given; dev came from device::get.
    let r = unsafe { sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), id.len() as i32, dev) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: the driver wrote a NUL-terminated string into id.
    let id = unsafe { std::ffi::CStr::from_ptr(id.as_ptr()) }
        .to_string_lossy()
        .to_lowercase();
    let node = std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?;
    // -1: the platform does not say.
    u32::try_from(node.trim().parse::<i32>().ok()?).ok()
}

/// This thread's memory policy while it lives: pages it faults in come
/// from `node` first (MPOL_PREFERRED), then anywhere; back to the default
/// policy on drop.
struct PreferNode(bool);

impl PreferNode {
    const MPOL_DEFAULT: libc::c_long = 0;
    const MPOL_PREFERRED: libc::c_long = 1;

    fn new(node: Option<u32>) -> PreferNode {
        let Some(node) = node.filter(|&n| n < 1024) else {
            return PreferNode(false);
        };
        let mut mask = [0u64; 16];
        mask[node as usize / 64] |= 1 << (node % 64);
        // SAFETY: a mask of 1024 bits; the kernel reads maxnode - 1 bits.
        let r = unsafe {
            libc::syscall(
                libc::SYS_set_mempolicy,
                Self::MPOL_PREFERRED,
                mask.as_ptr(),
                1025usize,
            )
        };
        PreferNode(r == 0)
    }
}

impl Drop for PreferNode {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: the default policy takes no mask.
            unsafe {
                libc::syscall(
                    libc::SYS_set_mempolicy,
                    Self::MPOL_DEFAULT,
                    std::ptr::null::<u64>(),
                    0usize,
                )
            };
        }
    }
}

fn init() -> Result<Cuda, String> {
    if !library_present() {
        return Err(format!(
            "no CUDA driver was found ({} not loadable)",
            LIB_NAMES.join(", ")
        ));
    }
    result::init().map_err(|e| format!("the CUDA driver did not initialise: {e:?}"))?;
    let n = result::device::get_count().map_err(|e| format!("cannot count CUDA devices: {e:?}"))?;
    if n < 1 {
        return Err("the CUDA driver sees no device".into());
    }
    open_device(0, n as i32)
}

/// The CUDA driver, probed once; None (logged once) where there is none.
pub fn cuda() -> Option<&'static Cuda> {
    CUDA.get_or_init(|| match init() {
        Ok(c) => {
            tracing::info!(
                "CUDA device {} ({}): T1 and staging buffers are pinned{}",
                c.device,
                c.name,
                c.numa_node
                    .map(|n| format!(", on NUMA node {n} (the device's)"))
                    .unwrap_or_default()
            );
            Some(c)
        }
        Err(why) => {
            tracing::info!("{why}: T1 stays in plain host memory; CUDA regions are unavailable");
            None
        }
    })
    .as_ref()
}

/// Contexts of devices other than 0, opened on first use.
static OTHERS: OnceLock<Vec<OnceLock<Result<Cuda, String>>>> = OnceLock::new();

/// Whether every pinned buffer's device address is its host address
/// (unified addressing): then T1, staging and descriptor tables, pinned
/// once in device 0's context, are reached at the same address from every
/// device's context. Cleared by the first allocation where it is not.
static PINNED_SAME_ADDRESS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// The context of CUDA device `device`: device 0's is `cuda()`; others
/// are opened on first use. Errors: no driver, a device the driver does
/// not report (the message names how many it does), or a machine where
/// pinned memory is not reached at one address from every device.
pub fn cuda_on(device: i32) -> Result<&'static Cuda, String> {
    let c0 = cuda().ok_or_else(|| unavailable_reason().to_string())?;
    if device == c0.device {
        return Ok(c0);
    }
    if device < 0 || device >= c0.count {
        return Err(format!(
            "CUDA device {device}: the driver reports {} device{} (0..{})",
            c0.count,
            if c0.count == 1 { "" } else { "s" },
            c0.count - 1
        ));
    }
    if !PINNED_SAME_ADDRESS.load(Ordering::Acquire) {
        return Err(format!(
            "CUDA device {device}: kvfs's pinned memory has another address on the \
             device than on the host here (no unified addressing), so only device 0 is served"
        ));
    }
    let others = OTHERS.get_or_init(|| (0..c0.count).map(|_| OnceLock::new()).collect());
    others[device as usize]
        .get_or_init(|| {
            let c = open_device(device, c0.count)?;
            tracing::info!("CUDA device {device} ({}): serving its regions", c.name);
            Ok(c)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Why CUDA work cannot be done here, for error messages.
pub fn unavailable_reason() -> &'static str {
    "no CUDA driver was found on this machine"
}

impl Cuda {
    /// Makes the context current on this thread.
    pub fn bind(&self) -> Result<(), String> {
        // SAFETY: ctx is the retained primary context.
        unsafe { result::ctx::set_current(self.ctx) }
            .map_err(|e| format!("cannot bind the CUDA context: {e:?}"))
    }

    /// Pinned, portable, device-mapped host memory: (host pointer, device
    /// pointer). On a machine of several NUMA nodes, taken from the
    /// device's node where it has room: the gather kernel reads T1 across
    /// PCIe, and reads from another node's memory cross the link between
    /// the sockets too.
    pub fn alloc_pinned(&self, len: usize) -> Result<(*mut u8, u64), String> {
        self.bind()?;
        let _near = PreferNode::new(self.numa_node);
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of len bytes; released by free_pinned.
        let p = quietly(|| unsafe { result::malloc_host(len, flags) })
            .map_err(|e| format!("cuMemHostAlloc({len}): {e:?}"))?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: p is mapped (DEVICEMAP) memory just allocated.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: p came from malloc_host and is not used elsewhere.
            quietly(|| unsafe {
                let _ = result::free_host(p);
            });
            return Err(format!("cuMemHostGetDevicePointer: {r:?}"));
        }
        PINNED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
        if d != p as u64 {
            PINNED_SAME_ADDRESS.store(false, Ordering::Release);
        }
        Ok((p.cast(), d))
    }

    /// Pins `len` bytes of host memory the caller owns at `p` (page
    /// aligned), portable and device-mapped: returns the device pointer.
    pub fn register_pinned(&self, p: *mut u8, len: usize) -> Result<u64, String> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller owns [p, p + len), mapped, and keeps it until
        // unregister_pinned.
        let r = quietly(|| unsafe { sys::cuMemHostRegister_v2(p.cast(), len, flags) });
        check(r, "cuMemHostRegister")?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: p was just registered with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p.cast(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: registered just above, used nowhere yet.
            quietly(|| unsafe {
                let _ = sys::cuMemHostUnregister(p.cast());
            });
            return Err(format!("cuMemHostGetDevicePointer: {r:?}"));
        }
        PINNED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
        if d != p as u64 {
            PINNED_SAME_ADDRESS.store(false, Ordering::Release);
        }
        Ok(d)
    }

    /// # Safety
    /// `p` was registered by `register_pinned` (with `len`) and nothing
    /// uses it any more.
    pub unsafe fn unregister_pinned(&self, p: *mut u8, len: usize) {
        PINNED_BYTES.fetch_sub(len as u64, Ordering::Relaxed);
        if self.bind().is_ok() {
            // SAFETY: the caller's contract.
            quietly(|| unsafe {
                let _ = sys::cuMemHostUnregister(p.cast());
            });
        }
    }

    /// # Safety
    /// `p` came from `alloc_pinned` of `len` bytes and nothing uses it any more.
    pub unsafe fn free_pinned(&self, p: *mut u8, len: usize) {
        PINNED_BYTES.fetch_sub(len as u64, Ordering::Relaxed);
        if self.bind().is_ok() {
            // SAFETY: the caller's contract.
            quietly(|| unsafe {
                let _ = result::free_host(p.cast());
            });
        }
    }
}

/// Device memory of this context (cuMemAlloc), freed on drop.
pub struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    len: usize,
    c: &'static Cuda,
}

impl DeviceBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.c.bind().is_ok() {
            // SAFETY: ptr came from cuMemAlloc and no copy uses it any more
            // (owners drop it only after the copies' event completed).
            quietly(|| unsafe {
                sys::cuMemFree_v2(self.ptr);
            });
            DEVICE_BYTES.fetch_sub(self.len as u64, Ordering::Relaxed);
        }
    }
}

impl Cuda {
    /// `len` bytes of device memory.
    pub fn alloc_device(&'static self, len: usize) -> Result<DeviceBuf, String> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: ptr receives a fresh allocation.
        let r = quietly(|| unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) });
        check(r, "cuMemAlloc")?;
        DEVICE_BYTES.fetch_add(len as u64, Ordering::Relaxed);
        Ok(DeviceBuf { ptr, len, c: self })
    }
}

/// One side of each copy of a gather laid out as rows: `row` bytes (a
/// multiple of 16 dividing the copy), `pitch` bytes apart; the destination
/// with `strided_dst`, else the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub row: u64,
    pub pitch: u64,
    pub strided_dst: bool,
}

/// A ticket's done word, written by its stream after its copy (see
/// `Cuda::write_signal`): (device address, value), or None.
pub type Signal = Option<(u64, u64)>;

/// The gather kernel, shipped as PTX text (source: kernels/gather.cu).
const GATHER_PTX: &str = concat!(include_str!("kernels/gather.ptx"), "\0");
/// Threads per gather block, and 16-byte words each thread copies
/// (KVFS_UNROLL in kernels/gather.cu): a block copies 16 KiB.
const GATHER_THREADS: u32 = 256;
const GATHER_UNROLL: u64 = 4;

fn check(r: sys::CUresult, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

/// A CUDA stream of this process.
pub struct Stream(sys::CUstream);
// SAFETY: stream handles may be used from any thread with the context bound.
unsafe impl Send for Stream {}

/// An interprocess event and its exported handle.
pub struct IpcEvent {
    ev: sys::CUevent,
    pub handle: [u8; 64],
    c: &'static Cuda,
}
// SAFETY: event handles may be used from any thread with the context bound.
unsafe impl Send for IpcEvent {}
// SAFETY: as for Send; the handle is never mutated after creation.
unsafe impl Sync for IpcEvent {}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if self.c.bind().is_ok() {
            // SAFETY: ev was created by new_ipc_event and is dropped once.
            unsafe {
                sys::cuEventDestroy_v2(self.ev);
            }
        }
    }
}

struct Kernel(sys::CUfunction);
// SAFETY: a loaded function handle is valid in the context on any thread.
unsafe impl Send for Kernel {}
// SAFETY: as for Send.
unsafe impl Sync for Kernel {}

impl Cuda {
    /// Opens a CUDA IPC memory handle; returns the allocation's base address
    /// and size (from cuMemGetAddressRange).
    pub fn open_ipc_mem(&self, handle: &[u8; 64]) -> Result<(u64, u64), String> {
        self.bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: h is a handle value; d receives the mapping.
        let r = quietly(|| unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut d,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        });
        check(r, "cuIpcOpenMemHandle")?;
        IPC_MAPPINGS.fetch_add(1, Ordering::Relaxed);
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: d is a valid device address just mapped.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, d) };
        if let Err(e) = check(r, "cuMemGetAddressRange") {
            self.close_ipc_mem(d);
            return Err(e);
        }
        Ok((d, (base + size as u64).saturating_sub(d)))
    }

    /// Closes a mapping made by open_ipc_mem.
    pub fn close_ipc_mem(&self, base: u64) {
        if self.bind().is_ok() {
            // SAFETY: base came from cuIpcOpenMemHandle and no copy uses it.
            quietly(|| unsafe {
                sys::cuIpcCloseMemHandle(base);
            });
            IPC_MAPPINGS.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// `close_ipc_mem` on a thread of its own, in order. Closing a
    /// mapping can wait for the device to go idle, and the device can be
    /// waiting on a restore's gate that jobs elsewhere open; the thread
    /// that lets go of a region (a FUSE thread closing a session, the
    /// completion thread) must not stop meanwhile.
    pub fn close_ipc_mem_later(&'static self, base: u64) {
        type Closing = (&'static Cuda, u64);
        static CLOSER: OnceLock<parking_lot::Mutex<std::sync::mpsc::Sender<Closing>>> =
            OnceLock::new();
        let tx = CLOSER.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Closing>();
            std::thread::Builder::new()
                .name("kvfs-ipc-close".into())
                .spawn(move || {
                    for (c, base) in rx {
                        c.close_ipc_mem(base);
                    }
                })
                .expect("cannot start the CUDA IPC close thread");
            parking_lot::Mutex::new(tx)
        });
        let _ = tx.lock().send((self, base));
    }

    pub fn new_stream(&self) -> Result<Stream, String> {
        self.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: s receives a new stream.
        let r = unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        };
        check(r, "cuStreamCreate")?;
        Ok(Stream(s))
    }

    /// An event other processes can open (cuIpcOpenEventHandle,
    /// torch.cuda.Event.from_ipc_handle) and wait on from their streams.
    pub fn new_ipc_event(&'static self) -> Result<IpcEvent, String> {
        self.bind()?;
        let mut ev = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: ev receives a new event.
        let r = unsafe { sys::cuEventCreate(&mut ev, flags) };
        check(r, "cuEventCreate")?;
        let mut h = sys::CUipcEventHandle_st { reserved: [0; 64] };
        // SAFETY: ev is an interprocess event.
        let r = unsafe { sys::cuIpcGetEventHandle(&mut h, ev) };
        if let Err(e) = check(r, "cuIpcGetEventHandle") {
            // SAFETY: ev was just created.
            unsafe {
                sys::cuEventDestroy_v2(ev);
            }
            return Err(e);
        }
        let mut handle = [0u8; 64];
        for (d, s) in handle.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Ok(IpcEvent {
            ev,
            handle,
            c: self,
        })
    }

    /// The gather kernel: for contiguous copies, or (`rows`) for rows.
    fn gather(&self, rows: bool) -> Result<sys::CUfunction, String> {
        self.gather
            .get_or_init(|| {
                self.bind()?;
                let mut m = std::ptr::null_mut();
                // SAFETY: GATHER_PTX is NUL-terminated PTX text.
                let r = unsafe { sys::cuModuleLoadData(&mut m, GATHER_PTX.as_ptr().cast()) };
                check(r, "cuModuleLoadData")?;
                let get = |name: &std::ffi::CStr| {
                    let mut f = std::ptr::null_mut();
                    // SAFETY: m is the loaded module; the name is NUL-terminated.
                    let r = unsafe { sys::cuModuleGetFunction(&mut f, m, name.as_ptr()) };
                    check(r, "cuModuleGetFunction").map(|()| Kernel(f))
                };
                Ok([get(c"kvfs_gather")?, get(c"kvfs_gather_rows")?])
            })
            .as_ref()
            .map(|k| k[rows as usize].0)
            .map_err(Clone::clone)
    }

    /// Enqueues on `stream`: (with `ready`) wait until the u32 at that
    /// device address is at least 1; gather `bytes` per descriptor of the
    /// `n` at device address `descs` ({src, dst} device addresses, src 0 =
    /// skip: a mapped pinned table, which each block reads its few from
    /// once); record `event`. The host fills the descriptors, then sets
    /// `ready` (or fills them before this call, with no `ready`).
    ///
    /// With `rows`, one side of every descriptor is rows (see `Rows`).
    ///
    /// # Safety
    /// `ready` and `descs` (pinned and device-mapped, 16 × n bytes at
    /// `descs`) stay alive until `event` completes; every descriptor
    /// written before `ready` is set (or this call, without one) names
    /// `bytes` readable and writable device-visible bytes (laid out as
    /// `rows` on its strided side), 16-byte aligned.
    #[expect(clippy::too_many_arguments, reason = "one enqueue, all its parts")]
    pub unsafe fn enqueue_gather(
        &self,
        stream: &Stream,
        ready: Option<u64>,
        descs: u64,
        n: u32,
        bytes: u64,
        rows: Option<Rows>,
        signal: Signal,
        event: &IpcEvent,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract, as enqueue_gather_part's.
        unsafe { self.enqueue_gather_part(stream, ready.map(|r| (r, 1)), descs, n, bytes, rows) }?;
        self.enqueue_end(stream, signal, event)
    }

    /// One part of a gather: the stream waits for the u32 at `ready.0` to
    /// reach `ready.1` (or not at all), then copies the `n` groups whose
    /// descriptors are at `descs`. Nothing is recorded: `enqueue_end`
    /// follows the last part.
    ///
    /// # Safety
    /// As `enqueue_gather`'s, for these `n` descriptors, kept alive until
    /// the event `enqueue_end` records completes.
    pub unsafe fn enqueue_gather_part(
        &self,
        stream: &Stream,
        ready: Option<(u64, u32)>,
        descs: u64,
        n: u32,
        bytes: u64,
        rows: Option<Rows>,
    ) -> Result<(), String> {
        self.bind()?;
        let f = self.gather(rows.is_some())?;
        if let Some((ready, value)) = ready {
            // SAFETY: ready is mapped pinned memory (caller's contract).
            let r = unsafe {
                sys::cuStreamWaitValue32_v2(
                    stream.0,
                    ready,
                    value,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
            };
            check(r, "cuStreamWaitValue32")?;
        }
        if n > 0 {
            let words = n as u64 * (bytes / 16);
            let blocks = words.div_ceil(GATHER_THREADS as u64 * GATHER_UNROLL);
            let blocks = u32::try_from(blocks)
                .map_err(|_| format!("{n} groups of {bytes} bytes: too many for one launch"))?;
            let (mut a, mut b, mut c) = (descs, n, bytes);
            let r = rows.unwrap_or(Rows {
                row: bytes,
                pitch: bytes,
                strided_dst: false,
            });
            let (mut d, mut e, mut g) = (r.row, r.pitch, r.strided_dst as u32);
            let mut params: [*mut std::ffi::c_void; 6] = [
                (&mut a as *mut u64).cast(),
                (&mut b as *mut u32).cast(),
                (&mut c as *mut u64).cast(),
                (&mut d as *mut u64).cast(),
                (&mut e as *mut u64).cast(),
                (&mut g as *mut u32).cast(),
            ];
            // SAFETY: kvfs_gather's parameters are (u64, u32, u64) as
            // passed (the rest unread), kvfs_gather_rows's all six; the
            // descriptors' validity is the caller's contract.
            let r = unsafe {
                sys::cuLaunchKernel(
                    f,
                    blocks,
                    1,
                    1,
                    GATHER_THREADS,
                    1,
                    1,
                    0,
                    stream.0,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check(r, "cuLaunchKernel(kvfs_gather)")?;
        }
        Ok(())
    }

    /// Ends a gather enqueued in parts: its done word (if any), then
    /// `event`, recorded after every part.
    pub fn enqueue_end(
        &self,
        stream: &Stream,
        signal: Signal,
        event: &IpcEvent,
    ) -> Result<(), String> {
        self.write_signal(stream, signal)?;
        // SAFETY: event and stream are live handles of this context.
        let r = unsafe { sys::cuEventRecord(event.ev, stream.0) };
        check(r, "cuEventRecord")
    }

    /// Enqueues on `stream` the write of a ticket's done word, if any:
    /// `value` into the 8 bytes at device address `addr`, after the work
    /// before it (with the driver's default memory barrier, so the copy's
    /// bytes are visible before the word).
    fn write_signal(&self, stream: &Stream, signal: Signal) -> Result<(), String> {
        if let Some((addr, value)) = signal {
            // SAFETY: a live stream of this context; addr is 8 device
            // bytes of a live region, 8-aligned (the caller's contract).
            let r = unsafe { sys::cuStreamWriteValue64_v2(stream.0, addr, value, 0) };
            check(r, "cuStreamWriteValue64")?;
        }
        Ok(())
    }

    /// Whether this device's streams may write and wait on 64-bit words
    /// (`cuStreamWriteValue64`, for done words).
    pub fn has_u64_stream_words(&self) -> bool {
        let Ok(dev) = result::device::get(self.device) else {
            return false;
        };
        let mut v = 0;
        // SAFETY: dev is a device of this driver; v receives the value.
        let r = unsafe {
            sys::cuDeviceGetAttribute(
                &mut v,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                dev,
            )
        };
        r == sys::CUresult::CUDA_SUCCESS && v != 0
    }

    /// Makes `stream` wait, from here on, for the work enqueued before
    /// `event`'s last record (on whatever stream recorded it).
    pub fn stream_wait_event(&self, stream: &Stream, event: &IpcEvent) -> Result<(), String> {
        self.bind()?;
        // SAFETY: live handles of this context.
        let r = unsafe { sys::cuStreamWaitEvent(stream.0, event.ev, 0) };
        check(r, "cuStreamWaitEvent")
    }

    /// Whether the driver has cuMemcpyBatchAsync (CUDA 13 signature):
    /// many copies in one call, run by the copy engines.
    pub fn has_batch_copy(&self) -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            let mut v = 0;
            // SAFETY: v receives the driver's version.
            let r = unsafe { sys::cuDriverGetVersion(&mut v) };
            r == sys::CUresult::CUDA_SUCCESS && v >= 13000
        })
    }

    /// Enqueues on `stream` the copies `srcs[i] -> dsts[i]` of `sizes[i]`
    /// bytes (host and device addresses both), on the copy engines (one
    /// cuMemcpyBatchAsync; see `has_batch_copy`), then records `event`.
    ///
    /// # Safety
    /// Every range is valid memory of this context (pinned host or device)
    /// until `event` completes.
    pub unsafe fn enqueue_copies(
        &self,
        stream: &Stream,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        signal: Signal,
        event: &IpcEvent,
    ) -> Result<(), String> {
        if dsts.len() != srcs.len() || dsts.len() != sizes.len() {
            return Err("enqueue_copies: lists of different lengths".into());
        }
        self.bind()?;
        if !dsts.is_empty() {
            // SAFETY: all-zero is a valid value of this plain C struct.
            let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            attr.flags = sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32;
            let mut idx = 0usize;
            // SAFETY: three lists of equal length (checked), one attribute
            // for all from index 0; the ranges are the caller's contract.
            let r = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    dsts.len(),
                    &mut attr,
                    &mut idx,
                    1,
                    stream.0,
                )
            };
            check(r, "cuMemcpyBatchAsync")?;
        }
        self.write_signal(stream, signal)?;
        // SAFETY: event and stream are live handles of this context.
        let r = unsafe { sys::cuEventRecord(event.ev, stream.0) };
        check(r, "cuEventRecord")
    }

    /// Blocks until everything recorded before `event` has run.
    pub fn wait_event(&self, event: &IpcEvent) -> Result<(), String> {
        self.bind()?;
        // SAFETY: a live event.
        let r = unsafe { sys::cuEventSynchronize(event.ev) };
        check(r, "cuEventSynchronize")
    }

    /// Copies device bytes to host memory (synchronous).
    ///
    /// # Safety
    /// `src..src+dst.len()` is readable device memory.
    pub unsafe fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), String> {
        self.bind()?;
        // SAFETY: the caller's contract; dst is a host slice of the length given.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) };
        check(r, "cuMemcpyDtoH")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    /// A driver call that may wait for the device runs only once every
    /// open window has closed, and no window opens while one waits: the
    /// order that keeps a restore's kernel launch from waiting behind a
    /// free that waits for that restore's flag.
    #[test]
    fn quiet_calls_wait_for_open_windows_and_hold_off_new_ones() {
        open_window();
        let ran = std::sync::Arc::new(AtomicBool::new(false));
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let (r, d) = (ran.clone(), done.clone());
        let (tx, rx) = mpsc::channel();
        let t = std::thread::spawn(move || {
            quietly(|| {
                r.store(true, Ordering::SeqCst);
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                d.store(true, Ordering::SeqCst);
            })
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        assert!(!ran.load(Ordering::SeqCst), "ran with a window open");
        close_window();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        // The quiet call is running: a new window waits for it to end.
        open_window();
        assert!(
            done.load(Ordering::SeqCst),
            "a window opened while a quiet call ran"
        );
        close_window();
        t.join().unwrap();
    }
}
