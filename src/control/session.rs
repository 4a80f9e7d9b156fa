//! Sessions: one per open fd of `.kvfs/control`, and the fd's byte streams.
//!
//! A session owns the regions registered on it (nobody else can name
//! them), its tickets, and the output the fd reads: replies to requests
//! written to it, in request order, then completion records of finished
//! tickets. Requests arrive by write(2) (possibly split over several
//! writes) or by ioctl(2); either way `handle` runs them. Waiting (a
//! blocking read, an ioctl WAIT, poll) never holds a thread: callers park a
//! callback, and `pump` runs whatever can be answered after every change.
//! Tickets are finished here, whichever room ran them.

use super::region::Region;
use super::ring::{Cqe, Ring};
use super::wire::{self, Command, NO_ENTRY, Reply, Request};
use super::{Control, Rejection, reject};
use crate::cascade::CascadeError;
use crate::gpu::engine::{Lane, PooledEvent};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

enum Ticket {
    Running,
    Done(Reply),
}

/// An item of the fd's output, in request order.
enum Out {
    Ready(Vec<u8>),
    /// A WAIT sent by write(2): resolved when the ticket ends or the deadline passes.
    Wait {
        ticket: u64,
        deadline: Option<Instant>,
    },
}

type Parked = Box<dyn FnOnce(Result<Vec<u8>, i32>) + Send>;
type WaitCallback = Box<dyn FnOnce(Reply) + Send>;

#[derive(Default)]
pub(super) struct SessionState {
    pub(super) regions: HashMap<u32, Arc<Region>>,
    next_region: u32,
    next_ticket: u64,
    tickets: HashMap<u64, Ticket>,
    /// Finished tickets not yet collected, oldest first.
    done: VecDeque<u64>,
    out: VecDeque<Out>,
    /// The partly read current output item.
    cursor: Option<(Vec<u8>, usize)>,
    /// The last read ended exactly at an item's end, with the buffer full.
    boundary: bool,
    /// Bytes of a request still arriving over several writes.
    partial: Vec<u8>,
    readers: VecDeque<(usize, Parked)>,
    waiters: Vec<(u64, Option<Instant>, WaitCallback)>,
    pollers: Vec<Box<dyn FnOnce() + Send>>,
    /// IPC events of GPU tickets, kept until the ticket is collected.
    pub(super) events: HashMap<u64, Arc<PooledEvent>>,
    /// This fd's submission/completion ring, if it set one up.
    ring: Option<Arc<Ring>>,
    /// Tickets submitted through the ring -> their user_data: collected
    /// by a completion entry when they end.
    ring_tickets: HashMap<u64, u64>,
    /// This fd's done words (REGISTER flags 3): region id and region.
    pub(super) done_words: Option<(u32, Arc<Region>)>,
    /// Done words in use -> the running ticket that will write them.
    pub(super) done_busy: HashMap<u16, u64>,
}

impl SessionState {
    /// Frees the done word `ticket` held, if any (it ended, or never began).
    pub(super) fn free_done_word(&mut self, ticket: u64) {
        if !self.done_busy.is_empty() {
            self.done_busy.retain(|_, t| *t != ticket);
        }
    }

    fn readable(&self) -> bool {
        self.cursor.is_some()
            || matches!(self.out.front(), Some(Out::Ready(_)))
            || (self.out.is_empty() && !self.done.is_empty())
    }

    /// Takes a finished ticket's completion (collecting it).
    fn collect(&mut self, ticket: u64) -> Option<Reply> {
        match self.tickets.get(&ticket) {
            Some(Ticket::Done(_)) => {}
            _ => return None,
        }
        self.done.retain(|&t| t != ticket);
        self.events.remove(&ticket);
        match self.tickets.remove(&ticket) {
            Some(Ticket::Done(r)) => Some(r),
            _ => None,
        }
    }

