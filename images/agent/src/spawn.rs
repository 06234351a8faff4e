//! Starting a workload process without forking the agent: the one place the agent needs `unsafe`.
//!
//! `std::process::Command` forks the whole agent whenever the child must change its ids, and the workload
//! always runs as another user. Under emulation a fork of a multi-threaded process is dear: its page tables
//! are copied, and every page either side writes afterwards takes a fault. It cost as much as the guest's
//! whole bare fork, exec and wait. Here the child is a `clone(CLONE_VM | CLONE_VFORK)` on a stack of its
//! own, as `posix_spawn` does it: it shares the agent's memory until it calls `execve`, and the calling
//! thread waits meanwhile. So the child may only make raw system calls on memory prepared before the clone:
//! no allocation (another agent thread may hold the allocator's lock), no libc wrapper that keeps
//! process-wide state (glibc's `setuid` signals every thread of the agent), no panic. Once the child took the
//! workload's ids, the kernel marks the shared memory not dumpable, so no process of the workload user can
//! read it (ptrace, `/proc/PID/mem`) before `execve` replaces it.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::{c_int, c_long, c_void, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use nix::libc;
use nix::unistd::Pid;
use vm_protocol::identity::WorkloadIdentity;
use vm_protocol::rlimit::{Resource, Rlimit};

/// The child's stack: it makes a few system calls and nothing else.
const STACK_BYTES: usize = 64 * 1024;
/// What `execvp` searches when the environment has no `PATH`.
const DEFAULT_PATH: &str = "/bin:/usr/bin";
/// The kernel's signal set: 64 signals.
const SIGSET_BYTES: c_long = 8;
/// The kernel's signals, 1 to 64 (`_NSIG - 1`) on x86-64; no libc call is made in the child to learn it.
const KERNEL_SIGNALS: c_int = 64;
/// The child's exit status when it could not run the program (the parent reports the errno instead).
const EXIT_FAILED: c_int = 127;
/// The shell that runs an executable file with no `#!` line, as `execvp` does.
const SHELL: &[u8] = b"/bin/sh\0";

