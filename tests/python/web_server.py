"""A file server for the network tests: plain HTTP, or HTTPS with the given certificate.

    web_server.py DIR [CERT KEY]

Serves DIR on 127.0.0.1 at a free port and prints that port once listening. Each request's method and path
are appended to DIR/../requests.log, so a test can tell which requests reached it, and its Authorization
header to DIR/../authorization.log, so a test can tell which credential reached it. A POST is answered
with the length of its body.
"""

import functools
import http.server
import os
import ssl
import sys


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):
        parent = os.path.dirname(os.path.abspath(self.directory))
        with open(os.path.join(parent, "requests.log"), "a") as log:
            log.write("%s %s\n" % (self.command, self.path))
        if self.headers is not None and "Authorization" in self.headers:
            with open(os.path.join(parent, "authorization.log"), "a") as log:
                log.write("%s\n" % self.headers["Authorization"])

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        answer = ("posted %d\n" % len(body)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


def main():
    directory = sys.argv[1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=directory))
    if len(sys.argv) == 4:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(sys.argv[2], sys.argv[3])
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