    fn wait_result(
        &mut self,
        ticket: u64,
        deadline: Option<Instant>,
        now: Instant,
    ) -> Option<Reply> {
        if let Some(mut r) = self.collect(ticket) {
            r.command = Command::Wait as u16;
            return Some(r);
        }
        if !self.tickets.contains_key(&ticket) {
            return Some(Reply::error(
                Command::Wait as u16,
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "ticket {ticket} is neither in flight nor waiting to be collected on this fd"
                ),
            ));
        }
        match deadline {
            Some(d) if d <= now => {
                let mut r = Reply::error(
                    Command::Wait as u16,
                    libc::ETIMEDOUT,
                    NO_ENTRY,
                    format!("ticket {ticket} still running at the timeout"),
                );
                r.value = ticket;
                Some(r)
            }
            _ => None,
        }
    }

    /// Next bytes for a read of at most `size`, if any are ready.
    fn next_bytes(&mut self, size: usize) -> Option<Vec<u8>> {
        if self.cursor.is_none() {
            let item = match self.out.front() {
                Some(Out::Ready(_)) => match self.out.pop_front() {
                    Some(Out::Ready(b)) => b,
                    _ => unreachable!("front was Ready"),
                },
                Some(Out::Wait { .. }) => return None,
                None => {
                    let t = *self.done.front()?;
                    let mut r = self.collect(t)?;
                    r.command = Command::Completion as u16;
                    r.encode()
                }
            };
            self.cursor = Some((item, 0));
        }
        let (item, at) = self.cursor.as_mut().expect("set above");
        let n = size.min(item.len() - *at);
        let chunk = item[*at..*at + n].to_vec();
        *at += n;
        if *at == item.len() {
            self.cursor = None;
            self.boundary = n == size;
        } else {
            self.boundary = false;
        }
        Some(chunk)
    }
}

/// One open control fd.
pub struct Session {
    pub(super) ctl: Arc<Control>,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) may_write: bool,
    pub(super) st: Mutex<SessionState>,
    /// This fd's ordered streams (one a device) for GPU restores of
    /// T1-resident batches: their copies run in submission order, so the
    /// oldest ticket finishes first and a client keeping a few tickets in
    /// flight always has queued work behind the one it waits for.
    pub(super) lanes: Mutex<Vec<(i32, Arc<Lane>)>>,
}

impl Session {
    /// Feeds bytes written to the fd; complete requests are handled and
    /// their replies queued. Returns how many bytes were taken (all).
    pub fn write(self: &Arc<Session>, data: &[u8]) -> usize {
        let mut st = self.st.lock();
        let mut input = data;
        loop {
            // The next complete request: straight from `input` when none is
            // being assembled (the usual case: no copy of a large batch),
            // else from `partial`, topped up from `input`.
            let assembled;
            let req: &[u8] = if st.partial.is_empty() {
                match wire::request_len(input) {
                    Ok((_, n)) if input.len() >= n => {
                        let (r, rest) = input.split_at(n);
                        input = rest;
                        r
                    }
                    Err(e) if input.len() >= wire::HEADER_BYTES => {
                        st.out.push_back(Out::Ready(Self::stream_error(input, e)));
                        break;
                    }
                    _ => {
                        st.partial.extend_from_slice(input);
                        break;
                    }
                }
            } else {
                // Enough of the header first, then exactly the rest of the request.
                let need_header = wire::HEADER_BYTES.saturating_sub(st.partial.len());
                let take = need_header.min(input.len());
                st.partial.extend_from_slice(&input[..take]);
                input = &input[take..];
                if st.partial.len() < wire::HEADER_BYTES {
                    break;
                }
                let want = match wire::request_len(&st.partial) {
                    Ok((_, n)) => n,
                    Err(e) => {
                        let r = Self::stream_error(&st.partial, e);
                        st.partial.clear();
                        st.out.push_back(Out::Ready(r));
                        break;
                    }
                };
                let take = (want - st.partial.len()).min(input.len());
                st.partial.extend_from_slice(&input[..take]);
                input = &input[take..];
                if st.partial.len() < want {
                    break;
                }
                assembled = std::mem::take(&mut st.partial);
                &assembled
            };
            drop(st);
            let out = match wire::decode(req) {
                Ok((_, Request::Wait { ticket, timeout_ms })) => {
                    self.ctl.stats.requests[Command::Wait as usize].fetch_add(1, Ordering::Relaxed);
                    let deadline = self.deadline(timeout_ms);
                    Out::Wait { ticket, deadline }
                }
                Ok((h, r)) => Out::Ready(self.handle(r, wire::done_word(&h)).encode()),
                Err(e) => Out::Ready(
                    Reply::error(
                        u16::from_le_bytes([req[6], req[7]]),
                        libc::EINVAL,
                        NO_ENTRY,
                        e.to_string(),
                    )
                    .encode(),
                ),
            };
            st = self.st.lock();
            st.out.push_back(out);
        }
        drop(st);
        self.pump();
        data.len()
    }

