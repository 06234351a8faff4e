#!/usr/bin/env python3
"""Host side of the splice experiment (see README.md): boot the image's kernel and initramfs as the supervisor
does (TCG, microvm, 1 vCPU, virtio-serial port `vm.boundary`), with `splicetest` as the guest's program, read
the channel (slowly with SLOW=seconds-per-read, so the virtqueue fills), and check the u64 counter pattern
byte for byte.

    gcc -static -O2 -o splicetest splicetest.c
    IMG=~/.cache/vm-driver/images/default [DEVOPTS=,indirect_desc=off] [SLOW=0.002] [RSIZE=16384] \
        ./run.py MODE TOTAL CHUNK [PIPE_BYTES] [SPLICE_FLAGS]
"""
import os, socket, subprocess, sys, time, threading, array
here = os.path.dirname(os.path.abspath(__file__))
img = os.environ.get("IMG") or os.environ.get("VM_DRIVER_IMAGE") or os.path.expanduser("~/.cache/vm-driver/images/default")
args = sys.argv[1:]  # passed to splicetest
slow = float(os.environ.get("SLOW", "0"))  # seconds to sleep per read
rsize = int(os.environ.get("RSIZE", "65536"))
work = "/tmp/splice-into-port-%d" % os.getpid()
os.makedirs(work)

def newc(entries):
    out = bytearray(); ino = 1000
    for name, mode, data in entries + [("TRAILER!!!", 0, b"")]:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join("%08x" % v for v in [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0])
        out += hdr.encode() + nb
        out += b"\0" * ((4 - len(out) % 4) % 4)
        out += data
        out += b"\0" * ((4 - len(out) % 4) % 4)
        ino += 1
    return bytes(out)

script = f"""#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(/bin/busybox cat /etc/vm-agent/modules); do /bin/busybox insmod $m; done
while [ ! -e /sys/class/virtio-ports/vport0p1/name ]; do :; done
for d in /sys/bus/virtio/devices/*; do echo "FEATURES $d $(/bin/busybox cat $d/features) driver=$(/bin/busybox readlink $d/driver)"; done
/bin/busybox uname -r
/splicetest {' '.join(args)}
/bin/busybox dmesg | /bin/busybox grep -i -A3 "warn\|virtio\|splice" | /bin/busybox tail -n 20
echo SPLICETEST_DONE
/bin/busybox sleep 600
"""
extra = newc([("init", 0o100755, script.encode()), ("splicetest", 0o100755, open(os.path.join(here, "splicetest"), "rb").read())])
initrd = os.path.join(work, "initrd.cpio")
open(initrd, "wb").write(open(os.path.join(img, "initramfs.cpio"), "rb").read() + extra)
chan = socket.socket(socket.AF_UNIX); chan.bind(os.path.join(work, "chan.sock")); chan.listen(1)
cons = socket.socket(socket.AF_UNIX); cons.bind(os.path.join(work, "cons.sock")); cons.listen(1)
kargs = "console=ttyS0 reboot=t panic=-1 8250.nr_uarts=1 pci=off random.trust_cpu=on cryptomgr.notests tsc_early_khz=2000000 no_timer_check mitigations=off"
q = subprocess.Popen(["qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
    "-M", "microvm,pit=on,pic=on,rtc=on", "-accel", "tcg,tb-size=32", "-smp", "1", "-m", "512M",
    "-chardev", "socket,id=console,path=cons.sock,server=off", "-serial", "chardev:console",
    "-device", "virtio-serial-device" + os.environ.get("DEVOPTS", ""), "-chardev", "socket,id=boundary,path=chan.sock,server=off",
    "-device", "virtserialport,chardev=boundary,name=vm.boundary", "-append", kargs,
    "-kernel", os.path.join(img, "vmlinuz"), "-initrd", initrd], cwd=work, stdin=subprocess.DEVNULL)
console_text = []
def read_console():
    c, _ = cons.accept()
    while True:
        b = c.recv(65536)
        if not b: break
        console_text.append(b)
threading.Thread(target=read_console, daemon=True).start()
c, _ = chan.accept()
data = bytearray(); first = last = None
c.settimeout(float(os.environ.get("IDLE", "10")))
expected = int(args[1])
while len(data) < expected:
    try:
        b = c.recv(rsize)
    except socket.timeout:
        print("HOST idle timeout"); break
    if not b: break
    if first is None: first = time.time()
    last = time.time()
    data += b
    if slow: time.sleep(slow)
time.sleep(0.5); q.kill(); q.wait()
time.sleep(0.2)
n = len(data) // 8
gaps = []
arr = array.array("Q"); arr.frombytes(bytes(data[: n * 8]))
prev = -1
for idx in range(len(arr)):
    v = arr[idx]
    if v != prev + 1:
        gaps.append((idx * 8, prev + 1, v))
        if len(gaps) > 20: break
    prev = v
print("".join(x.decode(errors="replace") for x in console_text).strip())
span = (last - first) if first else 0
print(f"HOST received={len(data)} tail_bytes={len(data) % 8} gaps={len(gaps)} first_gaps={gaps[:5]} span={span:.3f}s MB/s={len(data)/span/1e6 if span else 0:.1f}")
import shutil; shutil.rmtree(work, ignore_errors=True)
