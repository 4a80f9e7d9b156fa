//! Threads that run tickets and wake timed-out WAITs.
//!
//! The executor runs each admitted RESTORE/STORE/PREFETCH batch as one job
//! on a small pool of threads; a job that panics still completes its
//! ticket (with EIO), so no waiter waits forever. The timer wakes sessions
//! whose WAIT deadlines pass; it holds sessions weakly, so a closed fd is
//! never kept alive by a pending deadline.

use super::session::Session;
use crate::cascade::CascadeError;
use parking_lot::{Condvar, Mutex};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// Executor threads: enough to overlap backing reads with copies on a
/// small machine; a batch is one job, so more threads than cores buys little.
pub(super) const MIN_EXECUTORS: usize = 2;

/// Threads opening GPU restores' gates (reading misses from the backing
/// meanwhile): a few, as each gate's wait is mostly backing I/O.
pub(super) const GATED_EXECUTORS: usize = 4;

pub(super) type Job = Box<dyn FnOnce() + Send>;

pub(super) struct Executor {
    queue: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

impl Executor {
    /// `threads` threads named `name-N`.
    pub(super) fn start(threads: usize, name: &str) -> Arc<Executor> {
        let e = Arc::new(Executor {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        });
        for i in 0..threads {
            let e = e.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    loop {
                        let job = {
                            let mut q = e.queue.lock();
                            loop {
                                if let Some(j) = q.pop_front() {
                                    break j;
                                }
                                e.ready.wait(&mut q);
                            }
                        };
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                            tracing::error!("an executor job panicked; its ticket fails with EIO");
                        }
                    }
                })
                .expect("cannot start executor thread");
        }
        e
    }

    fn submit(&self, job: Job) {
        self.queue.lock().push_back(job);
        self.ready.notify_one();
    }

    /// Runs `job` for `ticket`; if it panics, the ticket still completes
    /// (with EIO), so no waiter waits forever.
    pub(super) fn submit_ticket(&self, s: &Arc<Session>, ticket: u64, job: Job) {
        let s = s.clone();
        self.submit(Box::new(move || {
            let mut guard = Unfinished(Some((s, ticket)));
            job();
            // Finished: disarm the guard and let go of the session (a
            // forgotten guard would keep the session, and every region it
            // registered, alive for good).
            guard.0 = None;
        }));
    }
}

/// Wakes sessions whose WAIT deadlines pass.
pub(super) struct Timer {
    heap: Mutex<BinaryHeap<std::cmp::Reverse<(Instant, u64, usize)>>>,
    sessions: Mutex<HashMap<usize, Weak<Session>>>,
    ready: Condvar,
}

impl Timer {
    pub(super) fn start() -> Arc<Timer> {
        let t = Arc::new(Timer {
            heap: Mutex::new(BinaryHeap::new()),
            sessions: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
        });
        let t2 = t.clone();
        std::thread::Builder::new()
            .name("kvfs-timer".into())
            .spawn(move || {
                loop {
                    let due = {
                        let mut h = t2.heap.lock();
                        loop {
                            let now = Instant::now();
                            match h.peek() {
                                Some(std::cmp::Reverse((at, _, _))) if *at <= now => {
                                    break h.pop().expect("peeked").0;
                                }
                                Some(std::cmp::Reverse((at, _, _))) => {
                                    let at = *at;
                                    t2.ready.wait_until(&mut h, at);
                                }
                                None => t2.ready.wait(&mut h),
                            }
                        }
                    };
                    let s = t2.sessions.lock().get(&due.2).and_then(Weak::upgrade);
                    match s {
                        Some(s) => s.pump(),
                        None => {
                            t2.sessions.lock().remove(&due.2);
                        }
                    }
                }
            })
            .expect("cannot start timer thread");
        t
    }

    pub(super) fn at(&self, when: Instant, session: &Arc<Session>) {
        let key = Arc::as_ptr(session) as usize;
        self.sessions.lock().insert(key, Arc::downgrade(session));
        self.heap.lock().push(std::cmp::Reverse((when, 0, key)));
        self.ready.notify_one();
    }
}

/// Completes a ticket with an error if its job unwinds before finishing it.
struct Unfinished(Option<(Arc<Session>, u64)>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some((s, t)) = self.0.take() {
            s.finish(
                t,
                vec![Err(CascadeError::Internal(format!(
                    "ticket {t}'s job failed; see the daemon log"
                )))],
            );
        }
    }
}