    /// The reply to a request header that cannot be parsed: the stream
    /// cannot be resynchronised, so the rest of this write is dropped.
    fn stream_error(header: &[u8], e: wire::DecodeError) -> Vec<u8> {
        let cmd = u16::from_le_bytes([header[6], header[7]]);
        Reply::error(cmd, libc::EINVAL, NO_ENTRY, e.to_string()).encode()
    }

    fn deadline(self: &Arc<Session>, timeout_ms: u64) -> Option<Instant> {
        (timeout_ms != u64::MAX).then(|| {
            let d = Instant::now() + Duration::from_millis(timeout_ms.min(1 << 40));
            self.ctl.timer.at(d, self);
            d
        })
    }

    /// A read of at most `size` bytes: answered now (`Ok`), or `cb` is
    /// parked and called when output arrives. `nonblock` answers EAGAIN
    /// instead of parking.
    pub fn read(&self, size: usize, nonblock: bool, cb: Parked) {
        let mut st = self.st.lock();
        if !st.partial.is_empty() && st.out.is_empty() && st.cursor.is_none() {
            let have = st.partial.len();
            st.partial.clear();
            let r = Reply::error(
                0,
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "truncated request: {have} bytes of a request were written, then a read came"
                ),
            );
            st.out.push_back(Out::Ready(r.encode()));
        }
        if let Some(b) = st.next_bytes(size) {
            drop(st);
            return cb(Ok(b));
        }
        if std::mem::take(&mut st.boundary) {
            // The last read ended exactly at an item's end with its buffer
            // full: this may be the kernel asking for the rest of that
            // read(2). End it here rather than block it.
            drop(st);
            return cb(Ok(Vec::new()));
        }
        if nonblock {
            drop(st);
            return cb(Err(libc::EAGAIN));
        }
        st.readers.push_back((size, cb));
    }

    /// Handles one ioctl(2) request: `cb` gets the reply (now, or when a
    /// WAIT ends).
    pub fn ioctl(self: &Arc<Session>, req: &[u8], cb: WaitCallback) {
        let request = wire::request_len(req).and_then(|(_, n)| {
            if n > req.len() {
                Err(wire::DecodeError::Length {
                    command: "ioctl request",
                    count: 0,
                    want: n,
                    got: req.len(),
                })
            } else {
                wire::decode(&req[..n])
            }
        });
        match request {
            Ok((_, Request::Wait { ticket, timeout_ms })) => {
                self.ctl.stats.requests[Command::Wait as usize].fetch_add(1, Ordering::Relaxed);
                let deadline = self.deadline(timeout_ms);
                let mut st = self.st.lock();
                match st.wait_result(ticket, deadline, Instant::now()) {
                    Some(r) => {
                        drop(st);
                        cb(r)
                    }
                    None => st.waiters.push((ticket, deadline, cb)),
                }
            }
            Ok((h, r)) => cb(self.handle(r, wire::done_word(&h))),
            Err(e) => {
                let cmd = if req.len() >= 8 {
                    u16::from_le_bytes([req[6], req[7]])
                } else {
                    0
                };
                cb(Reply::error(cmd, libc::EINVAL, NO_ENTRY, e.to_string()))
            }
        }
    }

    /// Whether a read would return now; if not, `notify` is called once it would.
    pub fn poll(&self, notify: Option<Box<dyn FnOnce() + Send>>) -> bool {
        let mut st = self.st.lock();
        if st.readable() {
            return true;
        }
        if let Some(n) = notify {
            st.pollers.push(n);
        }
        false
    }

    /// Runs whatever waiters can now be answered (after any state change).
    pub(super) fn pump(&self) {
        let now = Instant::now();
        let mut actions: Vec<Box<dyn FnOnce() + Send>> = Vec::new();
        let mut st = self.st.lock();
        // WAITs sent by write(2).
        for i in 0..st.out.len() {
            if let Out::Wait { ticket, deadline } = st.out[i]
                && let Some(r) = st.wait_result(ticket, deadline, now)
            {
                st.out[i] = Out::Ready(r.encode());
            }
        }
        // WAITs sent by ioctl(2).
        let waiters = std::mem::take(&mut st.waiters);
        for (ticket, deadline, cb) in waiters {
            match st.wait_result(ticket, deadline, now) {
                Some(r) => actions.push(Box::new(move || cb(r))),
                None => st.waiters.push((ticket, deadline, cb)),
            }
        }
        // Parked reads.
        while let Some((size, _)) = st.readers.front() {
            let size = *size;
            let Some(b) = st.next_bytes(size) else { break };
            st.boundary = false;
            let (_, cb) = st.readers.pop_front().expect("front exists");
            actions.push(Box::new(move || cb(Ok(b))));
        }
        if st.readable() {
            actions.append(&mut st.pollers);
        }
        drop(st);
        for a in actions {
            a();
        }
    }

    /// The fd is closing: parked callers get EBADF; in-flight tickets run
    /// to their end (they hold the session and their regions).
    pub fn close(&self) {
        let mut st = self.st.lock();
        if let Some(r) = st.ring.take() {
            r.stop();
        }
        let readers: Vec<_> = st.readers.drain(..).collect();
        let waiters: Vec<_> = st.waiters.drain(..).collect();
        st.pollers.clear();
        drop(st);
        for (_, cb) in readers {
            cb(Err(libc::EBADF));
        }
        for (t, _, cb) in waiters {
            cb(Reply::error(
                Command::Wait as u16,
                libc::EBADF,
                NO_ENTRY,
                format!("fd closed while waiting for ticket {t}"),
            ));
        }
    }

    fn count(&self, cmd: Command, ok: bool) {
        let a = if ok {
            &self.ctl.stats.requests
        } else {
            &self.ctl.stats.rejected
        };
        a[cmd as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Handles every request but WAIT; `done`: the done word a RESTORE
    /// names (see `wire::done_word`).
    fn handle(self: &Arc<Session>, r: Request, done: Option<u16>) -> Reply {
        let cmd = match &r {
            Request::Hello => Command::Hello,
            Request::Register { .. } => Command::Register,
            Request::Unregister { .. } => Command::Unregister,
            Request::Restore(_) | Request::RestoreStrided(_) | Request::RestoreFrom(_) => {
                Command::Restore
            }
            Request::Store(_) | Request::StoreStrided(_) | Request::StoreFrom(_) => Command::Store,
            Request::Query(_) => Command::Query,
            Request::Prefetch(_) => Command::Prefetch,
            Request::Ring { .. } => Command::Ring,
            Request::Wait { .. } => unreachable!("WAIT is handled by its transport"),
        };
        let out = match r {
            Request::Hello => Ok(self.hello()),
            Request::Register { path, len, flags } => self.register(&path, len, flags),
            Request::Unregister { region } => self.unregister(region),
            Request::Restore(e) | Request::RestoreStrided(e) => {
                self.submit_io(Command::Restore, &e, done)
            }
            Request::Store(e) | Request::StoreStrided(e) => {
                self.submit_io(Command::Store, &e, None)
            }
            Request::RestoreFrom(at) => self
                .entries_from(at)
                .and_then(|e| self.submit_io(Command::Restore, &e, done)),
            Request::StoreFrom(at) => self
                .entries_from(at)
                .and_then(|e| self.submit_io(Command::Store, &e, None)),
            Request::Query(k) => self.query(&k),
            Request::Prefetch(k) => self.prefetch(&k),
            Request::Ring {
                region,
                offset,
                entries,
            } => self.setup_ring(region, offset, entries),
            Request::Wait { .. } => unreachable!(),
        };
        self.count(cmd, out.is_ok());
        out.unwrap_or_else(|rj| Reply::error(cmd as u16, rj.errno, rj.entry, rj.message))
    }

    fn hello(&self) -> Reply {
        let mut r = Reply::ok(Command::Hello, wire::VERSION as u64);
        r.message = self.ctl.layout().to_json();
        r
    }

    fn register(&self, payload: &[u8], len: u64, flags: u64) -> Result<Reply, Rejection> {
        let region = match flags {
            0 => Region::map_host(payload, len, self.uid, self.gid)?,
            wire::REGISTER_CUDA => Region::open_cuda(payload, len)?,
            f if f == wire::REGISTER_CUDA | wire::REGISTER_DONE_WORDS => {
                return self.register_done_words(payload, len);
            }
            _ => {
                return Err(reject(
                    libc::EINVAL,
                    NO_ENTRY,
                    format!(
                        "unknown REGISTER flags {flags:#x} (0 = host file, 1 = CUDA allocation, 3 = CUDA done words)"
                    ),
                ));
            }
        };
        Ok(Reply::ok(
            Command::Register,
            self.add_region(Arc::new(region)) as u64,
        ))
    }

    /// Enters a region in this fd's table: its id.
    pub(super) fn add_region(&self, region: Arc<Region>) -> u32 {
        let mut st = self.st.lock();
        st.next_region += 1;
        let id = st.next_region;
        st.regions.insert(id, region);
        id
    }

    /// RING: this fd's submission/completion ring in one of its host
    /// regions, served by a thread of its own (see `ring`).
    fn setup_ring(
        self: &Arc<Session>,
        region: u32,
        offset: u64,
        entries: u32,
    ) -> Result<Reply, Rejection> {
        let mut st = self.st.lock();
        if st.ring.is_some() {
            return Err(reject(
                libc::EBUSY,
                NO_ENTRY,
                "this fd has a ring already (one a fd: open another fd for another)",
            ));
        }
        let r = st.regions.get(&region).cloned().ok_or_else(|| {
            reject(
                libc::EBADF,
                NO_ENTRY,
                format!("region {region} is not registered on this fd"),
            )
        })?;
        let ring = Arc::new(Ring::new(r, offset, entries)?);
        st.ring = Some(ring.clone());
        drop(st);
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("kvfs-ring".into())
            .spawn(move || ring.run(weak))
            .map_err(|e| {
                reject(
                    libc::EAGAIN,
                    NO_ENTRY,
                    format!("cannot start the ring thread: {e}"),
                )
            })?;
        Ok(Reply::ok(Command::Ring, entries as u64))
    }

    /// A submission taken from the ring: handled as a request; its
    /// completion entry is posted when the ticket ends (now, if it is
    /// refused or already over).
    pub(super) fn ring_submit(
        self: &Arc<Session>,
        ring: &Ring,
        user_data: u64,
        req: Request,
        done: Option<u16>,
    ) {
        let reply = self.handle(req, done);
        if reply.status != 0 {
            return ring.post(Cqe {
                user_data,
                ticket: 0,
                status: reply.status,
                entry: reply.entry,
                failed: 0,
            });
        }
        let ticket = reply.value;
        let mut st = self.st.lock();
        match st.collect(ticket) {
            Some(r) => {
                drop(st);
                ring.post(Cqe::of(user_data, ticket, &r));
            }
            None => {
                st.ring_tickets.insert(ticket, user_data);
            }
        }
    }

    fn unregister(&self, region: u32) -> Result<Reply, Rejection> {
        let mut st = self.st.lock();
        if st.done_words.as_ref().is_some_and(|(id, _)| *id == region) {
            // Running tickets hold the region until their words are written.
            st.done_words = None;
        }
        match st.regions.remove(&region) {
            Some(_) => Ok(Reply::ok(Command::Unregister, region as u64)),
            None => Err(reject(
                libc::EBADF,
                NO_ENTRY,
                format!("region {region} is not registered on this fd"),
            )),
        }
    }

    /// Takes back a ticket taken for a request that was then refused: it
    /// (and any done word claimed for it) was never handed out.
    pub(super) fn forget_ticket(&self, ticket: u64) {
        let mut st = self.st.lock();
        st.tickets.remove(&ticket);
        st.events.remove(&ticket);
        st.free_done_word(ticket);
    }

    /// Whether `ticket` is the only ticket this fd holds (none other
    /// running, none ended and not yet collected).
    pub(super) fn holds_only(&self, ticket: u64) -> bool {
        let st = self.st.lock();
        st.tickets.len() == 1 && st.tickets.contains_key(&ticket)
    }

    pub(super) fn new_ticket(&self) -> u64 {
        let mut st = self.st.lock();
        st.next_ticket += 1;
        let t = st.next_ticket;
        st.tickets.insert(t, Ticket::Running);
        t
    }

    /// Counts a finished RESTORE or STORE job's bytes and latency, then
    /// finishes its ticket.
    pub(super) fn complete(
        self: &Arc<Session>,
        cmd: Command,
        ticket: u64,
        started: Instant,
        results: Vec<Result<(), CascadeError>>,
    ) {
        let gb = self.ctl.cascade.layout().group_bytes();
        let bytes = results.iter().filter(|r| r.is_ok()).count() as u64 * gb;
        let st = &self.ctl.stats;
        let (counter, latency) = match cmd {
            Command::Restore => (&st.restored_bytes, &st.restore_latency),
            _ => (&st.stored_bytes, &st.store_latency),
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
        latency.observe(started.elapsed());
        self.finish(ticket, results);
    }

    pub(super) fn finish(self: &Arc<Session>, ticket: u64, results: Vec<Result<(), CascadeError>>) {
        let failed = results.iter().filter(|r| r.is_err()).count() as u32;
        let first = results.iter().position(|r| r.is_err());
        let mut r = Reply::ok(Command::Completion, ticket);
        if let Some(i) = first {
            let e = results[i].as_ref().expect_err("position found an error");
            r.status = e.errno() as u32;
            r.failed = failed;
            r.entry = i as u32;
            r.message = format!("entry {i}: {e}");
            self.ctl
                .stats
                .failed_entries
                .fetch_add(failed as u64, Ordering::Relaxed);
        }
        {
            let mut st = self.st.lock();
            st.free_done_word(ticket);
            if let Some(user_data) = st.ring_tickets.remove(&ticket) {
                // A ring ticket: collected by its completion entry.
                st.tickets.remove(&ticket);
                st.events.remove(&ticket);
                let ring = st.ring.clone();
                drop(st);
                if let Some(ring) = ring {
                    ring.post(Cqe::of(user_data, ticket, &r));
                }
                return;
            }
            st.tickets.insert(ticket, Ticket::Done(r));
            st.done.push_back(ticket);
        }
        self.pump();
    }
}
