//! For tests, here and in the crates above: a real registry, Debian's
//! `docker-registry` (the CNCF distribution registry), started on loopback
//! with its storage in a temporary directory. Built with the `testing`
//! feature only.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A registry on 127.0.0.1, ended when dropped. Its methods panic on
/// failure, as a test would.
pub struct LocalRegistry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl LocalRegistry {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// With `basic`, the registry asks for basic auth (htpasswd, bcrypt)
    /// and knows that one user.
    pub fn start_with(basic: Option<(&str, &str)>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        let mut yaml = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        if let Some((user, password)) = basic {
            let hash = bcrypt::hash(password, 4).expect("bcrypt");
            let htpasswd = dir.path().join("htpasswd");
            std::fs::write(&htpasswd, format!("{user}:{hash}\n")).expect("htpasswd");
            yaml += &format!(
                "auth:\n  htpasswd:\n    realm: forkbox-test\n    path: {}\n",
                htpasswd.display()
            );
        }
        std::fs::write(&config, yaml).expect("config");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "run docker-registry (apt-get install docker-registry; `make test` installs it)",
            );
        let start = Instant::now();
        while TcpStream::connect(&addr).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the registry never listened on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        LocalRegistry {
            child,
            addr,
            _dir: dir,
        }
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
