"""A file server for the network tests: plain HTTP, or HTTPS with the given certificate.

    web_server.py DIR [CERT KEY]

Serves DIR on 127.0.0.1 at a free port and prints that port once listening. Each request's method and path
are appended to DIR/../requests.log, so a test can tell which requests reached it.
"""

import functools
import http.server
import os
import ssl
import sys


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):
        with open(os.path.join(os.path.dirname(os.path.abspath(self.directory)), "requests.log"), "a") as log:
            log.write("%s %s\n" % (self.command, self.path))


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
