//! A VM's network as this process holds it: the broker its VMM asks for
//! connections and lookups (its own, so a fork child's policy can change
//! alone), its policy, and its egress log.

use std::path::{Path, PathBuf};

use forkbox_net::log::{read_json_lines, EgressRecord};
use forkbox_net::policy::Policy;

use crate::netbroker::NetBroker;

use super::*;

/// The egress log's name in a VM's directory.
pub(super) const EGRESS_LOG: &str = "egress.jsonl";

/// A VM's network as this process holds it: the broker its VMM asks (its
/// own: a fork child's policy can change alone) and its egress log.
pub(super) struct VmNet {
    pub(super) broker: NetBroker,
    pub(super) egress_log: PathBuf,
}

impl VmNet {
    pub(super) fn broker_path(dir: &Path) -> PathBuf {
        dir.join("net-broker.sock")
    }

    /// Starts the broker of a VM whose directory is `dir`. Its VMM never
    /// connects to it by path: its links are connected for it, before it
    /// enters its own root (by itself, still as the daemon's user) or by
    /// the asker of the fork that makes it, and it is handed the egress
    /// log on the first.
    pub(super) fn start(
        dir: &Path,
        policy: Policy,
        egress_log: Option<PathBuf>,
    ) -> Result<Self, VmError> {
        let egress_log = egress_log.unwrap_or_else(|| dir.join(EGRESS_LOG));
        let path = Self::broker_path(dir);
        let broker = NetBroker::start_with_log(&path, policy, Some(egress_log.clone()))?;
        Ok(Self { broker, egress_log })
    }

    /// Starts the broker of a VMM about to be spawned (booted or restored)
    /// in `dir`, with the arguments that give the VMM its network: the
    /// policy (a file in `dir`), the broker and the egress log.
    pub(super) fn start_for_vmm(
        dir: &Path,
        network: &NetworkSpec,
    ) -> Result<(Self, [std::ffi::OsString; 6]), VmError> {
        let policy_path = dir.join("net-policy.json");
        let json = serde_json::to_string(&network.policy)
            .map_err(|e| VmError::Io(std::io::Error::other(e)))?;
        std::fs::write(&policy_path, json).map_err(VmError::Io)?;
        let net = Self::start(dir, network.policy.clone(), network.egress_log.clone())?;
        let args = [
            "--net-policy".into(),
            policy_path.into(),
            "--net-broker".into(),
            net.broker.path().into(),
            "--net-log".into(),
            net.egress_log.clone().into(),
        ];
        Ok((net, args))
    }
}

/// A VM's network: virtio-net behind the VMM's userspace gateway, egress
/// decided by `policy`.
#[derive(Debug, Clone, Default)]
pub struct NetworkSpec {
    pub policy: Policy,
    /// Append the egress log (JSON lines) here; `None`: a file in the VM's
    /// own directory, removed with it.
    pub egress_log: Option<PathBuf>,
}

impl From<Policy> for NetworkSpec {
    /// A network under `policy`, its egress log in the VM's directory.
    fn from(policy: Policy) -> Self {
        Self {
            policy,
            egress_log: None,
        }
    }
}

impl Vm {
    /// Where this VM's egress log is (JSON lines), if it has a network.
    pub fn egress_log_path(&self) -> Option<PathBuf> {
        self.net.as_ref().map(|n| n.egress_log.clone())
    }

    /// The egress policy this VM's connections and lookups are decided by
    /// (`None`: no network).
    pub fn network_policy(&self) -> Option<Policy> {
        self.net.as_ref().map(|n| n.broker.policy())
    }

    /// Decides this VM's new connections and DNS lookups by `policy` from
    /// now on (its broker's and its gateway's copy); open connections stay.
    pub fn set_network_policy(&self, policy: &Policy) -> Result<(), VmError> {
        let net = self.net.as_ref().ok_or(VmError::NoNetwork)?;
        Ok(net.broker.set_policy(policy.clone())?)
    }

    /// The last `limit` egress records of this VM (its own: a fork
    /// child's log starts empty).
    pub fn egress_log(&self, limit: usize) -> Result<Vec<EgressRecord>, VmError> {
        let path = self.egress_log_path().ok_or(VmError::NoNetwork)?;
        match std::fs::File::open(&path) {
            Ok(f) => read_json_lines(std::io::BufReader::new(f), limit).map_err(VmError::EgressLog),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(VmError::Io(e)),
        }
    }
}
