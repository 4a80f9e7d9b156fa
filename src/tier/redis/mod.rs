//! The `redis` tier: groups in a Redis/Valkey server or a Redis Cluster,
//! i.e. in other machines' RAM, over an existing distributed engine.
//!
//! One key per group copy, a framed value (`format`): header checks make a
//! lost, foreign or damaged value an EIO, never data. A batch is split by
//! owning master (`slot`: kvfs routes the cluster itself, so each master
//! gets one pipeline of at most `qd` commands per round trip) and the
//! masters are served in parallel. `MOVED` patches the slot map, refreshes
//! it from `CLUSTER SLOTS` and retries; `ASK` retries once on the named
//! node behind `ASKING`; both a bounded number of times. Connections carry
//! timeouts (`node`), so an unreachable server is an EIO within about the
//! timeout. `sync` is `WAIT` for the replicas, issued after a small write
//! on each master so it covers every earlier write there. Connect refuses
//! an evicting server unless allowed and warns about one that persists
//! nothing (`setup`). The tier keeps no per-group state: which copy was
//! written, and its checksum, are the cascade's.

mod format;
mod node;
mod setup;
mod slot;
#[doc(hidden)]
pub mod testing;

use self::format::Framed;
use self::node::{Node, round_trip};
use self::slot::{SlotMap, key_slot};
use super::{Op, ReadOp, Tier, TierError, WriteOp, check_op};
use crate::geometry::{GroupIndex, GroupLayout};
use crate::stats::{self, Exposition, Histogram};
use parking_lot::RwLock;
use redis::{Client, ClientTlsConfig, ConnectionInfo, IntoConnectionInfo, TlsCertificates, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Commands per pipeline round trip: 64 groups of a few hundred KiB keep a
/// server's output buffer within its default client limits while hiding
/// the round-trip latency.
pub const DEFAULT_REMOTE_QD: usize = 64;

/// How long one connect or round trip may take before the op is EIO: long
/// enough for a loaded server, short enough that a dead one does not stall
/// the cascade's flushers.
pub const DEFAULT_REMOTE_TIMEOUT: Duration = Duration::from_secs(2);

/// Redirections (`MOVED`/`ASK`) one op follows before it is EIO: a slot
/// migration needs at most two; more means the cluster is flapping.
const MAX_REDIRECTS: usize = 5;

/// How the tier reaches its servers.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// `redis://host:port`, `rediss://host:port`, `unix:///path`: one
    /// standalone server, or seed nodes of a cluster.
    pub urls: Vec<String>,
    /// Commands per pipeline round trip, per connection.
    pub qd: usize,
    /// Connect, read and write timeout of every connection.
    pub timeout: Duration,
    /// Replicas `sync` waits for; `None`: as many as each master has.
    pub replicas: Option<u32>,
    /// Accept a server whose `maxmemory-policy` evicts keys.
    pub allow_evict: bool,
    /// TLS (`rediss://` URLs only): a PEM file of the CA certificates the
    /// servers' certificates are checked against, instead of the web PKI
    /// roots (a private CA).
    pub ca: Option<PathBuf>,
    /// TLS client certificate and its key (PEM files), for servers that
    /// authenticate clients (`tls-auth-clients yes`).
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl RemoteConfig {
    pub fn new(urls: Vec<String>) -> RemoteConfig {
        RemoteConfig {
            urls,
            qd: DEFAULT_REMOTE_QD,
            timeout: DEFAULT_REMOTE_TIMEOUT,
            replicas: None,
            allow_evict: false,
            ca: None,
            client_cert: None,
        }
    }

    /// The CA and client certificate files, read and parsed; None where
    /// neither is given. Refused with a reason: a file that cannot be read
    /// or holds no PEM certificate (or key), or a URL that is not
    /// `rediss://` or skips the server's check (`#insecure`) beside a CA.
    fn tls_certificates(&self) -> Result<Option<TlsCertificates>, String> {
        if self.ca.is_none() && self.client_cert.is_none() {
            return Ok(None);
        }
        if let Some(u) = self.urls.iter().find(|u| !u.starts_with("rediss://")) {
            return Err(format!(
                "a TLS CA or client certificate is for rediss:// URLs; {} is not one",
                redact(u)
            ));
        }
        if self.ca.is_some()
            && let Some(u) = self.urls.iter().find(|u| u.ends_with("#insecure"))
        {
            return Err(format!(
                "{} skips the server's certificate check (#insecure), which a TLS CA is given to make: give one or the other",
                redact(u)
            ));
        }
        let pem = |path: &Path, what: &str, marker: &str| -> Result<Vec<u8>, String> {
            let bytes = std::fs::read(path)
                .map_err(|e| format!("cannot read the TLS {what} {}: {e}", path.display()))?;
            if !String::from_utf8_lossy(&bytes).contains(marker) {
                return Err(format!(
                    "the TLS {what} {} holds no PEM {marker} block",
                    path.display()
                ));
            }
            Ok(bytes)
        };
        let root_cert = match &self.ca {
            Some(p) => Some(pem(p, "CA file", "CERTIFICATE")?),
            None => None,
        };
        let client_tls = match &self.client_cert {
            Some((cert, key)) => Some(ClientTlsConfig {
                client_cert: pem(cert, "client certificate", "CERTIFICATE")?,
                client_key: pem(key, "client key", "PRIVATE KEY")?,
            }),
            None => None,
        };
        Ok(Some(TlsCertificates {
            client_tls,
            root_cert,
        }))
    }
}

#[derive(Default)]
struct RemoteStats {
    errors: AtomicU64,
    timeouts: AtomicU64,
    lost: AtomicU64,
    corrupt: AtomicU64,
    oom: AtomicU64,
    round_trip: Histogram,
}

/// The nodes the tier knows (append-only, so a node number stays valid)
/// and which master owns each slot.
struct Topology {
    nodes: Vec<Arc<Node>>,
    slots: SlotMap,
    masters: Vec<usize>,
    /// Credentials and TLS settings for masters learnt from the cluster.
    seed: ConnectionInfo,
    timeout: Duration,
}

impl Topology {
    fn node_index(&mut self, host: &str, port: u16) -> Result<usize, String> {
        let addr = format!("{host}:{port}");
        if let Some(i) = self.nodes.iter().position(|n| n.addr == addr) {
            return Ok(i);
        }
        let node = Node::new(Node::sibling(&self.seed, host, port), self.timeout)?;
        self.nodes.push(Arc::new(node));
        Ok(self.nodes.len() - 1)
    }

    fn apply_ranges(&mut self, ranges: &[setup::SlotRange]) -> Result<(), String> {
        let mut map = SlotMap::empty();
        for r in ranges {
            let n = self.node_index(&r.host, r.port)?;
            map.assign(r.start, r.end, n as u16);
        }
        self.slots = map;
        self.recompute_masters();
        Ok(())
    }

    fn recompute_masters(&mut self) {
        let mut seen = vec![false; self.nodes.len()];
        for s in 0..slot::SLOTS as u16 {
            if let Some(n) = self.slots.owner(s) {
                seen[n] = true;
            }
        }
        self.masters = (0..self.nodes.len()).filter(|&n| seen[n]).collect();
    }
}

/// Groups in a Redis server or cluster.
pub struct RedisTier {
    layout: GroupLayout,
    /// The store's uuid in hex: every key's namespace.
    ns: String,
    qd: usize,
    timeout: Duration,
    replicas: Option<u32>,
    cluster: bool,
    topo: RwLock<Topology>,
    warnings: Vec<String>,
    describe: String,
    stats: RemoteStats,
    sync_seq: AtomicU64,
}

/// A URL with its password (if any) hidden, for messages and logs.
fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((_, host)) => format!("{scheme}://…@{host}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// One command of a batch on its way to a node.
struct Job<'a> {
    /// Position of the op in the caller's batch.
    op: usize,
    index: GroupIndex,
    key: String,
    slot: u16,
    /// `Some` for a SET, `None` for a GET.
    value: Option<Framed<'a>>,
    /// A node an `ASK` named: the next round goes there, behind `ASKING`.
    ask: Option<usize>,
    asking: bool,
}

/// What came back for one job: the server's reply, or why none did.
enum Reply {
    Value(Value),
    Failed(String),
}

impl RedisTier {
    /// Connects to the servers `cfg` names, learns the cluster's masters if
    /// it is one, and checks each master's eviction policy and persistence.
    pub fn connect(
        layout: GroupLayout,
        uuid: [u8; 16],
        cfg: &RemoteConfig,
    ) -> Result<RedisTier, String> {
        if cfg.urls.is_empty() {
            return Err("no redis URL given".into());
        }
        if cfg.urls.iter().any(|u| u.starts_with("rediss://")) {
            // rustls needs a process-wide crypto provider; an Err means one
            // is installed already, which serves as well.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let certs = cfg.tls_certificates()?;
        let mut seeds = Vec::with_capacity(cfg.urls.len());
        for url in &cfg.urls {
            let mut info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| format!("bad redis URL {}: {e}", redact(url)))?;
            if let Some(certs) = &certs {
                // The parsed certificates ride in the address, so every
                // node learnt from this seed (`Node::sibling`) has them.
                info = Client::build_with_tls(info, certs.clone())
                    .map_err(|e| format!("TLS setup for {}: {e}", redact(url)))?
                    .get_connection_info()
                    .clone();
            }
            seeds.push((redact(url), info));
        }
        let mut failures = Vec::new();
        let mut found = None;
        for (url, info) in &seeds {
            let node = Node::new(info.clone(), cfg.timeout)?;
            let probe = node.connect().and_then(|mut c| {
                let i = setup::info(&mut c, "cluster")?;
                Ok((c, i))
            });
            match probe {
                Ok((c, i)) => {
                    found = Some((url.clone(), info.clone(), node, c, i));
                    break;
                }
                Err(e) => {
                    // rustls says UnknownIssuer for a private CA's certificate.
                    let hint = match e.to_string().contains("UnknownIssuer") && cfg.ca.is_none() {
                        true => {
                            " (the server's certificate is not signed by a CA of the web PKI: give its CA's PEM file, --remote-ca)"
                        }
                        false => "",
                    };
                    failures.push(format!("{url}: {e}{hint}"))
                }
            }
        }
        let Some((url, info, seed_node, mut con, cluster_info)) = found else {
            return Err(format!("cannot reach redis at {}", failures.join("; ")));
        };
        let cluster = setup::info_field(&cluster_info, "cluster_enabled") == Some("1");
        let mut warnings = Vec::new();
        let mut topo = Topology {
            nodes: Vec::new(),
            slots: SlotMap::single(),
            masters: vec![0],
            seed: info.clone(),
            timeout: cfg.timeout,
        };
        let describe = if cluster {
            let v: Value = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query(&mut con)
                .map_err(|e| format!("CLUSTER SLOTS at {url} failed: {e}"))?;
            let host = match info.addr() {
                redis::ConnectionAddr::Tcp(h, _) => h.clone(),
                redis::ConnectionAddr::TcpTls { host, .. } => host.clone(),
                _ => "127.0.0.1".to_string(),
            };
            let ranges = setup::parse_cluster_slots(&v, &host)?;
            topo.apply_ranges(&ranges)?;
            let hole = topo.slots.unowned();
            if hole > 0 {
                return Err(format!(
                    "the cluster at {url} serves only {} of {} slots (is cluster_state ok?)",
                    slot::SLOTS - hole,
                    slot::SLOTS
                ));
            }
            for &m in &topo.masters {
                let n = &topo.nodes[m];
                let mut c = n.connect().map_err(|e| {
                    format!(
                        "cannot reach cluster master {} (learnt from {url}): {e}",
                        n.addr
                    )
                })?;
                setup::check_master(&mut c, &n.addr, cfg.allow_evict, &mut warnings)?;
                n.give(c);
            }
            format!("cluster of {} masters via {url}", topo.masters.len())
        } else {
            if seeds.len() > 1 {
                return Err(format!(
                    "{url} is a standalone server (cluster_enabled:0) but {} URLs were given: \
                     pass one URL of a standalone server, or seed nodes of a Redis Cluster",
                    seeds.len()
                ));
            }
            setup::check_master(&mut con, &url, cfg.allow_evict, &mut warnings)?;
            seed_node.give(con);
            topo.nodes.push(Arc::new(seed_node));
            format!("standalone {url}")
        };
        Ok(RedisTier {
            layout,
            ns: format::namespace(uuid),
            qd: cfg.qd.max(1),
            timeout: cfg.timeout,
            replicas: cfg.replicas,
            cluster,
            topo: RwLock::new(topo),
            warnings,
            describe,
            stats: RemoteStats::default(),
            sync_seq: AtomicU64::new(0),
        })
    }

    /// What connect found worth telling the operator (no persistence, an
    /// evicting policy that was allowed, CONFIG refused).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// "standalone redis://…" or "cluster of N masters via redis://…".
    pub fn describe(&self) -> String {
        self.describe.clone()
    }

    /// Counts a failed op and builds its error.
    fn fail(&self, op: Op, index: GroupIndex, errno: i32, message: String) -> TierError {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        TierError::Remote {
            op,
            index,
            errno,
            message,
        }
    }

    fn note_failure(&self, node: &Node, e: &redis::RedisError) -> String {
        if e.is_timeout() {
            self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        node.set_up(false);
        format!("redis at {}: {e}", node.addr)
    }

    /// Serves one node's jobs on one connection, `qd` commands per round
    /// trip. A connection failure fails the rest of this node's jobs: the
    /// next batch tries again, so a dead node costs one timeout per batch.
    fn run_node<'a>(&self, node: &Node, jobs: Vec<Job<'a>>) -> Vec<(Job<'a>, Reply)> {
        let mut out = Vec::with_capacity(jobs.len());
        let (mut con, mut fresh) = match node.take() {
            Ok(c) => c,
            Err(e) => {
                let m = self.note_failure(node, &e);
                return jobs
                    .into_iter()
                    .map(|j| (j, Reply::Failed(m.clone())))
                    .collect();
            }
        };
        let mut jobs = jobs.into_iter();
        loop {
            let chunk: Vec<Job<'a>> = jobs.by_ref().take(self.qd).collect();
            if chunk.is_empty() {
                break;
            }
            let mut pipe = redis::pipe();
            let mut count = 0;
            for j in &chunk {
                if j.asking {
                    pipe.cmd("ASKING");
                    count += 1;
                }
                match j.value {
                    Some(v) => pipe.cmd("SET").arg(&j.key).arg(v),
                    None => pipe.cmd("GET").arg(&j.key),
                };
                count += 1;
            }
            let packed = pipe.get_packed_pipeline();
            let mut replies = Vec::with_capacity(count);
            let start = Instant::now();
            let mut r = round_trip(&mut con, &packed, count, &mut replies);
            if let Err(e) = &r
                && !fresh
                && replies.is_empty()
                && !e.is_timeout()
            {
                // A pooled connection the server closed (restart, idle
                // timeout) fails before any reply: its siblings are as
                // stale, so drop them and try once on a new connection.
                // SET and GET are idempotent, so resending is safe.
                node.drop_pool();
                r = node.connect().and_then(|c| {
                    con = c;
                    fresh = true;
                    round_trip(&mut con, &packed, count, &mut replies)
                });
            }
            self.stats.round_trip.observe(start.elapsed());
            let failed = r.err().map(|e| self.note_failure(node, &e));
            let mut replies = replies.into_iter();
            for j in chunk {
                if j.asking {
                    replies.next();
                }
                let reply = match replies.next() {
                    Some(v) => Reply::Value(v),
                    None => Reply::Failed(
                        failed
                            .clone()
                            .unwrap_or_else(|| format!("redis at {}: reply missing", node.addr)),
                    ),
                };
                out.push((j, reply));
            }
            if let Some(m) = failed {
                out.extend(jobs.map(|j| (j, Reply::Failed(m.clone()))));
                return out;
            }
        }
        node.set_up(true);
        node.give(con);
        out
    }

    /// Routes jobs to their masters, serves the masters in parallel and
    /// follows redirections. Returns each op's reply by position (`None`
    /// for positions without a job).
    fn run(&self, op: Op, jobs: Vec<Job<'_>>, n: usize) -> Vec<Option<Result<Value, TierError>>> {
        let mut out: Vec<Option<Result<Value, TierError>>> = (0..n).map(|_| None).collect();
        let mut pending = jobs;
        for round in 0..=MAX_REDIRECTS {
            if pending.is_empty() {
                break;
            }
            let mut by_node: BTreeMap<usize, Vec<Job<'_>>> = BTreeMap::new();
            let mut nodes = Vec::new();
            {
                let topo = self.topo.read();
                nodes.extend(topo.nodes.iter().cloned());
                for mut j in pending.drain(..) {
                    let ask = j.ask.take();
                    j.asking = ask.is_some();
                    match ask.or_else(|| topo.slots.owner(j.slot)) {
                        Some(node) => by_node.entry(node).or_default().push(j),
                        None => {
                            let m = format!("cluster slot {} has no master", j.slot);
                            out[j.op] = Some(Err(self.fail(op, j.index, libc::EIO, m)));
                        }
                    }
                }
            }
            let mut groups: Vec<(usize, Vec<Job<'_>>)> = by_node.into_iter().collect();
            let mut results: Vec<(usize, Vec<(Job<'_>, Reply)>)> = Vec::new();
            if let Some((first, first_jobs)) = groups.pop() {
                std::thread::scope(|s| {
                    let handles: Vec<_> = groups
                        .into_iter()
                        .map(|(n, jobs)| {
                            let node = &nodes[n];
                            (n, s.spawn(move || self.run_node(node, jobs)))
                        })
                        .collect();
                    results.push((first, self.run_node(&nodes[first], first_jobs)));
                    for (n, h) in handles {
                        let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                        results.push((n, r));
                    }
                });
            }
            let mut moved = false;
            for (n, replies) in results {
                for (mut j, reply) in replies {
                    match reply {
                        Reply::Value(Value::ServerError(e))
                            if e.code() == "MOVED" || e.code() == "ASK" =>
                        {
                            let is_ask = e.code() == "ASK";
                            let target = e
                                .details()
                                .and_then(|d| d.split_once(' '))
                                .and_then(|(_, addr)| addr.rsplit_once(':'))
                                .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)));
                            let to = target.and_then(|(h, p)| {
                                let mut topo = self.topo.write();
                                let h = if h.is_empty() {
                                    nodes[n].addr.rsplit_once(':')?.0.to_string()
                                } else {
                                    h
                                };
                                let i = topo.node_index(&h, p).ok()?;
                                if !is_ask {
                                    topo.slots.assign(j.slot, j.slot, i as u16);
                                    topo.recompute_masters();
                                }
                                Some(i)
                            });
                            match to {
                                Some(_) if round == MAX_REDIRECTS => {
                                    let m = format!(
                                        "still redirected after {MAX_REDIRECTS} tries ({e})"
                                    );
                                    out[j.op] = Some(Err(self.fail(op, j.index, libc::EIO, m)));
                                }
                                Some(i) => {
                                    moved |= !is_ask;
                                    j.ask = is_ask.then_some(i);
                                    pending.push(j);
                                }
                                None => {
                                    let m =
                                        format!("unusable redirection from {}: {e}", nodes[n].addr);
                                    out[j.op] = Some(Err(self.fail(op, j.index, libc::EIO, m)));
                                }
                            }
                        }
                        Reply::Value(v) => out[j.op] = Some(Ok(v)),
                        Reply::Failed(m) => {
                            out[j.op] = Some(Err(self.fail(op, j.index, libc::EIO, m)));
                        }
                    }
                }
            }
            if moved {
                self.refresh_slots();
            }
        }
        out
    }

    /// Reloads the slot map from the first master that answers `CLUSTER
    /// SLOTS`; on failure the patched map stays.
    fn refresh_slots(&self) {
        if !self.cluster {
            return;
        }
        let nodes: Vec<Arc<Node>> = {
            let t = self.topo.read();
            t.masters.iter().map(|&m| t.nodes[m].clone()).collect()
        };
        for node in nodes {
            let Ok((mut con, _)) = node.take() else {
                continue;
            };
            let Ok(v) = redis::cmd("CLUSTER").arg("SLOTS").query::<Value>(&mut con) else {
                continue;
            };
            node.give(con);
            let host = node
                .addr
                .rsplit_once(':')
                .map(|(h, _)| h.to_string())
                .unwrap_or_default();
            let Ok(ranges) = setup::parse_cluster_slots(&v, &host) else {
                continue;
            };
            let mut topo = self.topo.write();
            let before = topo.slots.clone();
            if topo.apply_ranges(&ranges).is_ok() && topo.slots.unowned() == 0 {
                return;
            }
            topo.slots = before;
            topo.recompute_masters();
        }
    }

    /// The jobs for a batch's valid ops; invalid ops get their error in `res`.
    fn job<'a>(
        &self,
        op: Op,
        pos: usize,
        index: GroupIndex,
        value: Option<Framed<'a>>,
    ) -> Result<Job<'a>, TierError> {
        let key = format::group_key(&self.ns, &self.layout, index)
            .map_err(|m| self.fail(op, index, libc::EIO, m))?;
        Ok(Job {
            op: pos,
            index,
            slot: key_slot(key.as_bytes()),
            key,
            value,
            ask: None,
            asking: false,
        })
    }

    /// `WAIT` on one master, after a write that makes it cover every
    /// earlier write there (WAIT counts the replication offset of its own
    /// connection's last write, and a master replicates in order).
    fn sync_node(&self, node: &Node, key: &str) -> Result<(), String> {
        let (mut con, _) = node.take().map_err(|e| self.note_failure(node, &e))?;
        let wanted = match self.replicas {
            Some(r) => r as u64,
            None => {
                let i = setup::info(&mut con, "replication")
                    .map_err(|e| self.note_failure(node, &e))?;
                setup::info_field(&i, "connected_slaves")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            }
        };
        if wanted == 0 {
            node.give(con);
            return Ok(());
        }
        let seq = self.sync_seq.fetch_add(1, Ordering::Relaxed);
        let wait_ms = self.timeout.as_millis().max(1) as u64;
        let r = (|| -> Result<i64, redis::RedisError> {
            con.set_read_timeout(Some(self.timeout * 2))?;
            redis::cmd("SET").arg(key).arg(seq).exec(&mut con)?;
            let acked: i64 = redis::cmd("WAIT")
                .arg(wanted)
                .arg(wait_ms)
                .query(&mut con)?;
            con.set_read_timeout(Some(self.timeout))?;
            Ok(acked)
        })();
        let acked = r.map_err(|e| self.note_failure(node, &e))?;
        node.give(con);
        if (acked as u64) < wanted {
            return Err(format!(
                "redis at {}: {acked} of {wanted} replicas acknowledged within {wait_ms} ms",
                node.addr
            ));
        }
        Ok(())
    }

    /// A key in a slot `node` owns, for its sync write.
    fn sync_key_for(&self, topo: &Topology, node: usize) -> Option<String> {
        // 16384 slots over even a thousand masters: a few tens of thousands
        // of candidates find every master's slot.
        (0..1u32 << 20)
            .map(|n| format::sync_key(&self.ns, n))
            .find(|k| topo.slots.owner(key_slot(k.as_bytes())) == Some(node))
    }
}

