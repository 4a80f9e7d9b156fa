//! One Redis server (a standalone server or a cluster master): its address,
//! a small pool of connections, and the pipelined round trip.
//!
//! A batch takes one connection per node for its whole stay on that node
//! and gives it back only if every round trip on it succeeded: a connection
//! that erred may hold half a reply, so it is dropped, and the next use
//! connects afresh (bounded by the timeout). Every connection carries read
//! and write timeouts, and a round trip stops at its first failure, so a
//! dead or stalled server costs one timeout per batch, never one per
//! command. `up` is what the last attempt saw, for the nodes gauge.

use redis::{Client, Connection, ConnectionAddr, ConnectionInfo, RedisError, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Idle connections kept per node: enough for the cascade's concurrent
/// flushers and readers without holding many sockets on a shared server.
const POOL_MAX: usize = 8;

pub(super) struct Node {
    /// `host:port` or the socket path: how messages name this node.
    pub(super) addr: String,
    client: Client,
    pool: parking_lot::Mutex<Vec<Connection>>,
    timeout: Duration,
    up: AtomicBool,
}

/// How messages name a connection address.
pub(super) fn addr_text(addr: &ConnectionAddr) -> String {
    match addr {
        ConnectionAddr::Tcp(h, p) => format!("{h}:{p}"),
        ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port}"),
        ConnectionAddr::Unix(p) => p.display().to_string(),
        other => format!("{other:?}"),
    }
}

impl Node {
    pub(super) fn new(info: ConnectionInfo, timeout: Duration) -> Result<Node, String> {
        let addr = addr_text(info.addr());
        let client = Client::open(info).map_err(|e| format!("redis at {addr}: {e}"))?;
        Ok(Node {
            addr,
            client,
            pool: parking_lot::Mutex::new(Vec::new()),
            timeout,
            up: AtomicBool::new(true),
        })
    }

    /// The same credentials and TLS settings at another host and port
    /// (a cluster master learnt from `CLUSTER SLOTS`).
    pub(super) fn sibling(seed: &ConnectionInfo, host: &str, port: u16) -> ConnectionInfo {
        let addr = match seed.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.to_string(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.to_string(), port),
        };
        seed.clone().set_addr(addr)
    }

    pub(super) fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    pub(super) fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Relaxed);
    }

    /// A pooled connection (`fresh` false) or a new one (`fresh` true).
    pub(super) fn take(&self) -> Result<(Connection, bool), RedisError> {
        if let Some(c) = self.pool.lock().pop() {
            return Ok((c, false));
        }
        self.connect().map(|c| (c, true))
    }

    /// A new connection with the node's timeouts set.
    pub(super) fn connect(&self) -> Result<Connection, RedisError> {
        let c = self.client.get_connection_with_timeout(self.timeout)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }

    /// Returns a connection whose every round trip succeeded.
    pub(super) fn give(&self, c: Connection) {
        let mut pool = self.pool.lock();
        if pool.len() < POOL_MAX {
            pool.push(c);
        }
    }

    /// Drops every idle connection: after one pooled connection was found
    /// dead (server restarted), its siblings are dead too.
    pub(super) fn drop_pool(&self) {
        self.pool.lock().clear();
    }
}

/// Sends a packed pipeline of `count` commands and reads its replies into
/// `out`, stopping at the first connection failure (a server error is a
/// reply, `Value::ServerError`, not a failure).
pub(super) fn round_trip(
    con: &mut Connection,
    packed: &[u8],
    count: usize,
    out: &mut Vec<Value>,
) -> Result<(), RedisError> {
    con.send_packed_command(packed)?;
    for _ in 0..count {
        out.push(con.recv_response()?);
    }
    Ok(())
}
