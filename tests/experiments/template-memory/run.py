#!/usr/bin/env python3
"""Clones that share a template's memory under QEMU 7.2 (see README.md): boot the image's kernel and initramfs
as the supervisor does (TCG, microvm, 1 vCPU, 128 MiB), once cold and once as a template whose RAM is a file
(share=on), saved with x-ignore-shared (the stream holds no RAM); then restore CLONES clones as another user
(uid 65534, as a jailed VMM is), each mapping the template privately (share=off) through a sealed memfd, and
report each one's unique memory (Private_Clean + Private_Dirty in smaps_rollup) against the cold boot's.

    IMG=~/.cache/vm-driver/images/default CLONES=3 IDLE=15 sudo ./run.py
"""
import fcntl, hashlib, json, os, shutil, socket, subprocess, sys, time

IMG = os.environ.get("IMG") or os.path.expanduser("~/.cache/vm-driver/images/default")
CLONES = int(os.environ.get("CLONES", "3"))
IDLE = float(os.environ.get("IDLE", "15"))
MIB = 128
WORK = "/tmp/template-memory-%d" % os.getpid()
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def qemu(name, backend=None, incoming=False):
    """QEMU's arguments for VM `name`: the supervisor's machine, the boundary port on a null chardev."""
    machine = "microvm,pit=on,pic=on,rtc=on" + (",memory-backend=mem" if backend else "")
    a = ["qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
         "-M", machine, "-accel", "tcg,tb-size=32", "-smp", "1", "-m", "%dM" % MIB,
         "-serial", "file:%s/%s.console" % (WORK, name), "-device", "virtio-serial-device",
         "-chardev", "null,id=boundary", "-device", "virtserialport,chardev=boundary,name=vm.boundary",
         "-append", "console=ttyS0 reboot=t panic=-1 quiet 8250.nr_uarts=1 pci=off random.trust_cpu=on "
                    "no_timer_check tsc=reliable mitigations=off",
         "-kernel", "%s/vmlinuz" % WORK, "-initrd", "%s/initramfs.cpio" % WORK,
         "-qmp", "unix:%s/%s.qmp,server=on,wait=off" % (WORK, name)]
    if backend:
        a += ["-object", backend]
    if incoming:
        a += ["-incoming", "defer"]
    return a


class Monitor:
    def __init__(self, name, proc):
        deadline = time.time() + 10
        while True:
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect("%s/%s.qmp" % (WORK, name))
                break
            except OSError:
                s.close()
                if proc.poll() is not None or time.time() > deadline:
                    sys.exit("%s did not start: %s" % (name, proc.stderr.read().decode()[-400:]))
                time.sleep(0.05)
        self.f = s.makefile("rw")
        self.f.readline()
        self.call("qmp_capabilities")

    def call(self, command, **arguments):
        self.f.write(json.dumps({"execute": command, "arguments": arguments}) + "\n")
        self.f.flush()
        while True:
            reply = json.loads(self.f.readline())
            if "error" in reply:
                sys.exit("%s: %s" % (command, reply["error"]))
            if "return" in reply:
                return reply["return"]


def ignore_shared(mon):
    mon.call("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])


def unique_mib(pid):
    fields = {}
    for line in open("/proc/%d/smaps_rollup" % pid):
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0].rstrip(":")] = int(parts[1])
    return (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024, fields["Rss"] / 1024


def main():
    os.makedirs(WORK)
    os.chmod(WORK, 0o777)  # the clones' console files and monitors, as uid 65534
    for f in ("vmlinuz", "initramfs.cpio"):
        shutil.copy(os.path.join(IMG, f), WORK)
        os.chmod(os.path.join(WORK, f), 0o644)
    procs = []
    try:
        cold = subprocess.Popen(qemu("cold"), stderr=subprocess.PIPE)
        procs.append(cold)

        ram = "/dev/shm/template-memory-%d.ram" % os.getpid()
        template = subprocess.Popen(qemu("template", "memory-backend-file,id=mem,size=%dM,mem-path=%s,share=on"
                                         % (MIB, ram)), stderr=subprocess.PIPE)
        procs.append(template)
        time.sleep(IDLE)
        mon = Monitor("template", template)
        mon.call("stop")
        ignore_shared(mon)
        state = os.path.join(WORK, "template.state")
        mon.call("migrate", uri="exec:cat > %s" % state)
        while mon.call("query-migrate").get("status") not in ("completed", "failed", "cancelled"):
            time.sleep(0.05)
        mon.call("quit")
        template.wait()
        os.chmod(state, 0o444)
        print("template saved: %d bytes of stream besides its %d MiB RAM file" % (os.path.getsize(state), MIB))

        # A read-only file cannot be a private backing: QEMU 7.2 opens it read-write whatever `share` is.
        os.chmod(ram, 0o444)
        probe = subprocess.Popen(NOBODY + qemu("probe", "memory-backend-file,id=mem,size=%dM,mem-path=%s,share=off"
                                               % (MIB, ram)), stderr=subprocess.PIPE)
        probe.wait(timeout=30)
        print("a 0444 RAM file, share=off, as uid 65534: %s" % probe.stderr.read().decode().strip())

        # A sealed memfd instead: no process may write it, any may map it privately.
        fd = os.memfd_create("template", os.MFD_ALLOW_SEALING)
        with open(ram, "rb") as src:
            shutil.copyfileobj(src, os.fdopen(os.dup(fd), "wb"))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        before = hashlib.sha256(open("/proc/self/fd/%d" % fd, "rb").read()).hexdigest()
        clones = []
        for i in range(CLONES):
            name = "clone%d" % i
            backend = "memory-backend-file,id=mem,size=%dM,mem-path=/proc/self/fd/%d,share=off" % (MIB, fd)
            clone = subprocess.Popen(NOBODY + qemu(name, backend, incoming=True), pass_fds=[fd], stderr=subprocess.PIPE)
            procs.append(clone)
            mon = Monitor(name, clone)
            ignore_shared(mon)
            start = time.time()
            mon.call("migrate-incoming", uri="exec:cat %s" % state)
            while mon.call("query-status")["status"] == "inmigrate":
                time.sleep(0.01)
            took = time.time() - start
            mon.call("cont")
            clones.append((name, clone, took))
        time.sleep(IDLE)
        cold_unique, cold_rss = unique_mib(cold.pid)
        print("| VM | restore (s) | RSS (MiB) | unique (MiB) | of the cold boot's |")
        print("|---|---|---|---|---|")
        print("| cold boot | - | %.0f | %.0f | 1.00 |" % (cold_rss, cold_unique))
        for name, clone, took in clones:
            if clone.poll() is not None:
                sys.exit("%s ended: %s" % (name, clone.stderr.read().decode()[-400:]))
            unique, rss = unique_mib(clone.pid)
            print("| %s | %.3f | %.0f | %.0f | %.2f |" % (name, took, rss, unique, unique / cold_unique))
        after = hashlib.sha256(open("/proc/self/fd/%d" % fd, "rb").read()).hexdigest()
        print("template unchanged after the clones ran: %s" % (before == after))
        try:
            os.pwrite(fd, b"x", 0)
            print("a write to the sealed template: ALLOWED")
        except OSError as e:
            print("a write to the sealed template: refused (%s)" % e.strerror)
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(WORK, ignore_errors=True)
        for f in os.listdir("/dev/shm"):
            if f == "template-memory-%d.ram" % os.getpid():
                os.unlink(os.path.join("/dev/shm", f))


if __name__ == "__main__":
    main()
