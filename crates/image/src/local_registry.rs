//! A real registry on loopback, for tests and benchmarks: Debian's
//! `docker-registry` (the CNCF distribution registry), its storage in a
//! temporary directory, ended when dropped.

use std::io;
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A registry on 127.0.0.1 (speak plain HTTP to it).
pub struct LocalRegistry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl LocalRegistry {
    /// An anonymous registry.
    pub fn start() -> io::Result<Self> {
        Self::start_with_yaml(|_| Ok(String::new()))
    }

    /// A registry that asks for basic auth (htpasswd, bcrypt) and knows
    /// that one user (the `testing` feature).
    #[cfg(feature = "testing")]
    pub fn start_with_basic(user: &str, password: &str) -> io::Result<Self> {
        Self::start_with_yaml(|dir| {
            let hash = bcrypt::hash(password, 4).map_err(io::Error::other)?;
            let htpasswd = dir.join("htpasswd");
            std::fs::write(&htpasswd, format!("{user}:{hash}\n"))?;
            Ok(format!(
                "auth:\n  htpasswd:\n    realm: forkbox-test\n    path: {}\n",
                htpasswd.display()
            ))
        })
    }

    /// A registry that asks for a bearer token from `realm` (a token
    /// server the caller runs), trusting tokens signed by the key of
    /// `cert_pem` whose issuer and audience are `forkbox-test` (the
    /// `testing` feature).
    #[cfg(feature = "testing")]
    pub fn start_with_token(realm: &str, cert_pem: &str) -> io::Result<Self> {
        Self::start_with_yaml(|dir| {
            let bundle = dir.join("token-cert.pem");
            std::fs::write(&bundle, cert_pem)?;
            Ok(format!(
                "auth:\n  token:\n    realm: {realm}\n    service: forkbox-test\n    issuer: forkbox-test\n    rootcertbundle: {}\n",
                bundle.display()
            ))
        })
    }

    fn start_with_yaml(
        extra: impl FnOnce(&std::path::Path) -> io::Result<String>,
    ) -> io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        let yaml = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n{}",
            dir.path().join("data").display(),
            extra(dir.path())?
        );
        std::fs::write(&config, yaml)?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "cannot run docker-registry ({e}): apt-get install docker-registry \
                         (`make test` installs it)"
                    ),
                )
            })?;
        let mut me = LocalRegistry {
            child,
            addr,
            _dir: dir,
        };
        let start = Instant::now();
        while TcpStream::connect(&me.addr).is_err() {
            if let Some(status) = me.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "docker-registry exited: {status}"
                )));
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(io::Error::other(format!(
                    "docker-registry never listened on {}",
                    me.addr
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(me)
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