/// How the child's stdio is set up.
#[derive(Debug)]
pub(crate) enum Stdio<'a> {
    /// These three descriptors become stdin, stdout and stderr; the child leads a process group of its own,
    /// so signals reach the whole job, as a terminal's would.
    Pipes([&'a OwnedFd; 3]),
    /// A PTY's slave side becomes all three, and the controlling terminal of the child's new session, so
    /// the terminal's signals (Ctrl-C, SIGWINCH) reach its foreground process group.
    Terminal(&'a OwnedFd),
}

/// Everything the child needs, as the kernel takes it.
#[derive(Debug)]
pub(crate) struct Plan<'a> {
    /// The program (searched in the environment's `PATH` unless it has a `/`) and its arguments.
    pub argv: &'a [String],
    /// The environment; a later value of a key replaces an earlier one.
    pub env: Vec<(&'a str, &'a str)>,
    pub cwd: &'a str,
    pub run_as: Option<WorkloadIdentity>,
    pub stdio: Stdio<'a>,
    /// Set before the ids change, so that a hard limit may be raised.
    pub rlimits: &'a [Rlimit],
    /// A container's root to `chroot` into before the ids change ([`crate::containers`]); `cwd` and the
    /// program are then found in it.
    pub root: Option<&'a std::path::Path>,
}

/// Why a child did not run its program.
#[derive(Debug)]
pub(crate) enum SpawnError {
    /// The kernel refused a resource limit (a hard limit above what it allows, such as `nofile` over
    /// `fs.nr_open`).
    Limit(io::Error),
    /// Any other step, up to and including `execve`.
    Start(io::Error),
}

/// Starts the child and returns its pid once it runs the program. The caller reaps it later (it is a child
/// of the agent like any other).
///
/// # Errors
/// The error of the step that failed, before or at `execve` (a failed child is reaped here): in
/// [`SpawnError::Start`], `NotFound` when no file of that name exists on the path, `PermissionDenied` when one
/// exists but may not be executed.
pub(crate) fn spawn(plan: &Plan<'_>) -> Result<Pid, SpawnError> {
    let prepared = Prepared::new(plan).map_err(SpawnError::Start)?;
    let mut stack = vec![0_u128; STACK_BYTES / size_of::<u128>()];
    // x86-64 and aarch64 stacks grow down: the child starts at the end, 16-byte aligned by the element type.
    let top = stack.as_mut_ptr_range().end.cast::<c_void>();
    let arg = std::ptr::from_ref(&prepared).cast_mut().cast::<c_void>();
    // SAFETY: `child` runs on `stack`, which outlives it: with CLONE_VFORK this call returns only once the
    // child called `execve` (which replaces its memory) or exited. Until then the child shares our memory and
    // reads only `prepared`, which stays alive and unmoved across the call, and writes only its atomic
    // `failed`. The child makes raw system calls only (see the module's comment).
    let pid = unsafe { libc::clone(child, top, libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD, arg) };
    drop(stack);
    if pid < 0 {
        return Err(SpawnError::Start(io::Error::last_os_error()));
    }
    let pid = Pid::from_raw(pid);
    match prepared.failed.load(Ordering::Acquire) {
        0 => Ok(pid),
        errno => {
            // It exited without running anything: reap it before anyone looks for it.
            let _ = nix::sys::wait::waitpid(pid, None);
            let error = io::Error::from_raw_os_error(errno);
            Err(if prepared.limit_failed.load(Ordering::Acquire) {
                SpawnError::Limit(error)
            } else {
                SpawnError::Start(error)
            })
        }
    }
}

/// The plan as C strings and pointer arrays, made before the clone.
struct Prepared {
    /// Each place the program may be, in search order.
    candidates: Vec<CString>,
    /// Whether they came from the PATH (a missing one is then passed over), not from a name with a `/`.
    searched: bool,
    argv_ptrs: Vec<*const libc::c_char>,
    /// Per candidate: `/bin/sh`, its path, then the arguments after `argv[0]`.
    shell_argvs: Vec<Vec<*const libc::c_char>>,
    envp_ptrs: Vec<*const libc::c_char>,
    /// The strings the pointer arrays point into.
    _strings: (Vec<CString>, Vec<CString>),
    cwd: CString,
    root: Option<CString>,
    ids: Option<(libc::uid_t, libc::gid_t)>,
    stdio: [RawFd; 3],
    terminal: bool,
    /// Each limit as `prlimit64` takes it: the resource's number and `[soft, hard]`.
    rlimits: Vec<(c_long, [u64; 2])>,
    /// The errno of the step that failed in the child; 0 while none did.
    failed: AtomicI32,
    /// Whether that step was a resource limit.
    limit_failed: AtomicBool,
}

impl Prepared {
    fn new(plan: &Plan<'_>) -> io::Result<Self> {
        let Some(program) = plan.argv.first() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no program"));
        };
        let env: BTreeMap<&str, &str> = plan.env.iter().copied().collect();
        let searched = !program.contains('/');
        let candidates = if program.is_empty() {
            // Nothing to run: not found, as `execvp("")` says.
            Vec::new()
        } else if !searched {
            vec![c_string(program)?]
        } else {
            let path = env.get("PATH").copied().unwrap_or(DEFAULT_PATH);
            path.split(':')
                .map(|dir| c_string(&format!("{}/{program}", if dir.is_empty() { "." } else { dir })))
                .collect::<io::Result<_>>()?
        };
        let argv = plan.argv.iter().map(|a| c_string(a)).collect::<io::Result<Vec<_>>>()?;
        let argv_ptrs = pointers(&argv);
        let shell_argvs = candidates
            .iter()
            .map(|path| {
                [SHELL.as_ptr().cast(), path.as_ptr()].into_iter().chain(argv_ptrs[1..].iter().copied()).collect()
            })
            .collect();
        let envp = env.iter().map(|(k, v)| c_string(&format!("{k}={v}"))).collect::<io::Result<Vec<_>>>()?;
        let envp_ptrs = pointers(&envp);
        let (stdio, terminal) = match plan.stdio {
            Stdio::Pipes(fds) => (fds.map(AsRawFd::as_raw_fd), false),
            Stdio::Terminal(slave) => ([slave.as_raw_fd(); 3], true),
        };
        Ok(Self {
            candidates,
            searched,
            argv_ptrs,
            shell_argvs,
            envp_ptrs,
            _strings: (argv, envp),
            cwd: c_string(plan.cwd)?,
            root: plan.root.map(|r| c_bytes(r.as_os_str().as_bytes())).transpose()?,
            ids: plan.run_as.map(|w| (w.uid, w.gid)),
            stdio,
            terminal,
            rlimits: plan.rlimits.iter().map(|l| (resource_number(l.resource), [l.soft, l.hard])).collect(),
            failed: AtomicI32::new(0),
            limit_failed: AtomicBool::new(false),
        })
    }
}

