//! Real `redis-server` processes for tests (unit and integration): each on
//! a free loopback port in its own temporary directory, killed on drop.
//!
//! Not part of the tier; public only so `tests/` can share it. Test code:
//! it panics when a server cannot be started, since a test cannot go on.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether `redis-server` and `redis-cli` can run here; prints why a test
/// skips when not.
pub fn available() -> bool {
    let ok = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let yes = ok("redis-server") && ok("redis-cli");
    if !yes {
        eprintln!("skipping: redis-server/redis-cli not on PATH");
    }
    yes
}

/// A loopback port that is free now, with its cluster bus port (+10000)
/// free too.
fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let p = l.local_addr().expect("local addr").port();
        if p < 55000 && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            return p;
        }
    }
}

/// One `redis-server`.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    args: Vec<String>,
    child: Option<Child>,
    /// TLS port and the test CA its certificate comes from.
    tls: Option<(u16, Arc<TestPki>)>,
}

impl RedisServer {
    /// Starts a server that persists nothing, plus `extra` arguments
    /// (`["--maxmemory", "2mb"]`); later arguments override earlier ones.
    pub fn start(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut args: Vec<String> = [
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push("--dir".into());
        args.push(dir.path().display().to_string());
        args.push("--logfile".into());
        args.push(dir.path().join("log").display().to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut s = RedisServer {
            port: 0,
            dir,
            args,
            child: None,
            tls: None,
        };
        // Another test may take the port between our probe and the bind:
        // then the server exits, and we try another.
        for _ in 0..5 {
            s.port = free_port();
            if s.spawn() {
                return s;
            }
        }
        panic!("redis-server would not start; log: {}", s.log());
    }

    /// A cluster-enabled node (not yet part of a cluster); with `tls`,
    /// it also speaks TLS on a port of its own (certificate of that test
    /// CA, clients not asked for theirs), and its cluster bus is TLS.
    pub fn start_cluster_node(tls: Option<&Arc<TestPki>>) -> RedisServer {
        let cluster = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ];
        let Some(pki) = tls else {
            return RedisServer::start(&cluster);
        };
        let port = free_port();
        let tls = pki.server_args(port, false);
        let mut args: Vec<&str> = cluster.to_vec();
        args.extend(["--tls-cluster", "yes"]);
        args.extend(tls.iter().map(String::as_str));
        let mut s = RedisServer::start(&args);
        s.tls = Some((port, pki.clone()));
        s
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(_)) = c.try_wait()
            {
                self.child = None;
                return false;
            }
            if self.cli(&["ping"]) == "PONG" {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    /// SIGKILL: no shutdown save, connections reset.
    pub fn kill(&mut self) {
        self.freeze(false);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the server: a stalled
    /// server keeps its sockets open but never replies.
    pub fn freeze(&self, frozen: bool) {
        let Some(c) = self.child.as_ref() else { return };
        let sig = if frozen { "-STOP" } else { "-CONT" };
        let ok = Command::new("kill")
            .arg(sig)
            .arg(c.id().to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} redis-server");
    }

    /// Starts the server again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server would not restart: {}",
            self.log()
        );
    }

    /// `redis-cli -p PORT args…`'s output, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .arg("-p")
            .arg(self.port.to_string())
            .args(args)
            .stderr(Stdio::null())
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Starts a server that speaks TLS only, its certificate (for
    /// 127.0.0.1 and localhost) signed by a test CA made by `openssl`;
    /// `auth_clients`: it asks clients for a certificate signed by the same
    /// CA (`tls-auth-clients yes`). None where openssl is missing.
    pub fn start_tls(auth_clients: bool) -> Option<RedisServer> {
        let pki = Arc::new(TestPki::make()?);
        let port = free_port();
        let args = pki.server_args(port, auth_clients);
        let mut s = RedisServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
        s.tls = Some((port, pki));
        Some(s)
    }

    /// `rediss://` URL of a TLS server, certificate not verified.
    pub fn tls_url(&self) -> Option<String> {
        Some(format!("{}/#insecure", self.tls_url_checked()?))
    }

    /// `rediss://` URL of a TLS server, its certificate checked.
    pub fn tls_url_checked(&self) -> Option<String> {
        let (port, _) = self.tls.as_ref()?;
        Some(format!("rediss://127.0.0.1:{port}"))
    }

    /// The test CA and client certificate of a TLS server.
    pub fn tls_pki(&self) -> Option<&TestPki> {
        self.tls.as_ref().map(|(_, pki)| &**pki)
    }

    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of `n` masters, no replicas, all slots assigned.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(n: usize) -> RedisCluster {
        RedisCluster::of(
            (0..n)
                .map(|_| RedisServer::start_cluster_node(None))
                .collect(),
        )
    }

    /// `start`, each node also speaking TLS (see `start_cluster_node`),
    /// with one test CA; None where openssl is missing.
    pub fn start_tls(n: usize) -> Option<RedisCluster> {
        let pki = Arc::new(TestPki::make()?);
        let nodes = (0..n)
            .map(|_| RedisServer::start_cluster_node(Some(&pki)))
            .collect();
        Some(RedisCluster::of(nodes))
    }

    /// Joins `nodes` into a cluster (through their plain ports), every
    /// slot assigned, and waits until each node says it is ok.
    fn of(nodes: Vec<RedisServer>) -> RedisCluster {
        let n = nodes.len();
        let mut args = vec!["--cluster".to_string(), "create".to_string()];
        args.extend(nodes.iter().map(|s| format!("127.0.0.1:{}", s.port)));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let out = Command::new("redis-cli")
            .args(&args)
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let c = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !c.nodes.iter().all(|s| {
            let i = s.cli(&["cluster", "info"]);
            i.contains("cluster_state:ok") && i.contains(&format!("cluster_known_nodes:{n}"))
        }) {
            assert!(Instant::now() < deadline, "cluster never became ok");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|s| s.url()).collect()
    }

    /// Each node's checked `rediss://` URL (a `start_tls` cluster).
    pub fn tls_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter_map(|s| s.tls_url_checked())
            .collect()
    }
}

/// A test CA (`ca.pem`) and, signed by it, a server certificate for
/// 127.0.0.1 and localhost and a client certificate, with their keys, in a
/// temporary directory.
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// None (and a message) where `openssl` cannot make them.
    pub fn make() -> Option<TestPki> {
        let dir = tempfile::tempdir().expect("temp dir");
        let openssl = |args: &[&str]| {
            Command::new("openssl")
                .args(args)
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut made = openssl(
            &[
                &["req", "-x509", "-days", "1", "-subj", "/CN=kvfs test CA"],
                &key[..],
                &["-keyout", "ca.key", "-out", "ca.pem"],
            ]
            .concat(),
        );
        for (name, cn, ext) in [
            // Cluster nodes present it to each other as clients too.
            (
                "server",
                "localhost",
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
            ),
            (
                "client",
                "kvfs test client",
                "extendedKeyUsage=clientAuth\n",
            ),
        ] {
            let ext_file = format!("{name}.ext");
            std::fs::write(dir.path().join(&ext_file), ext).expect("write an extensions file");
            let (k, csr, pem) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
            );
            made =
                made && openssl(
                    &[
                        &["req", "-subj", &format!("/CN={cn}")],
                        &key[..],
                        &["-keyout", &k, "-out", &csr],
                    ]
                    .concat(),
                ) && openssl(&[
                    "x509",
                    "-req",
                    "-days",
                    "1",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-extfile",
                    &ext_file,
                    "-out",
                    &pem,
                ]);
        }
        if !made {
            eprintln!("skipping: openssl cannot make test certificates");
            return None;
        }
        Some(TestPki { dir })
    }

    /// redis-server arguments to speak TLS on `port` with the server
    /// certificate; `auth_clients`: ask clients for one of this CA's.
    fn server_args(&self, port: u16, auth_clients: bool) -> Vec<String> {
        let (cert, key) = self.server();
        [
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &cert.display().to_string(),
            "--tls-key-file",
            &key.display().to_string(),
            "--tls-ca-cert-file",
            &self.ca().display().to_string(),
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ]
        .map(String::from)
        .to_vec()
    }

    /// The CA's certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server's certificate and key.
    pub fn server(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.path().join("server.pem"),
            self.dir.path().join("server.key"),
        )
    }

    /// The client's certificate and key.
    pub fn client(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.path().join("client.pem"),
            self.dir.path().join("client.key"),
        )
    }
}
