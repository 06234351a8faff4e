"""A generic gRPC client drives vm-driver serve through a full sandbox lifecycle.

It knows nothing of the project's code: it discovers the service and its messages through server
reflection, builds requests from the discovered descriptors, and calls the RPCs by name.

    grpc_lifecycle.py SOCKET SANDBOX_ID
"""

import sys
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

SERVICE = "vmdriver.v1.Driver"


def load_pool(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    services = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = [s.name for s in services[0].list_services_response.service]
    assert SERVICE in names, f"reflection does not list {SERVICE}: {names}"
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
    pool = descriptor_pool.DescriptorPool()
    for response in stub.ServerReflectionInfo(iter([request])):
        for raw in response.file_descriptor_response.file_descriptor_proto:
            proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
            try:
                pool.Add(proto)
            except TypeError:
                pass
    return pool


class Driver:
    def __init__(self, channel, pool):
        self.channel = channel
        self.pool = pool
        self.service = pool.FindServiceByName(SERVICE)

    def msg(self, name, **fields):
        cls = message_factory.GetMessageClass(self.pool.FindMessageTypeByName("vmdriver.v1." + name))
        return cls(**fields)

    def _method(self, name):
        m = self.service.FindMethodByName(name)
        req = message_factory.GetMessageClass(m.input_type)
        resp = message_factory.GetMessageClass(m.output_type)
        path = f"/{SERVICE}/{name}"
        kind = (m.client_streaming, m.server_streaming)
        make = {
            (False, False): self.channel.unary_unary,
            (False, True): self.channel.unary_stream,
            (True, True): self.channel.stream_stream,
        }[kind]
        return make(path, request_serializer=req.SerializeToString, response_deserializer=resp.FromString)

    def call(self, name, request):
        return self._method(name)(request, timeout=120)

    def state(self, sandbox_id):
        sandbox = self.call("GetSandbox", self.msg("SandboxRef", sandbox_id=sandbox_id))
        return self.pool.FindEnumTypeByName("vmdriver.v1.SandboxState").values_by_number[sandbox.state].name

    def listed(self, sandbox_id):
        sandboxes = self.call("ListSandboxes", self.msg("ListSandboxesRequest")).sandboxes
        states = self.pool.FindEnumTypeByName("vmdriver.v1.SandboxState")
        return {s.sandbox_id: states.values_by_number[s.state].name for s in sandboxes}.get(sandbox_id)

    def watch_until(self, sandbox_id, wanted, limit=120):
        states = self.pool.FindEnumTypeByName("vmdriver.v1.SandboxState")
        stream = self.call("Watch", self.msg("WatchRequest", sandbox_id=sandbox_id))
        deadline = time.time() + limit
        for event in stream:
            if event.HasField("changed"):
                name = states.values_by_number[event.changed.state].name
                if name == wanted:
                    stream.cancel()
                    return
                assert name != "FAILED", f"sandbox failed: {event.changed.detail}"
            assert time.time() < deadline, f"not {wanted} within {limit} s"
        raise AssertionError("watch ended")

    def exec(self, sandbox_id, argv, stdin=b"", files=None):
        def requests():
            if files is None:
                yield self.msg("ExecRequest", start=self.msg("ExecStart", sandbox_id=sandbox_id, argv=argv))
            else:
                yield self.msg("ExecRequest", files=self.msg("FilesStart", sandbox_id=sandbox_id, **files))
            if stdin:
                yield self.msg("ExecRequest", stdin=stdin)
            yield self.msg("ExecRequest", stdin_eof=self.msg("StdinEof"))

        out, code = b"", None
        for response in self._method("Exec")(requests(), timeout=120):
            if response.HasField("stdout"):
                out += response.stdout
            elif response.HasField("exited"):
                code = response.exited.status
        return out, code


def main():
    socket, sandbox_id = sys.argv[1], sys.argv[2]
    # grpcio would send the socket path as :authority, which HTTP/2 servers reject; name a host instead.
    channel = grpc.insecure_channel(f"unix:{socket}", options=[("grpc.default_authority", "localhost")])
    driver = Driver(channel, load_pool(channel))

    caps = driver.call("GetCapabilities", driver.msg("GetCapabilitiesRequest"))
    print(f"grpc: driver {caps.driver_version}, accelerator {caps.accelerator}")
    bad = driver.call("ValidateCreate", driver.msg("CreateSandboxRequest", sandbox_id="../escape"))
    assert not bad.ok and bad.problems, "a bad id is reported by ValidateCreate"

    created = driver.call("CreateSandbox", driver.msg("CreateSandboxRequest", sandbox_id=sandbox_id))
    states = driver.pool.FindEnumTypeByName("vmdriver.v1.SandboxState")
    assert states.values_by_number[created.state].name == "PROVISIONING", "create returns at once"
    print("grpc: created, provisioning")
    driver.watch_until(sandbox_id, "READY")
    assert driver.listed(sandbox_id) == "READY"
    out, code = driver.exec(sandbox_id, ["/bin/sh", "-c", "cat; echo from-the-guest; exit 4"], stdin=b"hello ")
    assert (out, code) == (b"hello from-the-guest\n", 4), (out, code)
    print("grpc: exec ok")

    # The files API: the first message is a file operation; stdin in, stdout out, an exit status.
    written = b"through the files API\n" * 100
    write = {"write": driver.msg("FileWrite", path="/tmp/grpc-file", mode=0o600)}
    assert driver.exec(sandbox_id, [], stdin=written, files=write) == (b"", 0)
    read = {"read": driver.msg("FilePath", path="/tmp/grpc-file")}
    assert driver.exec(sandbox_id, [], files=read) == (written, 0), "the file reads back whole"
    out, code = driver.exec(sandbox_id, ["ls", "-ln", "/tmp/grpc-file"])
    assert code == 0 and out.split()[0:4] == [b"-rw-------", b"1", b"1000", b"1000"], out
    missing = {"read": driver.msg("FilePath", path="/tmp/no-such-file")}
    assert driver.exec(sandbox_id, [], files=missing)[1] == 1, "a missing file is exit status 1"
    print("grpc: files ok")

    driver.call("StopSandbox", driver.msg("SandboxRef", sandbox_id=sandbox_id))
    assert driver.listed(sandbox_id) == "STOPPED", driver.listed(sandbox_id)
    driver.call("StartSandbox", driver.msg("SandboxRef", sandbox_id=sandbox_id))
    assert driver.listed(sandbox_id) in ("PROVISIONING", "READY")
    driver.watch_until(sandbox_id, "READY")
    out, code = driver.exec(sandbox_id, ["uname", "-r"])
    assert code == 0 and out.strip().endswith(b"-cloud-amd64"), (out, code)
    print("grpc: exec after restart ok")

    driver.call("DeleteSandbox", driver.msg("SandboxRef", sandbox_id=sandbox_id))
    assert driver.listed(sandbox_id) is None
    try:
        driver.call("GetSandbox", driver.msg("SandboxRef", sandbox_id=sandbox_id))
        raise AssertionError("a deleted sandbox is still there")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e.code()
    print("grpc: lifecycle complete")


if __name__ == "__main__":
    main()