/// The kernel's number for `resource`.
fn resource_number(resource: Resource) -> c_long {
    let number = match resource {
        Resource::As => libc::RLIMIT_AS,
        Resource::Core => libc::RLIMIT_CORE,
        Resource::Cpu => libc::RLIMIT_CPU,
        Resource::Data => libc::RLIMIT_DATA,
        Resource::Fsize => libc::RLIMIT_FSIZE,
        Resource::Locks => libc::RLIMIT_LOCKS,
        Resource::Memlock => libc::RLIMIT_MEMLOCK,
        Resource::Msgqueue => libc::RLIMIT_MSGQUEUE,
        Resource::Nice => libc::RLIMIT_NICE,
        Resource::Nofile => libc::RLIMIT_NOFILE,
        Resource::Nproc => libc::RLIMIT_NPROC,
        Resource::Rss => libc::RLIMIT_RSS,
        Resource::Rtprio => libc::RLIMIT_RTPRIO,
        Resource::Rttime => libc::RLIMIT_RTTIME,
        Resource::Sigpending => libc::RLIMIT_SIGPENDING,
        Resource::Stack => libc::RLIMIT_STACK,
    };
    c_long::from(number)
}

fn c_string(s: &str) -> io::Result<CString> {
    c_bytes(s.as_bytes())
}

fn c_bytes(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in an argument"))
}

/// A null-terminated array of pointers into `strings`.
fn pointers(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect()
}

/// The child, between the clone and `execve`. It never returns: it runs the program or exits with 127,
/// leaving the errno of the step that failed in `failed`.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Prepared` that `spawn` passed, alive and unchanged until this child execs or
    // exits (the parent waits, CLONE_VFORK).
    let p = unsafe { &*arg.cast::<Prepared>() };
    let errno = match setup(p) {
        Ok(()) => exec(p),
        Err(errno) => errno,
    };
    // Never 0 here, which would tell the parent the program runs.
    p.failed.store(if errno == 0 { libc::EINVAL } else { errno }, Ordering::Release);
    // SAFETY: a raw exit of this process (not the agent: the child has its own thread group).
    let _ = unsafe { raw(libc::SYS_exit_group, [c_long::from(EXIT_FAILED), 0, 0, 0]) };
    EXIT_FAILED
}

/// One raw system call with up to four arguments (the kernel ignores those `nr` does not take);
/// `Err(errno)` on failure. Raw calls act on this process only and keep no libc state (the errno they leave in
/// the shared thread-local slot belongs to a thread that is waiting for us).
///
/// # Safety
/// `args` must be what the kernel expects for `nr`, pointers among them valid for the call.
// SAFETY: an `unsafe fn` for its callers' pointers; its body is the one call its contract describes.
unsafe fn raw(nr: c_long, args: [c_long; 4]) -> Result<c_long, c_int> {
    // SAFETY: the caller passes the arguments `nr` takes.
    let r = unsafe { libc::syscall(nr, args[0], args[1], args[2], args[3]) };
    if r == -1 {
        Err(nix::errno::Errno::last_raw())
    } else {
        Ok(r)
    }
}

