//! `forkbox-vmm`: parses the command line, runs one VM, and turns its end
//! into the process exit status (see `forkbox_vmm_api::exit_code`).
#![forbid(unsafe_code)]

use clap::Parser;
use forkbox_vmm::cli::Args;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FORKBOX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: a log file or a parent's pipe
        // gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if std::env::args().nth(1).as_deref() == Some("gateway") {
        run_gateway();
    }
    let args: Args = parse_or_exit(std::env::args());
    if let Some(secs) = args.orphan_grace_secs {
        forkbox_vmm::vm::set_orphan_grace(std::time::Duration::from_secs(secs));
    }
    if let Some(dir) = &args.cgroup {
        // Everything it allocates from here on is charged there.
        if let Err(e) = std::fs::write(dir.join("cgroup.procs"), "0") {
            eprintln!(
                "forkbox-vmm: error: cannot join the cgroup {}: {e}",
                dir.display()
            );
            std::process::exit(forkbox_vmm_api::exit_code::VMM_ERROR);
        }
    }
    let require_jail = args.require_jail;
    let root = args.root.clone();
    let run_as = args.run_as;
    let invocation = match args.into_invocation() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("forkbox-vmm: error: {:#}", anyhow::Error::new(e));
            std::process::exit(forkbox_vmm_api::exit_code::VMM_ERROR);
        }
    };
    // The jail's privileged steps: each needs CAP_SYS_ADMIN, which a VMM
    // started by a user without it lacks (said once by the daemon; with
    // --require-jail, refused).
    leave_host_namespaces(!invocation.needs_host_network(), require_jail);
    // While the host's files are there: whether this host can run a guest
    // at all (it reads /sys); /dev/kvm, which the VMM and its fork
    // children then use through this descriptor; and its sockets and logs.
    let opened = forkbox_vmm::host::check_host()
        .and_then(|()| forkbox_vmm::opened::kvm())
        .map_err(anyhow::Error::new)
        .and_then(|_| Ok(invocation.endpoints().open()?));
    let opened = match opened {
        Ok(opened) => opened,
        Err(e) => {
            eprintln!("forkbox-vmm: error: {e:#}");
            std::process::exit(forkbox_vmm_api::exit_code::VMM_ERROR);
        }
    };
    if let Some(root) = &root {
        jail_step(
            forkbox_vmm::mounts::enter_jail(root, &invocation.inputs()),
            "build this VMM's own root",
            require_jail,
        );
    }
    // Nothing below needs a privilege (but for becoming `run_as`, which
    // gives up the rest before the guest runs): the guest's exits reach a
    // process with none to give away.
    if let Err(e) = forkbox_vmm::lockdown::drop_privileges(run_as) {
        eprintln!("forkbox-vmm: error: {:#}", anyhow::Error::new(e));
        std::process::exit(forkbox_vmm_api::exit_code::VMM_ERROR);
    }
    forkbox_vmm::lockdown::enable(invocation.needs_host_network());
    let result = match invocation {
        forkbox_vmm::cli::Invocation::Boot(config) => forkbox_vmm::run(&config, opened),
        forkbox_vmm::cli::Invocation::Restore { dir, .. } => forkbox_vmm::run_restore(&dir, opened),
    };
    let code = match result {
        Ok(exit) => {
            eprintln!("forkbox-vmm: {exit}");
            exit.code()
        }
        Err(e) => {
            eprintln!("forkbox-vmm: error: {:#}", anyhow::Error::new(e));
            forkbox_vmm_api::exit_code::VMM_ERROR
        }
    };
    std::process::exit(code);
}

/// The command line, or the process's end: `--help` and `--version`
/// succeed; usage errors must not look like a guest reset (2), which is
/// clap's default status.
fn parse_or_exit<T: Parser>(args: impl IntoIterator<Item = String>) -> T {
    T::try_parse_from(args).unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() {
            forkbox_vmm_api::exit_code::VMM_ERROR
        } else {
            0
        });
    })
}

/// `forkbox-vmm gateway ...` ([`forkbox_vmm::sandbox_gateway`]): jailed
/// as a VMM is (but for its own root: it needs the sandbox's socket by
/// path), then serving the sandbox's frames until killed.
fn run_gateway() -> ! {
    use forkbox_vmm::sandbox_gateway::{self, GatewayArgs};
    let args: GatewayArgs = parse_or_exit(std::env::args().skip(1));
    let fail = |e: anyhow::Error| -> ! {
        eprintln!("forkbox-vmm gateway: error: {e:#}");
        std::process::exit(forkbox_vmm_api::exit_code::VMM_ERROR);
    };
    let (cfg, links) = sandbox_gateway::prepare(&args).unwrap_or_else(|e| fail(e.into()));
    // With a broker, every connection is the broker's: no network here.
    leave_host_namespaces(cfg.broker.is_some(), false);
    if let Err(e) = forkbox_vmm::lockdown::drop_privileges(None) {
        fail(e.into());
    }
    match sandbox_gateway::run(&args, &cfg, links) {
        Ok(()) => std::process::exit(0),
        Err(e) => fail(e.into()),
    }
}

/// Leaves the host's IPC and UTS namespaces, and its network namespace
/// when `network` (the process opens no connection of its own).
fn leave_host_namespaces(network: bool, require_jail: bool) {
    if network {
        jail_step(
            forkbox_vmm::namespaces::leave_host_network(),
            "leave the host's network namespace",
            require_jail,
        );
    }
    jail_step(
        forkbox_vmm::namespaces::leave_host_ipc_and_hostname(),
        "leave the host's IPC and UTS namespaces",
        require_jail,
    );
}

/// One step of the jail that needs `CAP_SYS_ADMIN`: without it (`EPERM`),
/// the VMM goes on without that part (the daemon said so at start), unless
/// `--require-jail`; any other failure ends the VMM.
fn jail_step(result: std::io::Result<()>, what: &str, require_jail: bool) {
    let Err(e) = result else { return };
    let unprivileged = e.raw_os_error() == Some(libc::EPERM);
    if unprivileged && !require_jail {
        tracing::info!("not privileged: cannot {what}: {e}");
        return;
    }
    let why = if unprivileged {
        " (it needs CAP_SYS_ADMIN), and --require-jail refuses to run without it"
    } else {
        ""
    };
    eprintln!("forkbox-vmm: error: cannot {what}: {e}{why}");
    std::process::exit(forkbox_vmm_api::exit_code::VMM_ERROR);
}
