//! The GPU layer. Tests marked `requires GPU` run on the GPU machine
//! (`cargo test --release --test gpu -- --ignored`); the rest run anywhere.

use kvfs::cascade::{Cascade, CascadeConfig, MetaTable, SlotId};
use kvfs::geometry::{GroupIndex, GroupLayout};
use kvfs::gpu::HostBuf;
use kvfs::gpu::cuda::cuda;
use kvfs::tier::MemTier;
use std::time::{Duration, Instant};

#[test]
fn without_a_driver_memory_is_plain_and_says_so() {
    if cuda().is_some() {
        eprintln!("skipped: a CUDA driver is present (the GPU tests cover this machine)");
        return;
    }
    let b = HostBuf::alloc(1 << 20).unwrap();
    assert_eq!(b.device_ptr(), None);
    assert_eq!(b.as_ptr() as usize % 4096, 0);
    assert!(b.as_slice().iter().all(|&x| x == 0));
}

#[test]
#[ignore = "requires GPU"]
fn the_driver_is_found_and_host_buffers_are_pinned_and_mapped() {
    let c = cuda().expect("a CUDA driver and device");
    eprintln!("CUDA device {}: {}", c.device, c.name);
    let mut b = HostBuf::alloc(4 << 20).unwrap();
    let d = b
        .device_ptr()
        .expect("pinned buffers have a device address");
    for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
        *x = (i * 7 + 3) as u8;
    }
    // The device reads the host bytes through the mapping: copy them from
    // the device address back into a second buffer.
    let mut back = HostBuf::alloc(4 << 20).unwrap();
    c.bind().unwrap();
    // SAFETY: d maps b's 4 MiB; back is 4 MiB of host memory.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(back.as_mut_slice(), d) }.unwrap();
    assert_eq!(back.as_slice(), b.as_slice());
}

#[test]
#[ignore = "requires GPU"]
fn a_large_t1_is_pinned_in_chunks_in_the_background() {
    cuda().expect("a CUDA driver and device");
    let layout = GroupLayout::preset("llama-3.1-8b", 4096, 16).unwrap();
    let t1: u64 = 16 << 30;
    let t = Instant::now();
    let c = Cascade::new(
        layout,
        Box::new(MemTier::new(layout)),
        MetaTable::anonymous(layout.group_count()).unwrap(),
        CascadeConfig {
            t1_bytes: t1,
            ..CascadeConfig::default()
        },
    )
    .unwrap();
    let usable = t.elapsed();
    let first_ready = c.t1_ready_slots();
    // Usable at once: a write lands in T1 while the rest is still pinning.
    c.write(GroupIndex(0), 0, &[7u8; 4096]).unwrap();
    while c.t1_ready_slots() < c.t1_slots() as u64 {
        assert!(t.elapsed() < Duration::from_secs(600));
        std::thread::sleep(Duration::from_millis(5));
    }
    let all = t.elapsed();
    eprintln!(
        "T1 16 GiB pinned: cascade usable after {usable:.2?} with {first_ready} slots; all {} slots pinned after {all:.2?}",
        c.t1_slots()
    );
    assert!(first_ready < c.t1_slots() as u64);
    assert!(c.slot_device_ptr(SlotId(0)).is_some());
    assert!(c.slot_device_ptr(SlotId(c.t1_slots() - 1)).is_some());
}

/// Every device the driver reports has a context of its own (device 0's
/// is `cuda()`), allocates device memory and events there, and reaches
/// pinned memory at its host address; a device it does not report is a
/// clear error naming how many it does.
#[test]
#[ignore = "requires GPU"]
fn every_device_has_a_context_and_others_are_clear_errors() {
    use kvfs::gpu::cuda::cuda_on;
    let c0 = cuda().expect("a CUDA driver");
    assert!(std::ptr::eq(cuda_on(0).unwrap(), c0));
    let b = HostBuf::alloc(1 << 20).unwrap();
    assert_eq!(
        b.device_ptr(),
        Some(b.as_ptr() as u64),
        "unified addressing"
    );
    for d in 0..c0.count {
        let c = cuda_on(d).unwrap_or_else(|e| panic!("device {d}: {e}"));
        assert_eq!(c.device, d);
        let m = c.alloc_device(1 << 20).unwrap();
        assert_eq!(m.len(), 1 << 20);
        let e = c.new_ipc_event().unwrap();
        c.wait_event(&e).unwrap();
        eprintln!("CUDA device {d} ({}): context, memory and events", c.name);
    }
    for bad in [c0.count, -1, 1000] {
        let e = cuda_on(bad).err().expect("no such device");
        assert!(e.contains(&format!("reports {}", c0.count)), "{e}");
    }
}