/// Limits, stdio, root, ids, directory, session and signals, in the order `std` uses (limits first: they may
/// raise a hard limit, which needs the agent's privilege).
fn setup(p: &Prepared) -> Result<(), c_int> {
    // SAFETY: each call passes plain integers, or pointers to C strings, limits in `p` and to the local
    // sigaction and signal set, all alive for the call.
    unsafe {
        for (resource, limit) in &p.rlimits {
            // `prlimit64(0, ...)` is this process; the kernel's `rlimit64` is two u64s, soft then hard.
            if let Err(errno) = raw(libc::SYS_prlimit64, [0, *resource, limit.as_ptr() as c_long, 0]) {
                p.limit_failed.store(true, Ordering::Release);
                return Err(errno);
            }
        }
        for (target, fd) in (0..).zip(p.stdio) {
            if fd == target {
                // Already in place; only its close-on-exec flag must go.
                raw(libc::SYS_fcntl, [fd.into(), libc::F_SETFD.into(), 0, 0])?;
            } else {
                raw(libc::SYS_dup3, [fd.into(), target.into(), 0, 0])?;
            }
        }
        if let Some(root) = &p.root {
            // Own to this child: without CLONE_FS the clone has a copy of the agent's root and directory.
            raw(libc::SYS_chroot, [root.as_ptr() as c_long, 0, 0, 0])?;
        }
        if let Some((uid, gid)) = p.ids {
            raw(libc::SYS_setgroups, [0; 4])?;
            raw(libc::SYS_setgid, [gid.into(), 0, 0, 0])?;
            raw(libc::SYS_setuid, [uid.into(), 0, 0, 0])?;
        }
        raw(libc::SYS_chdir, [p.cwd.as_ptr() as c_long, 0, 0, 0])?;
        if p.terminal {
            raw(libc::SYS_setsid, [0; 4])?;
            raw(libc::SYS_ioctl, [0, libc::TIOCSCTTY as c_long, 0, 0])?;
        } else {
            raw(libc::SYS_setpgid, [0; 4])?;
        }
        // The workload gets every signal's default action, whatever the agent ignores (SIGPIPE, as Rust's
        // runtime does) or inherited (SIGINT and SIGQUIT, from a shell's background job), and no blocked
        // signal: an ignored disposition would survive the exec. The kernel's sigaction for SIG_DFL:
        // handler, flags, restorer and mask all zero. SIGKILL and SIGSTOP cannot be changed.
        let default = [0_u64; 4];
        for signal in (1..=KERNEL_SIGNALS).filter(|s| ![libc::SIGKILL, libc::SIGSTOP].contains(s)) {
            raw(libc::SYS_rt_sigaction, [signal.into(), default.as_ptr() as c_long, 0, SIGSET_BYTES])?;
        }
        let empty = 0_u64;
        let mask = std::ptr::from_ref(&empty) as c_long;
        raw(libc::SYS_rt_sigprocmask, [libc::SIG_SETMASK.into(), mask, 0, SIGSET_BYTES])?;
    }
    Ok(())
}

