//! [`DaemonError`]: why a request to the daemon failed, and whether the
//! sandbox machinery or the caller is to blame.

use std::time::Duration;

use forkbox_proto::AgentError;

use crate::backend::BackendError;
use crate::core::{CoreError, SandboxId};
use crate::template::TemplateError;

/// Why a request failed. [`DaemonError::is_infrastructure`] separates the
/// sandbox infrastructure failing from the caller's own mistakes.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    Invalid(String),
    #[error("no sandbox {0}")]
    NoSandbox(SandboxId),
    #[error("no template {0:?}")]
    NoTemplate(String),
    #[error("template {0:?} exists")]
    TemplateExists(String),
    #[error("bad template")]
    BadTemplate(#[source] TemplateError),
    #[error("{0}")]
    State(CoreError),
    #[error("no room after waiting {waited_ms} ms")]
    Capacity {
        waited_ms: u64,
        #[source]
        cause: CoreError,
    },
    /// The request conflicts with work in progress (a bake, say).
    #[error("{0}")]
    Busy(String),
    #[error("{0} is not supported by this backend")]
    Unsupported(&'static str),
    /// Its VM has no network to change: re-adopted from state an older
    /// daemon wrote, without a policy to serve it.
    #[error(
        "sandbox {0} has no network broker (re-adopted without one); its policy cannot change"
    )]
    NoNetwork(SandboxId),
    /// The guest refused a file operation (missing path, permissions…).
    #[error("the guest refused")]
    Guest(#[source] AgentError),
    /// A template's setup or readiness step failed: the recipe's fault.
    #[error("template step {step} failed: {message}")]
    Recipe {
        step: String,
        message: String,
        output: String,
    },
    /// The guest did not finish an agent call in time (its VM still
    /// runs): the guest's doing, not the machinery's.
    #[error("{what}: the guest did not answer within {after:?}")]
    GuestTimeout { what: String, after: Duration },
    /// The guest ended its VM (powered off, rebooted, panicked) before or
    /// during the call: the guest's doing, which a trainer scores.
    #[error("{what}")]
    GuestEnded { what: String },
    /// A transfer is over its size limit; `message` says the limit and
    /// how to raise it.
    #[error("{message}")]
    TooLarge { message: String },
    /// The VM, its VMM or the agent channel failed.
    #[error("sandbox infrastructure failed: {what}")]
    Infrastructure {
        what: String,
        #[source]
        cause: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl DaemonError {
    /// A short name for the error's class, used in the JSON body and in
    /// `/metrics`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) | Self::BadTemplate(_) => "invalid_request",
            Self::NoSandbox(_) | Self::NoTemplate(_) => "not_found",
            Self::TemplateExists(_) | Self::State(_) | Self::Busy(_) | Self::NoNetwork(_) => {
                "conflict"
            }
            Self::Capacity { .. } => "capacity",
            Self::Unsupported(_) => "unsupported",
            Self::Guest(_) => "guest",
            Self::GuestTimeout { .. } => "guest_timeout",
            Self::GuestEnded { .. } => "guest_ended",
            Self::TooLarge { .. } => "too_large",
            Self::Recipe { .. } => "template_failed",
            Self::Infrastructure { .. } => "infrastructure",
        }
    }

    /// True when the sandbox machinery failed rather than the request or
    /// the user's command: training loops mask these instead of scoring
    /// them.
    pub fn is_infrastructure(&self) -> bool {
        matches!(self, Self::Infrastructure { .. })
    }

    pub(super) fn infra(
        what: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Infrastructure {
            what: what.into(),
            cause: Some(Box::new(cause)),
        }
    }
}

impl From<CoreError> for DaemonError {
    fn from(e: CoreError) -> Self {
        match e {
            CoreError::NotFound(id) => Self::NoSandbox(id),
            e => Self::State(e),
        }
    }
}

impl From<BackendError> for DaemonError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Unsupported(what) => Self::Unsupported(what),
            e => Self::infra("the VM backend failed", e),
        }
    }
}

/// The chain of an error's causes, `: `-joined.
pub use forkbox_proto::error_chain as chain;