impl Tier for RedisTier {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn remote(&self) -> Option<String> {
        Some(self.describe())
    }

    fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<(), TierError>> {
        let n = ops.len();
        let mut res: Vec<Option<Result<(), TierError>>> = (0..n).map(|_| None).collect();
        let mut jobs = Vec::with_capacity(n);
        for (i, op) in ops.iter().enumerate() {
            match check_op(&self.layout, op.index, op.buf)
                .and_then(|()| self.job(Op::Read, i, op.index, None))
            {
                Ok(j) => jobs.push(j),
                Err(e) => res[i] = Some(Err(e)),
            }
        }
        let payload = self.layout.group_bytes() as usize;
        for (i, reply) in self.run(Op::Read, jobs, n).into_iter().enumerate() {
            let Some(reply) = reply else { continue };
            let index = ops[i].index;
            res[i] = Some(match reply {
                Ok(Value::BulkString(v)) => match format::decode(index, &v, ops[i].buf, payload) {
                    Ok(_generation) => Ok(()),
                    Err(m) => {
                        self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                        Err(self.fail(
                            Op::Read,
                            index,
                            libc::EIO,
                            format!("stored value is corrupt: {m}"),
                        ))
                    }
                },
                Ok(Value::Nil) => {
                    self.stats.lost.fetch_add(1, Ordering::Relaxed);
                    Err(self.fail(
                        Op::Read,
                        index,
                        libc::EIO,
                        "the server lost the key (evicted, flushed or restarted without persistence)"
                            .into(),
                    ))
                }
                Ok(Value::ServerError(e)) => Err(self.fail(
                    Op::Read,
                    index,
                    libc::EIO,
                    format!("server refused GET: {e}"),
                )),
                Ok(other) => {
                    self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                    Err(self.fail(Op::Read, index, libc::EIO, format!("GET replied {other:?}")))
                }
                Err(e) => Err(e),
            });
        }
        res.into_iter()
            .zip(ops.iter())
            .map(|(r, op)| {
                r.unwrap_or_else(|| {
                    Err(self.fail(Op::Read, op.index, libc::EIO, "no reply".into()))
                })
            })
            .collect()
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Vec<Result<(), TierError>> {
        let n = ops.len();
        let payload = self.layout.group_bytes() as usize;
        let mut res: Vec<Option<Result<(), TierError>>> = (0..n).map(|_| None).collect();
        let mut jobs = Vec::with_capacity(n);
        for (i, op) in ops.iter().enumerate() {
            let framed = || Framed::new(op.index, op.generation, &op.buf[..payload]);
            match check_op(&self.layout, op.index, op.buf)
                .and_then(|()| self.job(Op::Write, i, op.index, Some(framed())))
            {
                Ok(j) => jobs.push(j),
                Err(e) => res[i] = Some(Err(e)),
            }
        }
        for (i, reply) in self.run(Op::Write, jobs, n).into_iter().enumerate() {
            let Some(reply) = reply else { continue };
            let index = ops[i].index;
            res[i] = Some(match reply {
                Ok(Value::Okay) => Ok(()),
                Ok(Value::SimpleString(s)) if s == "OK" => Ok(()),
                Ok(Value::ServerError(e)) if e.code() == "OOM" => {
                    self.stats.oom.fetch_add(1, Ordering::Relaxed);
                    Err(self.fail(
                        Op::Write,
                        index,
                        libc::ENOSPC,
                        format!("server is out of memory: {e}"),
                    ))
                }
                Ok(other) => Err(self.fail(
                    Op::Write,
                    index,
                    libc::EIO,
                    format!("SET replied {other:?}"),
                )),
                Err(e) => Err(e),
            });
        }
        res.into_iter()
            .zip(ops.iter())
            .map(|(r, op)| {
                r.unwrap_or_else(|| {
                    Err(self.fail(Op::Write, op.index, libc::EIO, "no reply".into()))
                })
            })
            .collect()
    }

    /// Every Ok write is already in its master's memory; what is left is
    /// the replicas. Masters are waited on one after another.
    fn sync(&self) -> Result<(), TierError> {
        let targets: Vec<(Arc<Node>, Option<String>)> = {
            let t = self.topo.read();
            t.masters
                .iter()
                .map(|&m| (t.nodes[m].clone(), self.sync_key_for(&t, m)))
                .collect()
        };
        let mut failures = Vec::new();
        for (node, key) in targets {
            let r = match key {
                Some(k) => self.sync_node(&node, &k),
                None => Err(format!("no sync key hashes to a slot of {}", node.addr)),
            };
            if let Err(m) = r {
                failures.push(m);
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            Err(TierError::RemoteSync {
                errno: libc::EIO,
                message: failures.join("; "),
            })
        }
    }

    fn render_stats(&self, e: &mut Exposition) {
        let (up, down) = {
            let t = self.topo.read();
            t.masters.iter().fold((0, 0), |(u, d), &m| {
                if t.nodes[m].is_up() {
                    (u + 1, d)
                } else {
                    (u, d + 1)
                }
            })
        };
        e.header(
            stats::REMOTE_NODES,
            "gauge",
            "Redis masters the remote tier routes to, by what the last attempt on each saw",
        );
        e.sample(stats::REMOTE_NODES, "state=\"connected\"", up);
        e.sample(stats::REMOTE_NODES, "state=\"down\"", down);
        let s = &self.stats;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        e.single(
            stats::REMOTE_ERRORS,
            "counter",
            "Remote tier ops (and syncs) that failed, for any reason",
            load(&s.errors),
        );
        e.single(
            stats::REMOTE_TIMEOUTS,
            "counter",
            "Remote connects and round trips that timed out",
            load(&s.timeouts),
        );
        e.single(
            stats::REMOTE_LOST,
            "counter",
            "Remote reads of a group the server no longer had",
            load(&s.lost),
        );
        e.single(
            stats::REMOTE_CORRUPT,
            "counter",
            "Remote reads whose value failed its header or crc32c check",
            load(&s.corrupt),
        );
        e.single(
            stats::REMOTE_OOM,
            "counter",
            "Remote writes the server refused for lack of memory",
            load(&s.oom),
        );
        e.histogram(
            stats::REMOTE_ROUND_TRIP,
            "Remote pipeline round trips",
            &[("tier=\"redis\"", &s.round_trip)],
        );
    }
}