/// Tries each candidate as `execvp` does: along the PATH past a missing file (and past one it may not run,
/// remembering that), and through `/bin/sh` for a file with no `#!` line. Returns the errno to report.
fn exec(p: &Prepared) -> c_int {
    let mut denied = false;
    for (path, shell_argv) in p.candidates.iter().zip(&p.shell_argvs) {
        let args = [path.as_ptr() as c_long, p.argv_ptrs.as_ptr() as c_long, p.envp_ptrs.as_ptr() as c_long, 0];
        // SAFETY: the path, argv and envp are null-terminated arrays of C strings owned by `p`.
        match unsafe { raw(libc::SYS_execve, args) }.err().unwrap_or(libc::EINVAL) {
            libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT if p.searched => {}
            libc::EACCES => denied = true,
            libc::ENOEXEC => {
                let args = [SHELL.as_ptr() as c_long, shell_argv.as_ptr() as c_long, args[2], 0];
                // SAFETY: as above, with this candidate's shell arguments.
                return unsafe { raw(libc::SYS_execve, args) }.err().unwrap_or(libc::EINVAL);
            }
            other => return other,
        }
    }
    if denied {
        libc::EACCES
    } else {
        libc::ENOENT
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;

    use nix::sys::wait::{waitpid, WaitStatus};
    use rustix::pipe::{pipe_with, PipeFlags};

    use super::*;

    /// Runs `argv` with `PATH=path` and no other variable; its stdout and exit code.
    fn run(argv: &[&str], path: &str) -> io::Result<(String, i32)> {
        run_limited(argv, path, &[]).map_err(|e| match e {
            SpawnError::Limit(e) | SpawnError::Start(e) => e,
        })
    }

    /// [`run`], with resource limits.
    fn run_limited(argv: &[&str], path: &str, rlimits: &[Rlimit]) -> Result<(String, i32), SpawnError> {
        let argv: Vec<String> = argv.iter().map(|a| (*a).to_owned()).collect();
        let (stdin, _stdin_w) = pipe_with(PipeFlags::CLOEXEC).unwrap();
        let (out_r, out_w) = pipe_with(PipeFlags::CLOEXEC).unwrap();
        let stdio = Stdio::Pipes([&stdin, &out_w, &out_w]);
        let plan = Plan { argv: &argv, env: vec![("PATH", path)], cwd: "/", run_as: None, stdio, rlimits, root: None };
        // A test beside this one may be writing its script while we clone: our child then holds that file
        // open for writing until it execs, and the other test's exec meets ETXTBSY. Retry, as Go does.
        let mut spawned = spawn(&plan);
        for _ in 0..50 {
            match spawned {
                Err(SpawnError::Start(ref e)) if e.kind() == io::ErrorKind::ExecutableFileBusy => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    spawned = spawn(&plan);
                }
                _ => break,
            }
        }
        let pid = spawned?;
        drop(out_w);
        let mut out = String::new();
        std::fs::File::from(out_r).read_to_string(&mut out).unwrap();
        let WaitStatus::Exited(_, code) = waitpid(pid, None).unwrap() else { panic!("not an exit") };
        Ok((out, code))
    }

    fn file(dir: &std::path::Path, name: &str, text: &str, mode: u32) {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vm-agent-spawn-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_path_is_searched_in_order_past_missing_and_unrunnable_files() {
        let dir = scratch("path");
        let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
        for d in [&a, &b, &c] {
            std::fs::create_dir(d).unwrap();
        }
        file(&b, "prog", "#!/bin/sh\necho not-runnable\n", 0o644);
        file(&c, "prog", "#!/bin/sh\necho from-c \"$1\"\nexit 3\n", 0o755);
        let path = format!("{}:{}:{}", a.display(), b.display(), c.display());
        assert_eq!(run(&["prog", "x"], &path).unwrap(), ("from-c x\n".into(), 3));
        // Found only where it may not run: permission denied, as a shell says.
        let path = format!("{}:{}", a.display(), b.display());
        let denied = run(&["prog"], &path).unwrap_err();
        assert_eq!(denied.kind(), io::ErrorKind::PermissionDenied, "{denied}");
        let missing = run(&["prog"], &a.display().to_string()).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound, "{missing}");
        assert_eq!(run(&[""], &path).unwrap_err().kind(), io::ErrorKind::NotFound, "an empty name");
        // A name with a slash is not searched, and its own error is reported.
        let direct = c.join("prog").display().to_string();
        assert_eq!(run(&[&direct, "y"], "").unwrap(), ("from-c y\n".into(), 3));
        let through_a_file = c.join("prog/x").display().to_string();
        assert_eq!(run(&[&through_a_file], "").unwrap_err().raw_os_error(), Some(libc::ENOTDIR));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_without_an_interpreter_line_runs_through_the_shell() {
        let dir = scratch("noexec");
        file(&dir, "script", "echo through-sh \"$1\"\n", 0o755);
        let path = dir.join("script").display().to_string();
        assert_eq!(run(&[&path, "z"], "").unwrap(), ("through-sh z\n".into(), 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_nul_byte_is_refused_before_anything_runs() {
        let err = run(&["echo", "a\0b"], "/bin:/usr/bin").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn limits_reach_the_program_and_one_the_kernel_refuses_is_named() {
        let nofile = |soft, hard| Rlimit { resource: Resource::Nofile, soft, hard };
        let script = ["sh", "-c", "ulimit -Sn; ulimit -Hn"];
        let (out, code) = run_limited(&script, "/bin:/usr/bin", &[nofile(77, 99)]).unwrap();
        assert_eq!((out.as_str(), code), ("77\n99\n", 0));
        // Control: without the limit the program has the test's own.
        let (out, _) = run(&script, "/bin:/usr/bin").unwrap();
        assert_ne!(out, "77\n99\n");
        // Above fs.nr_open the kernel refuses it (EPERM), and that is told apart from a failed exec.
        let err = run_limited(&script, "/bin:/usr/bin", &[nofile(1 << 40, 1 << 40)]).unwrap_err();
        assert!(matches!(err, SpawnError::Limit(ref e) if e.raw_os_error() == Some(libc::EPERM)), "{err:?}");
    }
}
