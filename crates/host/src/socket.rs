//! Where forkboxd listens unless told otherwise, and so where the CLI and
//! the SDK look: one definition for both ends.

use std::path::PathBuf;

/// `/run/forkbox/forkbox.sock` as root, else
/// `$XDG_RUNTIME_DIR/forkbox/forkbox.sock`; `None` when neither applies
/// (not root and no runtime directory), and the caller must be told where.
pub fn default_socket(is_root: bool, xdg_runtime_dir: Option<&str>) -> Option<PathBuf> {
    if is_root {
        return Some("/run/forkbox/forkbox.sock".into());
    }
    xdg_runtime_dir
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join("forkbox/forkbox.sock"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_socket_is_run_as_root_else_the_runtime_dir() {
        assert_eq!(
            default_socket(true, Some("/run/user/1000")),
            Some(PathBuf::from("/run/forkbox/forkbox.sock"))
        );
        assert_eq!(
            default_socket(false, Some("/run/user/1000")),
            Some(PathBuf::from("/run/user/1000/forkbox/forkbox.sock"))
        );
        assert_eq!(default_socket(false, Some("")), None);
        assert_eq!(default_socket(false, None), None);
    }
}
