"""A token issuer for docker-registry's token auth (distribution's `auth: token`), for the image tests.

    token_server.py DIR PORT SERVICE USER PASSWORD

Makes an ES256 signing key and a self-signed certificate for it (DIR/token-signer.pem, which the registry's
`rootcertbundle` names), then serves https://127.0.0.1:PORT/token with DIR/server.crt and DIR/server.key:
a request with the right Basic login gets a JWT for the scopes it asks (pull and push), signed with the key and
carrying the certificate (`x5c`), as distribution verifies it; any other request gets 401. Each grant is
appended to DIR/token-grants.log. Prints "ready" once listening.
"""

import base64
import datetime
import http.server
import json
import os
import ssl
import sys
import urllib.parse

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ISSUER = "e2e-token-issuer"


def signer(directory):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    with open(os.path.join(directory, "token-signer.pem"), "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key, base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()


def main():
    directory, port, service, user, password = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    key, x5c = signer(directory)
    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    grants = os.path.join(directory, "token-grants.log")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            query = urllib.parse.parse_qs(url.query)
            if url.path != "/token" or query.get("service") != [service]:
                self.send_error(404)
                return
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="e2e-token"')
                self.end_headers()
                return
            access = []
            for scope in query.get("scope", []):
                kind, _, rest = scope.partition(":")
                name, _, actions = rest.rpartition(":")
                granted = [a for a in actions.split(",") if a in ("pull", "push")]
                if kind == "repository" and granted:
                    access.append({"type": "repository", "name": name, "actions": granted})
            now = datetime.datetime.now(datetime.timezone.utc)
            claims = {
                "iss": ISSUER,
                "sub": user,
                "aud": service,
                "iat": now,
                "nbf": now - datetime.timedelta(seconds=30),
                "exp": now + datetime.timedelta(minutes=5),
                "jti": base64.b16encode(os.urandom(8)).decode(),
                "access": access,
            }
            token = jwt.encode(claims, key, algorithm="ES256", headers={"x5c": [x5c]})
            with open(grants, "a") as f:
                f.write(json.dumps(access) + "\n")
            body = json.dumps({"token": token, "expires_in": 300}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(os.path.join(directory, "server.crt"), os.path.join(directory, "server.key"))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
