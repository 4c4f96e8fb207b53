//! Processes that do not outlive the one that started them: a parent names itself in its
//! child's environment, and the child asks the kernel for SIGTERM when that parent dies (by
//! SIGKILL too), which it handles as a graceful stop. The kernel sends it when the thread that
//! spawned the child ends, so children are spawned from threads that live as long as their
//! process (the main thread, a runtime's workers).

/// The variable that carries the parent's pid.
pub const PARENT_PID_ENV: &str = "KVGATE_PARENT_PID";

/// The environment entry that ties a child to this process.
pub fn parent_env() -> (&'static str, String) {
    (PARENT_PID_ENV, std::process::id().to_string())
}

/// Called first thing by a kvgate process: when a parent named itself, SIGTERM comes when it
/// dies. An error when the parent is gone already.
pub fn stop_with_parent() -> Result<(), String> {
    let Some(parent) = std::env::var(PARENT_PID_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return Ok(());
    };
    #[cfg(target_os = "linux")]
    {
        use nix::sys::signal::Signal;
        nix::sys::prctl::set_pdeathsig(Signal::SIGTERM)
            .map_err(|e| format!("cannot ask to stop with the parent: {e}"))?;
        // The parent may have died before the request took effect.
        if nix::unistd::getppid().as_raw() != parent {
            return Err(format!("the parent process {parent} is gone"));
        }
    }
    Ok(())
}

/// Sends SIGTERM to `pid` (no error if it is gone).
pub fn terminate(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
}
