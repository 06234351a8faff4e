"""A hostile workload against the supervisor's TLS interception, run in the guest.

    hostile_tls.py GATEWAY PORT NAMES

Through the loopback HTTP proxy: TLS to NAMES distinct hosts under flood.test (each must verify with the
sandbox's CA: one leaf per host); a request head that never ends; an HTTP/2 connection that opens and
resets streams without end. Prints one line per attack.
"""

import socket
import ssl
import sys

GATEWAY, PORT, NAMES = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def tunnel(host):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=60)
    s.sendall(b"CONNECT %s:%d HTTP/1.1\r\n\r\n" % (host.encode(), PORT))
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = s.recv(1)
        if not byte:
            raise OSError("the proxy closed the tunnel")
        head += byte
    return s


def names():
    context = ssl.create_default_context()
    verified = 0
    for i in range(NAMES):
        host = "h%d.flood.test" % i
        with context.wrap_socket(tunnel(host), server_hostname=host):
            verified += 1
    print("names", verified, flush=True)


def answered(t):
    """What the proxy answered so far: None while nothing (TLS records that carry no data, such as session
    tickets, do not count), else its first bytes (empty once it closed)."""
    t.settimeout(0.0)
    try:
        return t.recv(12)
    except (ssl.SSLWantReadError, BlockingIOError):
        return None
    finally:
        t.settimeout(60)


def endless_head():
    t = ssl.create_default_context().wrap_socket(tunnel(GATEWAY), server_hostname=GATEWAY)
    t.sendall(b"GET /file.txt HTTP/1.1\r\nHost: %s:%d\r\n" % (GATEWAY.encode(), PORT))
    sent = 0
    answer = b"not cut"
    try:
        # Looks for an answer between lines, as a client that reads while it writes does: the proxy's
        # answer then arrives before the reset that the lines sent after it earn.
        while sent < 8 << 20:
            early = answered(t)
            if early is not None:
                answer = early or b"closed"
                break
            # 16 KiB a write: the 64 KiB bound is passed in a handful of writes, long before the proxy's 10 s
            # head timeout on a loaded host, and the workload is still sending when the proxy answers and
            # closes, which must not lose the answer (docs/network.md, "an intercepted request head").
            t.sendall((b"X-Filler: " + b"a" * 1000 + b"\r\n") * 16)
            sent += 16 * 1012
    except OSError:
        answer = b"cut"
        try:
            t.settimeout(10)
            answer = t.recv(12) or answer
        except OSError:
            pass
    print("head", "bounded" if sent < 1 << 20 else "unbounded", answer.decode(errors="replace"), flush=True)


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def h2_flood():
    context = ssl.create_default_context()
    context.set_alpn_protocols(["h2"])
    t = context.wrap_socket(tunnel(GATEWAY), server_hostname=GATEWAY)
    assert t.selected_alpn_protocol() == "h2", t.selected_alpn_protocol()
    t.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
    authority = b"%s:%d" % (GATEWAY.encode(), PORT)
    # :method GET, :scheme https, :path /, then :authority as a literal without indexing.
    block = b"\x82\x87\x84\x01" + bytes([len(authority)]) + authority
    opened, stream = 0, 1
    try:
        while opened < 100000:
            # HEADERS (END_STREAM | END_HEADERS), then at once RST_STREAM (CANCEL).
            t.sendall(frame(1, 0x5, stream, block) + frame(3, 0, stream, (8).to_bytes(4, "big")))
            stream += 2
            opened += 1
    except OSError:
        pass
    data = b""
    try:
        while True:
            chunk = t.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    goaway, at = False, 0
    while at + 9 <= len(data):
        length, kind = int.from_bytes(data[at : at + 3], "big"), data[at + 3]
        goaway = goaway or kind == 7
        at += 9 + length
    # The GOAWAY may be cut with the connection: the proof is the bound and the supervisor's finding.
    print("h2", "goaway" if goaway else "cut", "bounded" if opened < 100000 else "unbounded", flush=True)


names()
endless_head()
h2_flood()
