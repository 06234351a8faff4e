//! `vm-driver launch -it -- /bin/sh` in a real terminal (a tmux pane): a prompt, the pane's size inside, a
//! resize seen, and the terminal restored after the shell exits.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use vm_test_support::procs::{ProcInfo, Watcher};
use vm_test_support::{wait_until, Launch, Scratch};

/// A tmux server of the test's own, on a socket in its scratch directory.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux").arg("-S").arg(&self.socket).args(args).output().expect("tmux");
        assert!(out.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "t"])
    }

    /// Waits until the screen shows `text`; the screen, either way.
    fn wait_for(&self, text: &str) -> String {
        let mut screen = String::new();
        let seen = wait_until(Duration::from_secs(120), || {
            screen = self.screen();
            screen.contains(text)
        });
        assert!(seen, "waited for {text:?}; the screen:\n{screen}");
        screen
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").arg("-S").arg(&self.socket).arg("kill-server").status();
    }
}

fn quote(arg: &std::ffi::OsStr) -> String {
    format!("'{}'", arg.to_string_lossy().replace('\'', r"'\''"))
}

#[test]
fn launch_it_runs_a_shell_on_a_terminal_of_the_panes_size_and_restores_it() {
    let s = Scratch::new("launch-tty");
    let launch = Launch::new(&s, &["/bin/sh"]).flag("-it").command();
    let line: Vec<String> = std::iter::once(launch.get_program()).chain(launch.get_args()).map(quote).collect();
    // The pane's shell runs the launch, then shows its status and the terminal's settings once it is back.
    let script = format!("{}; echo \"exit=$?\"; stty -a; echo \"settings-$((6 * 7))\"; sleep 600", line.join(" "));
    let tmux = Tmux { socket: s.dir.join("tmux.sock") };
    let watcher = Watcher::start(&s.dir);
    tmux.run(&["new-session", "-d", "-s", "t", "-x", "100", "-y", "30", "sh", "-c", &script]);

    // The shell's prompt (tmux trims the space after it).
    tmux.wait_for(" $");
    // Each marker is computed by the shell, so the echoed command line never matches it.
    tmux.run(&["send-keys", "-t", "t", "stty size; echo size-$((6 * 7))", "Enter"]);
    let screen = tmux.wait_for("size-42");
    assert!(screen.contains("30 100"), "the guest terminal has the pane's size:\n{screen}");

    tmux.run(&["resize-window", "-t", "t", "-x", "120", "-y", "40"]);
    std::thread::sleep(Duration::from_millis(500));
    tmux.run(&["send-keys", "-t", "t", "clear; stty size; echo resized-$((6 * 7))", "Enter"]);
    let screen = tmux.wait_for("resized-42");
    assert!(screen.contains("40 120"), "the resize reached the guest:\n{screen}");

    tmux.run(&["send-keys", "-t", "t", "exit 7", "Enter"]);
    // Wait for the line after the settings, so the screen holds all of them.
    let screen = tmux.wait_for("settings-42");
    assert!(screen.contains("exit=7"), "the shell's status came back:\n{screen}");
    assert!(screen.contains(" icanon") && screen.contains(" echo "), "the terminal is cooked again:\n{screen}");
    let seen = watcher.stop();
    let accel = seen.iter().find(|p| p.is_qemu()).and_then(ProcInfo::accel);
    eprintln!("e2e: accelerator used: {}", accel.unwrap_or_default());
    eprintln!("e2e: launch -it in tmux: prompt, 30x100 then 40x120, exit 7, terminal restored");
}
