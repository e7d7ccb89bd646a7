//! Where the daemon listens and where clients look for it.

use std::net::SocketAddr;
use std::path::PathBuf;

/// A listening address: `unix://PATH` or `tcp://HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListenError {
    #[error("{0:?}: expected unix://PATH or tcp://HOST:PORT")]
    Scheme(String),
    #[error("{0:?}: not an IP address and port")]
    Addr(String),
    #[error("no default socket: not root and $XDG_RUNTIME_DIR is unset; pass --listen")]
    NoDefault,
}

impl std::str::FromStr for Listen {
    type Err = ListenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix://") {
            if path.is_empty() {
                return Err(ListenError::Scheme(s.into()));
            }
            Ok(Self::Unix(path.into()))
        } else if let Some(addr) = s.strip_prefix("tcp://") {
            addr.parse()
                .map(Self::Tcp)
                .map_err(|_| ListenError::Addr(s.into()))
        } else {
            Err(ListenError::Scheme(s.into()))
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix://{}", p.display()),
            Self::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

/// `/run/forkbox/forkbox.sock` as root, else
/// `$XDG_RUNTIME_DIR/forkbox/forkbox.sock`: the rule the CLI's client
/// (`forkbox_host::socket::default_socket`) owns, so both always agree.
pub fn default_socket(
    is_root: bool,
    xdg_runtime_dir: Option<&str>,
) -> Result<PathBuf, ListenError> {
    forkbox_host::socket::default_socket(is_root, xdg_runtime_dir).ok_or(ListenError::NoDefault)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_parses_both_schemes() {
        assert_eq!(
            "unix:///tmp/f.sock".parse::<Listen>(),
            Ok(Listen::Unix("/tmp/f.sock".into()))
        );
        assert_eq!(
            "tcp://127.0.0.1:7000".parse::<Listen>(),
            Ok(Listen::Tcp("127.0.0.1:7000".parse().expect("addr")))
        );
        assert!(matches!(
            "http://x".parse::<Listen>(),
            Err(ListenError::Scheme(_))
        ));
        assert!(matches!(
            "tcp://localhost".parse::<Listen>(),
            Err(ListenError::Addr(_))
        ));
        assert!(matches!(
            "unix://".parse::<Listen>(),
            Err(ListenError::Scheme(_))
        ));
    }

    #[test]
    fn default_socket_depends_on_root_and_xdg() {
        assert_eq!(
            default_socket(true, Some("/run/user/1000")),
            Ok("/run/forkbox/forkbox.sock".into())
        );
        assert_eq!(
            default_socket(false, Some("/run/user/1000")),
            Ok("/run/user/1000/forkbox/forkbox.sock".into())
        );
        assert_eq!(default_socket(false, None), Err(ListenError::NoDefault));
    }
}
